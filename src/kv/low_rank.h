// Low-rank factorisation of a layer's pre-RoPE keys, K_pre ≈ A·B, via the Gram matrix KᵀK.
//
// ShadowKV keeps A (one row of `rank` coefficients per token) on the fast tier and one basis B per
// sequence and layer, shared by all KV heads. B's rows are the top eigenvectors of G = KᵀK, so
// they are orthonormal and A = K·Bᵀ is both the best rank-r fit (Eckart–Young) and the way later
// tokens are projected onto the same basis.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace shadowkv::kv {

// Rank r from the settings: `rank` if > 0, else `rank_ratio * width` rounded up to a multiple of
// 8 and capped at `width`. A rank above `width` is kInvalidArgument.
Result<int> ResolveRank(int rank, double rank_ratio, int width);

// G = XᵀX for X = rows [num_rows, width] (row i at rows + i * row_stride): [width, width], full
// symmetric, row-major. fp32 BLAS on blocks of rows, summed in fp64 (fp32 alone drifts).
std::vector<double> GramMatrix(const float* rows, int64_t num_rows, int width, int64_t row_stride);

// Every eigenvalue of a Gram matrix, largest first: the squared singular values of X, i.e. the
// spectrum `inspect` reports (for pre-RoPE keys, post-RoPE keys or values alike).
Result<std::vector<double>> GramEigenvalues(std::span<const double> gram, int width);

struct LowRankBasis {
  int width = 0;
  int rank = 0;
  std::vector<float> basis;         // B: [rank, width], orthonormal rows, largest eigenvalue first
  std::vector<double> eigenvalues;  // [rank] the top eigenvalues of G, largest first
  double total_energy = 0.0;        // trace(G) = ‖X‖²_F

  // ‖X − X·Bᵀ·B‖²_F: the energy in the discarded directions (sum of the other eigenvalues).
  double discarded_energy() const;
};

// The top-`rank` eigenvectors of `gram` ([width, width], as GramMatrix gives it).
Result<LowRankBasis> FitLowRankBasis(std::span<const double> gram, int width, int rank);
// The same solver in fp32, for a Gram matrix that was summed in fp32 (the GPU's): half the
// memory traffic and about half the time of the fp64 solve (a 1024-wide Gram, rank 160: 100
// against 184 ms on one core); the fitted subspace agrees to the fp32 Gram's own precision.
Result<LowRankBasis> FitLowRankBasis(std::span<const float> gram, int width, int rank);

// Factorising `groups` groups of KV heads separately (what tensor-parallel ranks do, each with
// its own heads): an explicit rank r becomes ceil8(r / groups) per group; 0 (rank from the
// ratio, which then applies to each group's own width) and groups = 1 leave it as it is.
int RankPerGroup(int rank, int groups);

// A block-diagonal basis: the width split into `groups` equal column blocks (groups of whole KV
// heads), each fitted on its own block of `gram` with `rank_per_group` rows; B is
// [groups * rank_per_group, width] with group g's rows zero outside its columns, and
// `eigenvalues` lists each group's, largest first within the group. Rows stay orthonormal, so
// A = X·Bᵀ and X ≈ A·B work as for one basis.
Result<LowRankBasis> FitBlockDiagonalBasis(std::span<const double> gram, int width, int groups,
                                           int rank_per_group);

// Coefficients A = X·Bᵀ: rows [num_rows, width] (stride row_stride) → out [num_rows, rank].
void ProjectOntoBasis(const LowRankBasis& basis, const float* rows, int64_t num_rows,
                      int64_t row_stride, float* out);

// Rebuilds columns [column, column + num_columns) of X ≈ A·B for `num_rows` coefficient rows
// (coefficients [num_rows, rank]) into out [num_rows, out_stride].
void RebuildColumns(const LowRankBasis& basis, const float* coefficients, int64_t num_rows,
                    int column, int num_columns, float* out, int64_t out_stride);

}  // namespace shadowkv::kv
