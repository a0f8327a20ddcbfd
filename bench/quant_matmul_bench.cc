// Micro-benchmarks of QuantMatVec on the weight shapes of SmolLM2-135M and an 8B-class layer.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "ops/cpu/quant_matmul.h"

namespace shadowkv {
namespace {

using gguf::GgmlType;

// Random weight bytes with a valid fp16 scale (and Q4_1 minimum) in every block; speed does not
// depend on the values, only on well-formed scales (no NaN slow paths).
std::vector<uint8_t> RandomWeights(GgmlType type, int64_t rows, int64_t cols) {
  const size_t row_bytes = QuantRowBytes(type, cols);
  std::vector<uint8_t> bytes(rows * row_bytes);
  std::mt19937 rng(1);
  for (auto& byte : bytes) byte = static_cast<uint8_t>(rng());
  const size_t block_bytes = type == GgmlType::kQ4_1 ? 20 : type == GgmlType::kQ8_0 ? 34 : 18;
  const uint16_t scale = 0x2000;  // 2^-7
  for (size_t offset = 0; offset < bytes.size(); offset += block_bytes) {
    std::memcpy(bytes.data() + offset, &scale, 2);
    if (type == GgmlType::kQ4_1) std::memcpy(bytes.data() + offset + 2, &scale, 2);
  }
  return bytes;
}

ThreadPool& PoolWith(int threads) {
  static ThreadPool one(1), two(2);
  return threads == 1 ? one : two;
}

// Decode streams every weight once per token from memory; `cold` cycles through copies of the
// matrix that together exceed the last-level cache (32 MiB on the target) three times over, so
// each call reads from DRAM as it would there. Otherwise the matrix is reused (cache-hot).
constexpr size_t kColdBytes = 96u << 20;

// Args: rows, cols, type, batch, threads, cold.
void BM_QuantMatVec(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const auto type = static_cast<GgmlType>(state.range(2));
  const int64_t batch = state.range(3);
  ThreadPool& pool = PoolWith(static_cast<int>(state.range(4)));
  const bool cold = state.range(5) != 0;
  const std::vector<uint8_t> weights = RandomWeights(type, rows, cols);
  const size_t num_copies = cold ? kColdBytes / weights.size() + 1 : 1;
  const std::vector<std::vector<uint8_t>> copies(num_copies, weights);
  std::vector<float> x(batch * cols), y(batch * rows);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  size_t next = 0;
  for (auto _ : state) {
    const QuantMatrix w{type, copies[next].data(), rows, cols, QuantRowBytes(type, cols)};
    next = next + 1 == num_copies ? 0 : next + 1;
    QuantMatVec(w, x.data(), batch, y.data(), pool);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(weights.size()));
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * rows * cols * batch * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(type == GgmlType::kQ4_0 ? "Q4_0" : type == GgmlType::kQ4_1 ? "Q4_1" : "Q8_0");
}

void Shapes(benchmark::internal::Benchmark* bench) {
  bench->ArgNames({"rows", "cols", "type", "batch", "threads", "cold"});
  const int64_t shapes[][2] = {{576, 576},  {192, 576},   {1536, 576},
                               {576, 1536}, {49152, 576}, {4096, 4096}};
  for (const auto& shape : shapes) {
    for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
      for (int64_t batch : {1, 4}) {
        for (int64_t threads : {1, 2}) {
          for (int64_t cold : {0, 1}) {
            bench->Args({shape[0], shape[1], static_cast<int64_t>(type), batch, threads, cold});
          }
        }
      }
    }
  }
}

BENCHMARK(BM_QuantMatVec)->Apply(Shapes)->UseRealTime();

}  // namespace
}  // namespace shadowkv
