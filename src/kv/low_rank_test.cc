// Tests of the low-rank key factorisation against direct fp64 computations.
#include "kv/low_rank.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace shadowkv::kv {
namespace {

// X = U·V + noise: [num_rows, width] with `signal_rank` strong directions of decaying scale.
std::vector<float> LowRankPlusNoise(int64_t num_rows, int width, int signal_rank, float noise,
                                    uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> u(num_rows * signal_rank), v(static_cast<size_t>(signal_rank) * width);
  for (auto& x : u) x = normal(rng);
  for (int k = 0; k < signal_rank; ++k) {
    const float scale = 4.0f / (1.0f + 0.3f * k);
    for (int j = 0; j < width; ++j) v[k * width + j] = scale * normal(rng);
  }
  std::vector<float> x(num_rows * width);
  for (int64_t i = 0; i < num_rows; ++i) {
    for (int j = 0; j < width; ++j) {
      double sum = 0;
      for (int k = 0; k < signal_rank; ++k) sum += u[i * signal_rank + k] * v[k * width + j];
      x[i * width + j] = static_cast<float>(sum) + noise * normal(rng);
    }
  }
  return x;
}

// ‖X − A·B‖²_F in fp64, straight from the definition.
double ResidualEnergy(const std::vector<float>& x, int64_t num_rows, const LowRankBasis& fit) {
  const int w = fit.width, r = fit.rank;
  double energy = 0;
  std::vector<double> a(r);
  for (int64_t i = 0; i < num_rows; ++i) {
    const float* row = x.data() + i * w;
    for (int k = 0; k < r; ++k) {
      double dot = 0;
      for (int j = 0; j < w; ++j) dot += static_cast<double>(row[j]) * fit.basis[k * w + j];
      a[k] = dot;
    }
    for (int j = 0; j < w; ++j) {
      double rebuilt = 0;
      for (int k = 0; k < r; ++k) rebuilt += a[k] * fit.basis[k * w + j];
      energy += (row[j] - rebuilt) * (row[j] - rebuilt);
    }
  }
  return energy;
}

TEST(LowRankTest, ResolveRankFollowsTheRatioRule) {
  EXPECT_EQ(ResolveRank(0, 1 / 6.4, 0, 1024).value(), 160);   // the paper's Llama-3-8B setting
  EXPECT_EQ(ResolveRank(0, 1 / 6.4, 48, 1024).value(), 160);  // the floor is below
  EXPECT_EQ(ResolveRank(0, 1 / 6.4, 0, 192).value(), 32);     // 30 rounded up to a multiple of 8
  EXPECT_EQ(ResolveRank(0, 1 / 6.4, 48, 192).value(), 48);    // raised to the floor
  EXPECT_EQ(ResolveRank(0, 1 / 6.4, 45, 128).value(), 48);    // the floor rounded up to 8
  EXPECT_EQ(ResolveRank(0, 1 / 6.4, 200, 128).value(), 128);  // capped at the width
  EXPECT_EQ(ResolveRank(0, 1.0, 0, 100).value(), 100);        // 104 capped at the width
  EXPECT_EQ(ResolveRank(48, 0.5, 96, 192).value(), 48);       // an explicit rank has no floor
  auto too_big = ResolveRank(200, 0.0, 0, 192);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(too_big.status().message().find("200"), std::string::npos);
  EXPECT_NE(too_big.status().message().find("192"), std::string::npos);
}

TEST(LowRankTest, GramMatchesDirectSum) {
  const int64_t rows = 700;  // several SYRK blocks and a partial one
  const int width = 24;
  auto x = LowRankPlusNoise(rows, width, 5, 0.1f, 3);
  auto gram = GramMatrix(x.data(), rows, width, width);
  for (int i = 0; i < width; ++i) {
    for (int j = 0; j < width; ++j) {
      double expected = 0;
      for (int64_t t = 0; t < rows; ++t) expected += double(x[t * width + i]) * x[t * width + j];
      EXPECT_NEAR(gram[i * width + j], expected, 1e-5 * (1 + std::fabs(expected)));
    }
  }
}

TEST(LowRankTest, GramHonoursRowStride) {
  // Columns 4..11 of a 16-wide matrix, read through the stride.
  std::vector<float> x(5 * 16);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) - 3.0f;
  auto gram = GramMatrix(x.data() + 4, 5, 8, 16);
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      double expected = 0;
      for (int t = 0; t < 5; ++t) expected += double(x[t * 16 + 4 + i]) * x[t * 16 + 4 + j];
      EXPECT_DOUBLE_EQ(gram[i * 8 + j], expected);
    }
  }
}

