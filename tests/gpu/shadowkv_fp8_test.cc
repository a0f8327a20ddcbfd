// FP8 ShadowKV state on the GPU against the CPU codec (core/fp8.h): the value store written at
// compression holds exactly the CPU's codes and scales, the value fetch writes exactly the
// bf16 rounding of code · scale into the gather rows, and the landmarks are the CPU
// quantisation of the same fp32 chunk means; FP8 exact keys are coded less their landmark.
#include <cmath>
#include <cstring>

#include "core/fp8.h"
#include "gpu_test_util.h"
#include "ops/cuda/shadowkv/shadowkv_kernels.cuh"

namespace shadowkv::cuda {
namespace {

using namespace testing;

constexpr int kLayers = 2, kHeads = 2, kDim = 128, kChunk = 8, kChunks = 64, kSlots = 2;
constexpr int kTokens = kChunks * kChunk;

// Random bf16 K or V for a full cache of kSlots slots; chunk c of every head is scaled by a
// factor that varies over four orders of magnitude, and chunk 5 of every head is zero.
std::vector<float> CacheValues(std::mt19937& rng) {
  std::vector<float> values =
      RandomBf16Values(int64_t{kSlots} * kLayers * kHeads * kTokens * kDim, rng);
  for (int64_t row = 0; row < int64_t{kSlots} * kLayers * kHeads * kTokens; ++row) {
    const int chunk = static_cast<int>(row % kTokens) / kChunk;
    const float factor = chunk == 5 ? 0.0f : std::ldexp(1.0f, chunk % 13 - 6);
    for (int e = 0; e < kDim; ++e) {
      float& v = values[row * kDim + e];
      v = Bf16ToFp32(Fp32ToBf16(v * factor));
    }
  }
  return values;
}

// A full cache of kSlots slots: random K then V from one seed (CacheValues), fp32 on the host
// and bf16 on the device.
struct TestCache {
  std::vector<float> keys, values;
  DeviceBuffer<uint16_t> d_keys, d_values;

  explicit TestCache(uint32_t seed) {
    std::mt19937 rng(seed);
    keys = CacheValues(rng);
    values = CacheValues(rng);
    d_keys = ToDevice(ToBf16(keys));
    d_values = ToDevice(ToBf16(values));
  }
  KvCacheView View() {
    return KvCacheView{reinterpret_cast<__nv_bfloat16*>(d_keys.get()),
                       reinterpret_cast<__nv_bfloat16*>(d_values.get()),
                       kSlots,
                       kLayers,
                       kHeads,
                       kDim,
                       kTokens};
  }
};

SkvLayout Fp8Layout() {
  SkvLayout l;
  l.num_layers = kLayers;
  l.num_kv_heads = kHeads;
  l.head_dim = kDim;
  l.group = 4;
  l.chunk_size = kChunk;
  l.rank = 16;
  l.capacity_chunks = kChunks;
  l.max_budget = 16;
  l.recent_capacity = 40;
  l.fp8_values = 1;
  l.fp8_landmarks = 1;
  return l;
}

// FP8 landmark buffers for one sequence, set in `l`, and the parameters of LaunchSkvLandmarks
// for every chunk of layer 1 of cache slot 1 into sequence 0 (with `l` as it is then).
struct LandmarkLaunch {
  static constexpr int64_t kLandmarks = int64_t{kLayers} * kHeads * kChunks;
  DeviceBuffer<uint8_t> codes = Poisoned<uint8_t>(kLandmarks * kDim);
  DeviceBuffer<float> scales = Poisoned<float>(kLandmarks);
  DeviceBuffer<uint8_t> outlier = Poisoned<uint8_t>(kLandmarks);
  DeviceBuffer<float> min_cosine = Poisoned<float>(int64_t{kHeads} * kChunks);
  SkvLandmarkParams params;

