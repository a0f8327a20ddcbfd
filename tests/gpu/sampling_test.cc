// GPU next-token choice: argmax against the CPU Argmax (ties, NaN), and temperature sampling
// against the softmax probabilities it must draw from.
#include "ops/cuda/sampling/sampling.cuh"

#include "engine/sampler.h"
#include "gpu_test_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

std::vector<int32_t> RunSampling(const std::vector<float>& logits, int rows, int vocab,
                                 const SamplingControl& control) {
  auto device_logits = ToDevice(logits);
  auto device_control = ToDevice(std::vector<SamplingControl>{control});
  auto tokens = ToDevice(std::vector<int32_t>(rows, -1));
  SamplingParams p;
  p.logits = device_logits.get();
  p.control = device_control.get();
  p.tokens = tokens.get();
  p.rows = rows;
  p.vocab = vocab;
  EXPECT_EQ(LaunchSampling(p, nullptr), cudaSuccess);
  return ToHost(tokens);
}

TEST(CudaSamplingTest, GreedyMatchesCpuArgmax) {
  SKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  const int rows = 6, vocab = 128256;
  std::vector<float> logits = RandomFloats(static_cast<int64_t>(rows) * vocab, rng, 4.0f);
  // Row 1: a tie between ids 9000 and 70000 (lowest id wins); row 2: NaNs are never chosen;
  // row 3: the maximum in the last element.
  logits[vocab + 9000] = logits[vocab + 70000] = 100.0f;
  for (int v = 0; v < vocab; v += 3) logits[2 * vocab + v] = NAN;
  logits[2 * vocab + 4] = 50.0f;
  logits[3 * vocab + vocab - 1] = 1000.0f;
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, SamplingControl{});
  for (int r = 0; r < rows; ++r) {
    std::vector<float> row(logits.begin() + static_cast<int64_t>(r) * vocab,
                           logits.begin() + static_cast<int64_t>(r + 1) * vocab);
    if (r == 2) {
      EXPECT_EQ(got[r], 4);  // std::max_element is not defined with NaNs: checked by hand
      continue;
    }
    EXPECT_EQ(got[r], Argmax(row)) << "row " << r;
  }
}

TEST(CudaSamplingTest, TemperatureDrawsFromTheSoftmax) {
  SKV_SKIP_WITHOUT_GPU();
  const std::vector<float> row = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.0f, -3.0f, 0.0f};
  const int vocab = static_cast<int>(row.size()), rows = 40000;
  const float temperature = 1.5f;
  std::vector<float> logits;
  for (int r = 0; r < rows; ++r) logits.insert(logits.end(), row.begin(), row.end());
  SamplingControl control;
  control.temperature = temperature;
  control.seed = 1234;
  control.step = 7;
  const std::vector<int32_t> got = RunSampling(logits, rows, vocab, control);
  std::vector<double> counts(vocab, 0.0);
  for (int32_t token : got) {
    ASSERT_GE(token, 0);
    ASSERT_LT(token, vocab);
    counts[token] += 1.0;
  }
  double sum = 0.0;
  std::vector<double> expected(vocab);
  for (int v = 0; v < vocab; ++v) sum += expected[v] = std::exp(row[v] / temperature);
  for (int v = 0; v < vocab; ++v) {
    const double p = expected[v] / sum;
    const double sigma = std::sqrt(p * (1 - p) / rows);
    EXPECT_NEAR(counts[v] / rows, p, 5 * sigma + 1e-4) << "token " << v;
  }
  // Same seed and step: the same draws; another step: different ones.
  EXPECT_EQ(RunSampling(logits, rows, vocab, control), got);
  control.step = 8;
  EXPECT_NE(RunSampling(logits, rows, vocab, control), got);
}

}  // namespace
}  // namespace shadowkv::cuda