TEST(LowRankTest, DiscardedEnergyEqualsResidual) {
  const int64_t rows = 3000;
  const int width = 96, rank = 16;
  auto x = LowRankPlusNoise(rows, width, 12, 0.05f, 11);
  auto gram = GramMatrix(x.data(), rows, width, width);
  auto fit = FitLowRankBasis(gram, width, rank);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  const double residual = ResidualEnergy(x, rows, *fit);
  EXPECT_NEAR(fit->discarded_energy(), residual, 1e-3 * residual);

  // The same energy as the sum of the eigenvalues past the rank.
  auto spectrum = GramEigenvalues(gram, width);
  ASSERT_TRUE(spectrum.ok());
  double tail = 0;
  for (int i = rank; i < width; ++i) tail += (*spectrum)[i];
  EXPECT_NEAR(tail, residual, 1e-3 * residual);
  for (int i = 0; i < rank; ++i)
    EXPECT_NEAR((*spectrum)[i], fit->eigenvalues[i], 1e-9 * (*spectrum)[0]);
  for (int i = 1; i < width; ++i) EXPECT_GE((*spectrum)[i - 1], (*spectrum)[i]);
}

TEST(LowRankTest, LongContextKeepsDiscardedEnergyAccurate) {
  // Many rows with a small noise floor: a single fp32 Gram loses the tail to rounding.
  const int64_t rows = 40000;
  const int width = 64, rank = 8;
  auto x = LowRankPlusNoise(rows, width, 8, 0.02f, 5);
  auto gram = GramMatrix(x.data(), rows, width, width);
  auto fit = FitLowRankBasis(gram, width, rank);
  ASSERT_TRUE(fit.ok());
  const double residual = ResidualEnergy(x, rows, *fit);
  EXPECT_NEAR(fit->discarded_energy(), residual, 1e-3 * residual);
}

TEST(LowRankTest, Fp32SolverFitsTheSameSubspace) {
  // The GPU's Gram is summed in fp32 and solved in fp32: the basis must span what the fp64
  // solver's does (‖B32·B64ᵀ‖²_F = rank when the subspaces agree) with the same eigenvalues.
  const int64_t rows = 4000;
  // (The rank inside the signal: past it the directions are noise of equal weight, which no two
  // solvers need agree on.)
  const int width = 128, rank = 16;
  auto x = LowRankPlusNoise(rows, width, 24, 0.1f, 13);
  const std::vector<double> gram = GramMatrix(x.data(), rows, width, width);
  const std::vector<float> gram32(gram.begin(), gram.end());
  auto fit64 = FitLowRankBasis(gram, width, rank);
  auto fit32 = FitLowRankBasis(std::span<const float>(gram32), width, rank);
  ASSERT_TRUE(fit64.ok()) << fit64.status().ToString();
  ASSERT_TRUE(fit32.ok()) << fit32.status().ToString();
  double overlap = 0;
  for (int a = 0; a < rank; ++a) {
    for (int b = 0; b < rank; ++b) {
      double dot = 0;
      for (int j = 0; j < width; ++j)
        dot += double(fit32->basis[a * width + j]) * fit64->basis[b * width + j];
      overlap += dot * dot;
    }
  }
  EXPECT_NEAR(overlap, rank, 1e-4);
  for (int i = 0; i < rank; ++i)
    EXPECT_NEAR(fit32->eigenvalues[i], fit64->eigenvalues[i], 1e-5 * fit64->eigenvalues[0]);
  EXPECT_NEAR(ResidualEnergy(x, rows, *fit32), ResidualEnergy(x, rows, *fit64),
              1e-3 * ResidualEnergy(x, rows, *fit64));
  EXPECT_FALSE(FitLowRankBasis(std::span<const float>(gram32), width, width + 1).ok());
}