  LandmarkLaunch(SkvLayout& l, TestCache& cache) {
    l.landmark_codes = codes.get();
    l.landmark_scales = scales.get();
    l.outlier = outlier.get();
    params.layout = l;
    params.seq = 0;
    params.layer = 1;
    params.cache_layer = 1;
    params.cache = cache.View();
    params.cache_slot = 1;
    params.num_chunks = kChunks;
    params.min_cosine = min_cosine.get();
  }
};

// The fetch's view of sequence 0's attention rows: kGatherBase rows before its 16 gather slots.
constexpr int kGatherBase = 2 * kChunk, kAttnCapacity = kGatherBase + 16 * kChunk + 40;
KvCacheView AttnView() {
  return KvCacheView{nullptr, nullptr, 1, kLayers, kHeads, kDim, kAttnCapacity};
}

// First element of gather slot `slot` of head h at `layer` in AttnView's rows.
int64_t GatherRow(int layer, int h, int slot) {
  return AttnView().HeadOffset(0, layer, h) + (int64_t{kGatherBase} + slot * kChunk) * kDim;
}

// Row 0 (sequence 0) fetches the chunks of `miss` [kHeads, 16 slots] (-1: none) at `layer` with
// LaunchSkvFetchValues; the attention rows it wrote, keys and values (0xFFFF where untouched).
struct Gathered {
  std::vector<uint16_t> keys, values;
};
Gathered FetchMisses(SkvLayout l, int layer, const std::vector<int32_t>& miss) {
  auto d_miss = ToDevice(miss);
  auto d_info = ToDevice(std::vector<SkvSequenceInfo>{SkvSequenceInfo{2, 16, kGatherBase, 0}});
  auto d_meta = ToDevice(std::vector<SkvRowMeta>(1));
  const int64_t elements = int64_t{kLayers} * kHeads * kAttnCapacity * kDim;
  auto d_keys = Poisoned<uint16_t>(elements);
  auto d_values = Poisoned<uint16_t>(elements);
  l.info = d_info.get();
  l.attn = AttnView();
  l.attn.keys = reinterpret_cast<__nv_bfloat16*>(d_keys.get());
  l.attn.values = reinterpret_cast<__nv_bfloat16*>(d_values.get());
  SkvDecodeParams p;
  p.layout = l;
  p.meta = d_meta.get();
  p.rows = 1;
  p.layer = layer;
  p.miss_chunk = d_miss.get();
  EXPECT_EQ(LaunchSkvFetchValues(p, nullptr), cudaSuccess);
  return {ToHost(d_keys), ToHost(d_values)};
}

TEST(CudaShadowKvFp8Test, StoredValuesAreTheCpuCodesAndTheFetchDecodesThem) {
  SKV_SKIP_WITHOUT_GPU();
  TestCache cache(3);
  const std::vector<float>& values = cache.values;
  const int64_t runs = int64_t{kLayers} * kHeads * kChunks;
  const int64_t store_bytes = runs * kChunk * kDim + runs * 4;
  auto d_store = Poisoned<uint8_t>(store_bytes);
  auto d_table = ToDevice(
      std::vector<__nv_bfloat16*>(1, reinterpret_cast<__nv_bfloat16*>(d_store.get())));
  SkvLayout l = Fp8Layout();
  l.values = d_table.get();

  // Sequence 0 from cache slot 1, layer 1, the first 50 chunks.
  constexpr int kLayer = 1, kSlot = 1, kStored = 50;
  SkvLandmarkParams sp;  // the store reads all but min_cosine
  sp.layout = l;
  sp.seq = 0;
  sp.layer = kLayer;
  sp.cache_layer = kLayer;
  sp.cache = cache.View();
  sp.cache_slot = kSlot;
  sp.num_chunks = kStored;
  SKV_ASSERT_CUDA(LaunchSkvStoreValuesFp8(sp, nullptr));
  const std::vector<uint8_t> store = ToHost(d_store);
  const int64_t scales_at = runs * kChunk * kDim;
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kChunks; ++c) {
      const int64_t run = (int64_t{kLayer} * kHeads + h) * kChunks + c;
      const uint8_t* got = store.data() + run * kChunk * kDim;
      float got_scale;
      std::memcpy(&got_scale, store.data() + scales_at + run * 4, 4);
      if (c >= kStored) {  // untouched
        EXPECT_EQ(got[0], 0xFF) << "chunk " << c;
        continue;
      }
      const float* source = values.data() + sp.cache.HeadOffset(kSlot, kLayer, h) +
                            int64_t{c} * kChunk * kDim;
      std::vector<uint8_t> want(kChunk * kDim);
      const float want_scale = QuantizeFp8Run(source, kChunk * kDim, want.data());
      EXPECT_EQ(got_scale, want_scale) << "head " << h << " chunk " << c;
      EXPECT_EQ(std::memcmp(got, want.data(), want.size()), 0) << "head " << h << " chunk " << c;
    }
  }

