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
// 8, raised to `floor` rounded up to 8, and capped at `width`. A rank above `width` is
// kInvalidArgument.
Result<int> ResolveRank(int rank, double rank_ratio, int floor, int width);

// Rank from the spectrum: the smallest r whose top-r eigenvalues (`eigenvalues`, the whole
// spectrum of one Gram matrix, largest first; negative rounding noise counts as 0) sum to at least
// `energy * total` (total: the Gram's trace), rounded up to a multiple of 8, then raised to
// `floor` rounded up to 8 and lowered to the cap: `cap` if > 0, else the width
// (eigenvalues.size()); never above the width. energy >= 1 always gives the cap (rounding in the
// eigenvalues must not drop the last directions of an "exact" setting); total <= 0 (all-zero
// keys) needs no direction and gives the floor (at least 8, or the width if smaller).
int RankForEnergy(std::span<const double> eigenvalues, double total, double energy, int floor,
                  int cap);

// How a basis picks its rank: `rank` rows, or with energy > 0 RankForEnergy(energy, floor, cap)
// on the spectrum it fits (each basis group on its own).
struct RankRule {
  int rank = 0;
  double energy = 0.0;
  int floor = 8;
  int cap = 0;
};

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
// The same with each group's rank from `rule`: with an energy rule each group solves its whole
// spectrum once (every eigenpair), takes RankForEnergy of it and keeps that many vectors, so
// groups may differ in rank; `group_ranks` receives them ([groups]) when not null.
Result<LowRankBasis> FitBlockDiagonalBasis(std::span<const double> gram, int width, int groups,
                                           const RankRule& rule,
                                           std::vector<int>* group_ranks = nullptr);

// Coefficients A = X·Bᵀ: rows [num_rows, width] (stride row_stride) → out [num_rows, rank].
void ProjectOntoBasis(const LowRankBasis& basis, const float* rows, int64_t num_rows,
                      int64_t row_stride, float* out);

// Rebuilds columns [column, column + num_columns) of X ≈ A·B for `num_rows` coefficient rows
// (coefficients [num_rows, rank]) into out [num_rows, out_stride].
void RebuildColumns(const LowRankBasis& basis, const float* coefficients, int64_t num_rows,
                    int column, int num_columns, float* out, int64_t out_stride);
// The same from the first `rank` components alone (0 < rank <= basis.rank; coefficients
// [num_rows, rank], their first `rank` columns): the approximation a smaller basis would give.
void RebuildColumns(const LowRankBasis& basis, int rank, const float* coefficients,
                    int64_t num_rows, int column, int num_columns, float* out, int64_t out_stride);

}  // namespace shadowkv::kv