TEST(LowRankTest, BasisIsOrthonormalAndFullRankRebuildsExactly) {
  const int64_t rows = 200;
  const int width = 48;
  auto x = LowRankPlusNoise(rows, width, 6, 0.3f, 7);
  auto fit = FitLowRankBasis(GramMatrix(x.data(), rows, width, width), width, width);
  ASSERT_TRUE(fit.ok());
  for (int a = 0; a < width; ++a) {
    for (int b = 0; b < width; ++b) {
      double dot = 0;
      for (int j = 0; j < width; ++j)
        dot += double(fit->basis[a * width + j]) * fit->basis[b * width + j];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5);
    }
  }
  std::vector<float> coefficients(rows * width), rebuilt(rows * width);
  ProjectOntoBasis(*fit, x.data(), rows, width, coefficients.data());
  // Rebuild two column ranges separately, as the policy does per KV head.
  RebuildColumns(*fit, coefficients.data(), rows, 0, 16, rebuilt.data(), width);
  RebuildColumns(*fit, coefficients.data(), rows, 16, 32, rebuilt.data() + 16, width);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(rebuilt[i], x[i], 1e-4 * (1 + std::fabs(x[i])));
}

TEST(LowRankTest, RankPerGroupSplitsAnExplicitRank) {
  EXPECT_EQ(RankPerGroup(160, 1), 160);
  EXPECT_EQ(RankPerGroup(20, 1), 20);  // one group: as given
  EXPECT_EQ(RankPerGroup(160, 2), 80);
  EXPECT_EQ(RankPerGroup(160, 4), 40);
  EXPECT_EQ(RankPerGroup(160, 8), 24);  // ceil8(20)
  EXPECT_EQ(RankPerGroup(0, 4), 0);     // from the ratio, per group
}

// Three groups of 16 columns fitted separately: orthonormal rows, each group's rows zero outside
// its columns, the discarded energy equal to the residual and to the groups' own fits', and
// never below one basis of the same total rank (which is optimal).
TEST(LowRankTest, BlockDiagonalBasisFitsEachGroupOnItsOwn) {
  const int64_t rows = 300;
  const int width = 48, groups = 3, block = 16, per_group = 4;
  auto x = LowRankPlusNoise(rows, width, 10, 0.3f, 11);
  const std::vector<double> gram = GramMatrix(x.data(), rows, width, width);
  auto fit = FitBlockDiagonalBasis(gram, width, groups, per_group);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  ASSERT_EQ(fit->rank, groups * per_group);
  for (int a = 0; a < fit->rank; ++a) {
    for (int j = 0; j < width; ++j) {
      if (j / block != a / per_group) {
        EXPECT_EQ(fit->basis[a * width + j], 0.0f);
      }
    }
    for (int b = 0; b < fit->rank; ++b) {
      double dot = 0;
      for (int j = 0; j < width; ++j) {
        dot += double(fit->basis[a * width + j]) * fit->basis[b * width + j];
      }
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5);
    }
  }
  const double residual = ResidualEnergy(x, rows, *fit);
  EXPECT_NEAR(fit->discarded_energy(), residual, 1e-6 * fit->total_energy);
  double groups_discarded = 0;
  for (int g = 0; g < groups; ++g) {
    std::vector<float> part(rows * block);
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(x.data() + i * width + g * block, block, part.data() + i * block);
    }
    auto own = FitLowRankBasis(GramMatrix(part.data(), rows, block, block), block, per_group);
    ASSERT_TRUE(own.ok());
    groups_discarded += own->discarded_energy();
  }
  EXPECT_NEAR(fit->discarded_energy(), groups_discarded, 1e-6 * fit->total_energy);
  auto shared = FitLowRankBasis(gram, width, groups * per_group);
  ASSERT_TRUE(shared.ok());
  EXPECT_LE(shared->discarded_energy(), fit->discarded_energy() * (1 + 1e-9));
  EXPECT_FALSE(FitBlockDiagonalBasis(gram, width, 5, 2).ok());   // 5 does not divide 48
  EXPECT_FALSE(FitBlockDiagonalBasis(gram, width, 3, 17).ok());  // above a group's width
}