  // Fetch: row 0 (sequence 0) misses chunks into some of its 16 slots of each head.
  std::vector<int32_t> miss(kHeads * 16, -1);
  for (int h = 0; h < kHeads; ++h) {
    for (int slot = 0; slot < 16; slot += 1 + h) miss[h * 16 + slot] = (slot * 7 + h * 3) % kStored;
  }
  miss[0] = 5;  // the zero chunk
  const std::vector<uint16_t> gathered = FetchMisses(l, kLayer, miss).values;
  ASSERT_FALSE(HasFailure());
  int64_t checked = 0;
  for (int h = 0; h < kHeads; ++h) {
    for (int slot = 0; slot < 16; ++slot) {
      const uint16_t* got = gathered.data() + GatherRow(kLayer, h, slot);
      const int chunk = miss[h * 16 + slot];
      if (chunk < 0) {
        EXPECT_EQ(got[0], 0xFFFF) << "slot " << slot << " was written";
        continue;
      }
      const int64_t run = (int64_t{kLayer} * kHeads + h) * kChunks + chunk;
      float scale;
      std::memcpy(&scale, store.data() + scales_at + run * 4, 4);
      for (int i = 0; i < kChunk * kDim; ++i) {
        const float want = Fp8E4m3ToFp32(store[run * kChunk * kDim + i]) * scale;
        ASSERT_EQ(got[i], Fp32ToBf16(want)) << "head " << h << " slot " << slot << " i " << i;
        // And close to the value it stands for: e4m3 keeps 3 mantissa bits.
        const float original = values[sp.cache.HeadOffset(kSlot, kLayer, h) +
                                      int64_t{chunk} * kChunk * kDim + i];
        ASSERT_LE(std::abs(Bf16ToFp32(got[i]) - original),
                  std::abs(original) / 16 + scale / 512 + std::abs(original) / 128);
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 16);
}

TEST(CudaShadowKvFp8Test, LandmarksAreTheCpuQuantisationOfTheChunkMeans) {
  SKV_SKIP_WITHOUT_GPU();
  TestCache cache(4);
  const std::vector<float>& keys = cache.keys;
  SkvLayout l = Fp8Layout();
  LandmarkLaunch launch(l, cache);
  const SkvLandmarkParams& lp = launch.params;
  SKV_ASSERT_CUDA(LaunchSkvLandmarks(lp, nullptr));
  const std::vector<uint8_t> codes = ToHost(launch.codes);
  const std::vector<float> scales = ToHost(launch.scales);
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kChunks; ++c) {
      // The kernel's fp32 mean: the chunk's keys summed in token order, then divided.
      std::vector<float> mean(kDim, 0.0f);
      const float* chunk_keys = keys.data() + lp.cache.HeadOffset(1, 1, h) + int64_t{c} * kChunk * kDim;
      for (int t = 0; t < kChunk; ++t) {
        for (int e = 0; e < kDim; ++e) mean[e] += chunk_keys[t * kDim + e];
      }
      for (float& m : mean) m /= static_cast<float>(kChunk);
      std::vector<uint8_t> want(kDim);
      const float want_scale = QuantizeFp8Run(mean.data(), kDim, want.data());
      const int64_t landmark = (int64_t{1} * kHeads + h) * kChunks + c;
      EXPECT_EQ(scales[landmark], want_scale) << "head " << h << " chunk " << c;
      EXPECT_EQ(std::memcmp(codes.data() + landmark * kDim, want.data(), kDim), 0)
          << "head " << h << " chunk " << c;
    }
  }
  EXPECT_EQ(scales[(int64_t{1} * kHeads) * kChunks + 5], 0.0f);  // the zero chunk
}

