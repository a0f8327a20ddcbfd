// The batched symmetric eigensolver (ops/cuda/linalg) against the CPU policy's own solver
// (kv::FitLowRankBasis, LAPACK): Gram matrices of random keys whose columns fall off in scale (a
// decaying spectrum with distinct eigenvalues, as real keys have), several in one batch; the top
// eigenvalues and the top-r subspace must agree to fp32 precision. Sizes past cuSOLVER's range are
// refused.
#include "ops/cuda/linalg/symmetric_eigen.h"

#include <cmath>

#include "gpu_test_util.h"
#include "kv/low_rank.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

// G = XᵀX for X [rows, n] with column j scaled by 1 / (1 + j / 4), summed in fp64.
std::vector<float> DecayingGram(int n, int rows, std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(static_cast<size_t>(rows) * n);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < n; ++j) x[static_cast<size_t>(r) * n + j] = normal(rng) / (1.0 + j / 4.0);
  }
  std::vector<float> gram(static_cast<size_t>(n) * n);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int r = 0; r < rows; ++r) {
        sum += x[static_cast<size_t>(r) * n + i] * x[static_cast<size_t>(r) * n + j];
      }
      gram[static_cast<size_t>(i) * n + j] = static_cast<float>(sum);
    }
  }
  return gram;
}

void CheckAgainstLapack(int n, int batch, int rank) {
  std::mt19937 rng(static_cast<uint32_t>(n * 31 + batch));
  std::vector<float> grams;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> one = DecayingGram(n, 4 * n, rng);
    grams.insert(grams.end(), one.begin(), one.end());
  }
  auto matrices = ToDevice(grams);
  auto values = Poisoned<float>(static_cast<int64_t>(batch) * n);
  auto info = Poisoned<int32_t>(batch);
  auto solver = BatchedSymmetricEigen::Create(n, batch, nullptr);
  ASSERT_TRUE(solver.ok()) << solver.status().ToString();
  const Status run = (*solver)->Run(matrices.get(), values.get(), info.get());
  ASSERT_TRUE(run.ok()) << run.ToString();
  SKV_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> vectors = ToHost(matrices);
  const std::vector<float> eigenvalues = ToHost(values);
  const std::vector<int32_t> infos = ToHost(info);
  for (int b = 0; b < batch; ++b) {
    ASSERT_EQ(infos[b], 0) << "matrix " << b;
    const std::span<const float> gram(grams.data() + static_cast<size_t>(b) * n * n,
                                      static_cast<size_t>(n) * n);
    auto want = kv::FitLowRankBasis(gram, n, rank);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    const float* ascending = eigenvalues.data() + static_cast<size_t>(b) * n;
    for (int i = 1; i < n; ++i) ASSERT_LE(ascending[i - 1], ascending[i]) << "matrix " << b;
    const double largest = want->eigenvalues[0];
    for (int i = 0; i < rank; ++i) {
      EXPECT_NEAR(ascending[n - 1 - i], want->eigenvalues[i], 1e-5 * largest)
          << "matrix " << b << ", eigenvalue " << i;
    }
    // Subspace distance: sqrt(rank - |Vᵀ B|²_F) / sqrt(rank), 0 for the same subspace.
    double overlap = 0.0;
    for (int i = 0; i < rank; ++i) {
      const float* column = vectors.data() + (static_cast<size_t>(b) * n + n - 1 - i) * n;
      for (int j = 0; j < rank; ++j) {
        double dot = 0.0;
        for (int k = 0; k < n; ++k) dot += column[k] * want->basis[static_cast<size_t>(j) * n + k];
        overlap += dot * dot;
      }
    }
    EXPECT_LT(std::sqrt(std::fmax(0.0, rank - overlap) / rank), 1e-3) << "matrix " << b;
  }
}

TEST(BatchedSymmetricEigenTest, MatchesLapackOnQwenAndLlamaWidths) {
  SKV_SKIP_WITHOUT_GPU();
  CheckAgainstLapack(128, 3, 48);  // Qwen2.5-0.5B: 2 KV heads x 64
  CheckAgainstLapack(64, 4, 16);
  CheckAgainstLapack(256, 2, 64);
}

TEST(BatchedSymmetricEigenTest, RefusesSizesOutsideItsRange) {
  SKV_SKIP_WITHOUT_GPU();
  EXPECT_EQ(BatchedSymmetricEigen::Create(0, 4, nullptr).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(BatchedSymmetricEigen::Create(128, 0, nullptr).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(BatchedSymmetricEigen::Create(65536, 1024, nullptr).status().code(),
            ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace shadowkv::cuda