TEST(LowRankTest, RankForEnergyOnHandMadeSpectra) {
  // Flat: every direction holds the same share, so 90% of 64 needs 58, rounded up to 64.
  const std::vector<double> flat(64, 1.0);
  EXPECT_EQ(RankForEnergy(flat, 64.0, 0.9, 8, 0), 64);
  EXPECT_EQ(RankForEnergy(flat, 64.0, 0.5, 8, 0), 32);
  EXPECT_EQ(RankForEnergy(flat, 64.0, 0.51, 8, 0), 40);  // 33 directions, rounded up to 40
  // One dominant direction: one is enough, and the multiple of 8 makes it 8.
  std::vector<double> dominant(64, 0.01);
  dominant[0] = 100.0;
  EXPECT_EQ(RankForEnergy(dominant, 100.63, 0.9, 8, 0), 8);
  EXPECT_EQ(RankForEnergy(dominant, 100.63, 0.9, 0, 0), 8);  // never below 8
  // Exactly at the threshold: 8 directions hold exactly half, so 8 suffice; a hair more needs 9.
  std::vector<double> half(32, 0.0);
  std::fill(half.begin(), half.begin() + 16, 1.0);
  EXPECT_EQ(RankForEnergy(half, 16.0, 0.5, 8, 0), 8);
  EXPECT_EQ(RankForEnergy(half, 16.0, 0.5 + 1e-9, 8, 0), 16);
  // The floor (rounded up to 8) and the cap bind.
  EXPECT_EQ(RankForEnergy(dominant, 100.63, 0.9, 20, 0), 24);
  EXPECT_EQ(RankForEnergy(flat, 64.0, 0.9, 8, 40), 40);
  EXPECT_EQ(RankForEnergy(flat, 64.0, 0.9, 48, 40), 40);  // the cap wins over the floor
  EXPECT_EQ(RankForEnergy(flat, 64.0, 0.9, 8, 100), 64);  // never above the width
  // Energy 1 takes every direction even where the tail is rounding noise; cap still applies.
  std::vector<double> noisy = half;
  noisy[20] = -1e-12;
  EXPECT_EQ(RankForEnergy(noisy, 16.0, 1.0, 8, 0), 32);
  EXPECT_EQ(RankForEnergy(noisy, 16.0, 1.0, 8, 24), 24);
  // A width that is no multiple of 8 caps the rounding; all-zero keys take the floor.
  EXPECT_EQ(RankForEnergy(std::vector<double>(12, 1.0), 12.0, 0.9, 8, 0), 12);
  EXPECT_EQ(RankForEnergy(std::vector<double>(64, 0.0), 0.0, 0.9, 16, 0), 16);
  // Negative rounding noise counts as zero, not as lost energy.
  std::vector<double> negative = {10.0, -5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                  1.0,  0.0,  0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  EXPECT_EQ(RankForEnergy(negative, 11.0, 0.95, 8, 0), 16);
}

TEST(LowRankTest, EnergyRuleFitsEachGroupItsOwnRank) {
  // Group 0 (columns 0-15) holds 3 strong directions, group 1 (16-31) is isotropic noise.
  const int width = 32, rows = 2000;
  auto x = LowRankPlusNoise(rows, width, 3, 0.0f, 9);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < 16; ++j) x[i * width + 16 + j] = normal(rng);
  }
  const auto gram = GramMatrix(x.data(), rows, width, width);
  std::vector<int> ranks;
  const RankRule rule{0, 0.9, 8, 0};
  auto fit = FitBlockDiagonalBasis(gram, width, 2, rule, &ranks);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  EXPECT_EQ(ranks, std::vector<int>({8, 16}));
  EXPECT_EQ(fit->rank, 24);
  ASSERT_EQ(fit->eigenvalues.size(), 24u);
  ASSERT_EQ(fit->basis.size(), 24u * width);
  for (int r = 0; r < 24; ++r) {
    for (int j = 0; j < width; ++j) {
      if ((r < 8) != (j < 16)) {
        ASSERT_EQ(fit->basis[r * width + j], 0.0f) << r << "," << j;
      }
    }
  }
  // One group: the rank from the whole spectrum, and energy 1 keeps every direction exactly.
  auto one = FitBlockDiagonalBasis(gram, width, 1, RankRule{0, 1.0, 8, 0}, &ranks);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->rank, width);
  EXPECT_EQ(ranks, std::vector<int>({width}));
  EXPECT_LT(ResidualEnergy(x, rows, *one), 1e-6 * one->total_energy);
}

TEST(LowRankTest, RejectsBadRank) {
  std::vector<double> gram(16, 0.0);
  EXPECT_FALSE(FitLowRankBasis(gram, 4, 5).ok());
  EXPECT_FALSE(FitLowRankBasis(gram, 4, 0).ok());
  EXPECT_FALSE(FitLowRankBasis(gram, 3, 2).ok());  // wrong size
}

}  // namespace
}  // namespace shadowkv::kv
