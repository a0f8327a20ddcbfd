// GPU ShadowKV: the key basis solved on the GPU against the host's solve (the same ranks, logits
// within rounding), and a sequence saved to host memory and restored into another allocation
// decoding exactly as the original.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "engine/sampler.h"
#include "gpu/model/cuda_model.h"
#include "gpu_test_util.h"
#include "shadowkv_test_util.h"
#include "tiny_model.h"
#include "tp_test_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;
using shadowkv::testing::SomeTokens;
using shadowkv::testing::TinyModelSpec;
using shadowkv::testing::WriteTinyModel;
using testing::SmallLlamaSpec;

// The key basis fitted on the GPU (the default for narrow keys) and on the host
// (CudaKernelOptions::basis_gpu_max_width 0) decode alike: the same per-layer ranks, and logits
// within the rounding of a basis whose fp32 eigenvectors come from two solvers before bf16.
TEST(CudaShadowKvRankTest, BasisOnTheGpuDecodesAsTheHostSolve) {
  SKV_SKIP_WITHOUT_GPU();
  TinyModelSpec spec = SmallLlamaSpec(7);
  const std::string path = WriteTinyModel(spec, "gpu_shadowkv_basis_solver");
  const std::vector<int32_t> prompt = SomeTokens(300, 41);
  auto run = [&](int basis_gpu_max_width, double energy, std::vector<int32_t>* ranks,
                 std::vector<float>* logits, CudaShadowKvStats* stats) {
    CudaModelOptions options;
    options.max_batch = 2;
    options.max_step_tokens = 512;
    options.kernels.basis_gpu_max_width = basis_gpu_max_width;
    auto gpu = CudaModel::Load(path, options);
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    ASSERT_TRUE((*gpu)->AllocateKvCache(1, 512, true).ok());
    CudaStepInput in;
    in.slot = 0;
    in.tokens = prompt;
    ASSERT_TRUE((*gpu)->Forward(std::span<const CudaStepInput>(&in, 1)).ok());
    kv::KvPolicyConfig config = ParityConfig(false);
    config.rank_energy = energy;
    config.rank_min = 16;
    config.rank_max = 96;
    ASSERT_TRUE((*gpu)->AllocateShadowKv(config, 1, 512).ok());
    ASSERT_TRUE((*gpu)->AllocateShadowKvValues(0, false).ok());
    const Status compressed = (*gpu)->CompressToShadowKv(0, 0);
    ASSERT_TRUE(compressed.ok()) << compressed.ToString();
    *stats = (*gpu)->shadowkv_stats();
    auto got = (*gpu)->ShadowKvLayerRanks(0);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    *ranks = *got;
    const int vocab = static_cast<int>((*gpu)->config().vocab_size);
    std::vector<int32_t> token = {prompt.back()};
    const std::vector<int> seqs = {0};
    for (int step = 0; step < 8; ++step) {  // a graduation among them
      std::vector<float> row(vocab);
      const Status status = (*gpu)->ShadowKvDecodeStep(seqs, token, CudaSampling{}, row.data());
      ASSERT_TRUE(status.ok()) << status.ToString();
      logits->insert(logits->end(), row.begin(), row.end());
    }
  };
  for (const double energy : {0.0, 0.9}) {  // the fixed rank (96), and a rank per layer
    std::vector<int32_t> device_ranks, host_ranks;
    std::vector<float> device_logits, host_logits;
    CudaShadowKvStats device_stats, host_stats;
    run(512, energy, &device_ranks, &device_logits, &device_stats);
    run(0, energy, &host_ranks, &host_logits, &host_stats);
    EXPECT_EQ(device_ranks, host_ranks) << "energy " << energy;
    const double error = RelativeError(device_logits, host_logits);
    EXPECT_LT(error, 2e-2) << "energy " << energy;
    for (const CudaShadowKvStats* stats : {&device_stats, &host_stats}) {
      double phases = 0.0;
      for (const double phase : stats->compress_phase_seconds) {
        EXPECT_GE(phase, 0.0);
        phases += phase;
      }
      EXPECT_GT(phases, 0.0);
      EXPECT_LE(phases, stats->compress_seconds * 1.01 + 1e-4);
    }
    std::printf("[ basis    ] energy %.1f: GPU solve %.3f ms (eigenvectors %.3f), host %.3f ms "
                "(eigenvectors %.3f); logits relative difference %.2e\n",
                energy, device_stats.compress_seconds * 1e3,
                device_stats.compress_phase_seconds[1] * 1e3, host_stats.compress_seconds * 1e3,
                host_stats.compress_phase_seconds[1] * 1e3, error);
  }
}

// The bench re-allocates between its two runs and carries the compressed prompt across in host
// memory: the restored sequence (another index, values moved to pinned host memory, another
// allocation size) must decode exactly as the original, graduation included.
TEST(CudaShadowKvSnapshotTest, RestoredSequenceDecodesAsTheOriginal) {
  SKV_SKIP_WITHOUT_GPU();
  TinyModelSpec spec = SmallLlamaSpec(9);
  const std::string path = WriteTinyModel(spec, "gpu_shadowkv_snapshot");
  auto gpu_or = CudaModel::Load(path, tp_testing::SmallOptions());
  ASSERT_TRUE(gpu_or.ok()) << gpu_or.status().ToString();
  CudaModel& gpu = **gpu_or;
  const kv::KvPolicyConfig config = ParityConfig();
  const std::vector<int32_t> prompt = SomeTokens(300, 21);
  ASSERT_TRUE(gpu.AllocateKvCache(1, 512, true).ok());
  ASSERT_TRUE(gpu.AllocateShadowKv(config, 2, 512).ok());
  ASSERT_TRUE(gpu.AllocateShadowKvValues(0, false).ok());
  CudaStepInput in;
  in.slot = 0;
  in.tokens = prompt;
  ASSERT_TRUE(gpu.Forward(std::span<const CudaStepInput>(&in, 1)).ok());
  ASSERT_TRUE(gpu.CompressToShadowKv(0, 0).ok());
  gpu.FreeKvCache();
  auto snapshot = gpu.SaveShadowKvSequence(0);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();

  const int vocab = static_cast<int>(gpu.config().vocab_size);
  auto decode = [&](int seq, std::vector<float>* logits) {
    std::vector<int32_t> token = {prompt.back()};
    const std::vector<int> seqs = {seq};
    for (int step = 0; step < 8; ++step) {  // a graduation at +4
      std::vector<float> row(vocab);
      const Status status = gpu.ShadowKvDecodeStep(seqs, token, CudaSampling{}, row.data());
      ASSERT_TRUE(status.ok()) << status.ToString();
      logits->insert(logits->end(), row.begin(), row.end());
    }
  };
  std::vector<float> original, restored;
  decode(0, &original);
  gpu.FreeShadowKv();
  ASSERT_TRUE(gpu.AllocateShadowKv(config, 3, 512).ok());
  ASSERT_TRUE(gpu.AllocateShadowKvValues(2, true).ok());
  ASSERT_TRUE(gpu.RestoreShadowKvSequence(*snapshot, 2).ok());
  EXPECT_EQ(gpu.shadowkv_length(2), 300);
  decode(2, &restored);
  ASSERT_EQ(original.size(), restored.size());
  EXPECT_EQ(original, restored);
  EXPECT_EQ(gpu.shadowkv_length(2), 308);
  EXPECT_FALSE(gpu.RestoreShadowKvSequence(*snapshot, 0).ok());  // sequence 0 has no values
}

}  // namespace
}  // namespace shadowkv::cuda