// FP8 exact keys (exact_keys with fp8_keys), FP8 landmarks beside them: the store written at
// compression holds the CPU's codes and scale of each key less its chunk's landmark as the GPU
// stored it (code · scale), and the fetch writes key = code · scale + landmark, rounded to bf16,
// into the gather rows (the one rounding or two: the device may fuse the multiply and add).
TEST(CudaShadowKvFp8Test, StoredKeysAreTheCpuCodesOfEachKeyLessItsLandmark) {
  SKV_SKIP_WITHOUT_GPU();
  TestCache cache(6);
  const std::vector<float>& keys = cache.keys;
  const int64_t runs = int64_t{kLayers} * kHeads * kChunks;
  const int64_t key_offset = (runs * kChunk * kDim + runs * 4 + 15) / 16 * 16;
  auto d_store = Poisoned<uint8_t>(key_offset + runs * kChunk * kDim + runs * 4);
  auto d_table =
      ToDevice(std::vector<__nv_bfloat16*>(1, reinterpret_cast<__nv_bfloat16*>(d_store.get())));
  SkvLayout l = Fp8Layout();
  l.values = d_table.get();
  l.exact_keys = 1;
  l.fp8_keys = 1;
  l.key_store_offset = key_offset;
  LandmarkLaunch launch(l, cache);
  const SkvLandmarkParams& lp = launch.params;
  constexpr int kLayer = 1, kSlot = 1;  // those of the launch
  SKV_ASSERT_CUDA(LaunchSkvLandmarks(lp, nullptr));
  SKV_ASSERT_CUDA(LaunchSkvStoreKeysFp8(lp, nullptr));
  const std::vector<uint8_t> store = ToHost(d_store), landmark_codes = ToHost(launch.codes);
  const std::vector<float> landmark_scales = ToHost(launch.scales);
  auto landmark_of = [&](int h, int c) {
    const int64_t landmark = (int64_t{kLayer} * kHeads + h) * kChunks + c;
    std::vector<float> out(kDim);
    for (int e = 0; e < kDim; ++e) {
      out[e] = Fp8E4m3ToFp32(landmark_codes[landmark * kDim + e]) * landmark_scales[landmark];
    }
    return out;
  };
  const int64_t key_scales_at = key_offset + runs * kChunk * kDim;
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kChunks; ++c) {
      const int64_t run = (int64_t{kLayer} * kHeads + h) * kChunks + c;
      const float* chunk_keys =
          keys.data() + lp.cache.HeadOffset(kSlot, kLayer, h) + int64_t{c} * kChunk * kDim;
      const std::vector<float> landmark = landmark_of(h, c);
      std::vector<float> residual(kChunk * kDim);
      for (int i = 0; i < kChunk * kDim; ++i) residual[i] = chunk_keys[i] - landmark[i % kDim];
      std::vector<uint8_t> want(kChunk * kDim);
      const float want_scale = QuantizeFp8Run(residual.data(), kChunk * kDim, want.data());
      float got_scale;
      std::memcpy(&got_scale, store.data() + key_scales_at + run * 4, 4);
      EXPECT_EQ(got_scale, want_scale) << "head " << h << " chunk " << c;
      EXPECT_EQ(
          std::memcmp(store.data() + key_offset + run * kChunk * kDim, want.data(), want.size()), 0)
          << "head " << h << " chunk " << c;
    }
  }

  // Fetch: row 0 misses chunks 0-15 of each head into its 16 slots (chunk 5 is all zero).
  std::vector<int32_t> miss(kHeads * 16);
  for (int i = 0; i < kHeads * 16; ++i) miss[i] = i % 16;
  const std::vector<uint16_t> gathered = FetchMisses(l, kLayer, miss).keys;
  ASSERT_FALSE(HasFailure());
  for (int h = 0; h < kHeads; ++h) {
    for (int slot = 0; slot < 16; ++slot) {
      const int chunk = miss[h * 16 + slot];
      const int64_t run = (int64_t{kLayer} * kHeads + h) * kChunks + chunk;
      const uint16_t* got = gathered.data() + GatherRow(kLayer, h, slot);
      const uint8_t* codes = store.data() + key_offset + run * kChunk * kDim;
      float scale;
      std::memcpy(&scale, store.data() + key_scales_at + run * 4, 4);
      const std::vector<float> landmark = landmark_of(h, chunk);
      const float* original =
          keys.data() + lp.cache.HeadOffset(kSlot, kLayer, h) + int64_t{chunk} * kChunk * kDim;
      for (int i = 0; i < kChunk * kDim; ++i) {
        const float code = Fp8E4m3ToFp32(codes[i]);
        volatile float product = code * scale;  // rounded before the add
        const uint16_t fused = Fp32ToBf16(std::fma(code, scale, landmark[i % kDim]));
        const uint16_t unfused = Fp32ToBf16(product + landmark[i % kDim]);
        ASSERT_TRUE(got[i] == fused || got[i] == unfused)
            << "head " << h << " slot " << slot << " i " << i << ": " << got[i] << " against "
            << fused << " / " << unfused;
        // And close to the key: e4m3 keeps 3 mantissa bits of the residual, bf16 8 of the sum.
        const float residual = std::abs(original[i] - landmark[i % kDim]);
        ASSERT_LE(std::abs(Bf16ToFp32(got[i]) - original[i]),
                  residual / 16 + scale / 512 + std::abs(original[i]) / 128);
      }
    }
  }
}

// FP8 landmarks exist only for the fast (tensor-core) scoring; the first kernels refuse them.
TEST(CudaShadowKvFp8Test, RejectsFp8LandmarksOnTheFirstKernels) {
  SKV_SKIP_WITHOUT_GPU();
  SkvLayout l = Fp8Layout();
  auto d_meta = ToDevice(std::vector<SkvRowMeta>(1));
  SkvDecodeParams p;
  p.layout = l;
  p.meta = d_meta.get();
  p.rows = 1;
  p.kernel_variant = kSkvKernelsFirst;
  EXPECT_EQ(LaunchSkvScore(p, nullptr), cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

}  // namespace
}  // namespace shadowkv::cuda
