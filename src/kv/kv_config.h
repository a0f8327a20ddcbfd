// KvPolicyConfig: every setting of every KV policy, as a user states it (absolute or ratio).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace shadowkv::kv {

// The rule of KvPolicyConfig::ReselectsOnDrift, for the copies of the two settings that the GPU
// plan keeps.
constexpr bool ReselectsOnDrift(double select_drift, int select_interval) {
  return select_drift > 0.0 && select_interval > 1;
}

struct KvPolicyConfig {
  std::string policy = "full";  // full | shadowkv | snapkv | quest | streaming
  // Name shown in reports: empty for the policy's own name, else a variant such as
  // "shadowkv:rank=64" (see ParseKvVariant).
  std::string label;

  // Token budget T shared by the sparse policies: budget_tokens if > 0, else
  // max(budget_min_tokens, budget_fraction * context), at most budget_max_tokens where that is
  // set, rounded to the policy's granularity.
  int64_t budget_tokens = 0;
  double budget_fraction = 0.015625;  // 1.56% (ShadowKV's default: 2048 of 131072)
  // Floor for short contexts: 512 (the published 256 loses long answers at 4K-32K, see
  // docs/RESULTS.md "Defaults").
  int64_t budget_min_tokens = 512;
  // Ceiling for long contexts; 0 = none. At least budget_min_tokens where set.
  int64_t budget_max_tokens = 0;

  // ShadowKV (docs/DESIGN.md, "ShadowKV").
  int chunk_size = 8;
  int rank = 0;  // r; 0 = from rank_ratio and rank_min
  // r = max(ceil8(ratio * num_kv_heads * head_dim), ceil8(rank_min)), at most the width: the
  // published 1/6.4 where keys are wide (160 of 1024), at least rank_min where they are narrow.
  double rank_ratio = 1 / 6.4;
  // Rank from the key spectrum: with rank_energy > 0 each layer (of each sequence, and each
  // basis group) keeps the smallest multiple of 8 whose top eigenvalues hold this share of its
  // pre-RoPE key energy, clamped to [rank_min, rank_max] (rank_max 0 = the basis width); `rank`
  // and `rank_ratio` are then unused. 0 = one fixed rank for every layer.
  double rank_energy = 0.0;
  // The smallest rank of either rule (per basis group), rounded up to 8; 0 = none. 48: narrow
  // keys need it (docs/RESULTS.md "Defaults").
  int rank_min = 48;
  // A second floor: this share of one KV head's width (head_dim), rounded up to 8; 0 = none.
  // Where a model has one or two wide KV heads the ratio and rank_min keep too few of a head's
  // dimensions: Gemma 3 270M (one KV head of 256) answers as full attention at rank 128 and
  // loses 14-25 points at 48 (docs/RESULTS.md "Gemma 3 270M"). RankFloor combines the two.
  double rank_head_ratio = 0.5;
  int rank_max = 0;
  // Chunk selection at each decode step (docs/DESIGN.md, "Chunk selection"):
  //   landmarks  the method's: per KV head, the K chunks whose landmarks score highest (softmax
  //              of q.L summed over the queries, max over the GQA group);
  //   rerank     landmarks pick rerank_factor * K candidates, whose rebuilt keys are scored
  //              exactly, and the best K are kept;
  //   heads      each query head of a GQA group picks its own best chunks, K in all per KV head;
  //   mass       per KV head the fewest chunks holding select_mass of the landmark score, between
  //              a floor and a cap around K.
  std::string selection = "rerank";  // docs/RESULTS.md "Defaults"
  int rerank_factor = 4;
  // A floor on the re-rank's candidates, in tokens: at least ceil(rerank_min_tokens / chunk)
  // candidate chunks whatever rerank_factor * K gives (all selectable chunks where fewer); 0 =
  // none. Short prompts have small budgets, and their landmarks rank the best chunks less well
  // than a fixed share of K can catch (docs/RESULTS.md, "The accurate setting's candidates").
  int64_t rerank_min_tokens = 0;
  // Components of the key basis the re-ranking scores candidates with: the first rerank_rank
  // (a multiple of 8; largest eigenvalues first), or every component the layer keeps when 0 or
  // above its rank. The kept chunks are attended with every component either way; scoring with
  // fewer makes the re-rank cheaper where keys are wide. One basis for all heads only (basis_groups
  // 1). With exact_keys the re-rank scores the stored exact keys when 0, and with R > 0 the keys
  // rebuilt from the factors' first R components instead (the attention still reads the exact
  // keys): fewer bytes per candidate than a stored key.
  int rerank_rank = 0;
  double select_mass = 0.9;
  int64_t outlier_chunks = -1;  // O per KV head; -1 = 24 per 1024 budget tokens
  int local_window = 32;        // W: exact tokens at the end of the prompt
  // Factorise the keys of this many equal groups of KV heads separately, each with its own
  // basis (the rank rule applied to its own width; see RankPerGroup): what N tensor-parallel
  // ranks do on the GPU, emulated on the CPU to compare with one basis for all heads (1).
  int basis_groups = 1;
  // Select each top chunk's successor with it (SelectTopKWithSuccessors), within the same budget;
  // off by default (the method selects the top K alone).
  int select_successors = 0;
  // Decode steps one selection serves: the chunks are selected at a sequence's first decode step
  // after its compression and every select_interval-th step after it; the steps between attend
  // to the chunks gathered last (no scoring, select, fetch or rebuild), beside the exact window
  // that the new tokens join. A block of several queries (a later turn's prompt) always
  // selects. 1 = every step (the method); 1 to 64.
  int select_interval = 1;
  // With select_drift > 0 select_interval is the longest a selection serves: a KV head also
  // selects again at a single-query step where one of its query heads has turned away from the
  // query it last selected with, their cosine (both without the rotary embedding) below
  // select_drift. 0 = off (the fixed interval alone); in [0, 1].
  double select_drift = 0.0;
  // A tighter drift threshold for small budgets: a sequence whose budget (in whole chunks) is
  // below drift_small_below tokens selects again at a cosine below drift_small instead of
  // select_drift (a smaller kept set leaves the query's attention sooner as the query turns).
  // drift_small 0 = off; in [0, 1], with select_drift on.
  double select_drift_small = 0.0;
  int64_t drift_small_below = 0;
  // The share of the budget's chunks drawn at random, at each selection, from the selectable
  // chunks the selection did not rank among the best (budget minus sampled): those are attended
  // with a log weight ln(unranked / sampled), so that they stand for the attention mass of every
  // chunk left out (an unbiased estimate of its sum), and the rest of the budget keeps the best.
  // Attended tokens are unchanged. 0 = off; in [0, 1). With select=landmarks or rerank, not with
  // successors; the GPU draws the same chunks.
  double select_sample = 0.0;
  // Leading layers kept exact (full attention, nothing compressed): a diagnostic of which
  // layers a task needs exact; 0 by default. CPU only.
  int exact_layers = 0;
  // 1: the slow tier also keeps every chunk's exact post-RoPE keys beside its values (a second
  // store of the same runs: fp32 on the CPU, bf16 after the values on the GPU), fetched with the
  // values for the chunks attended, and read by the re-rank ("rerank") to score its candidates
  // unless rerank_rank is set (then the factors score them and the store is read only for the
  // chunks a step misses); without rerank_rank no decode step reads the rank-r factors. Twice
  // the slow tier, and the attended keys exact (docs/RESULTS.md, "Exact keys for the chunks
  // attended"). 0 or 1; off by default.
  int exact_keys = 0;
  // Store the slow tier's values as FP8 e4m3 with one fp32 scale per chunk of one KV head, and
  // the chunk landmarks with one scale per landmark (core/fp8.h): half the bytes of bf16, a
  // quarter of fp32. 0 or 1; off by default.
  int fp8_values = 0;
  int fp8_landmarks = 0;
  // With exact_keys: the stored keys as FP8 e4m3 in the same form (one fp32 scale per chunk of
  // one KV head), so the key store takes a byte an element. 0 or 1; off by default.
  int fp8_keys = 0;
  std::string value_store_path;  // back the slow tier by a memory-mapped file here (optional)
  // 1: ShadowKV as published, whatever the defaults become (see WithPaperSettings); 0 or 1.
  int paper = 0;

  // SnapKV (docs/DESIGN.md, "Baselines").
  int snap_window = 32;
  int snap_kernel = 7;
  std::string snap_pooling = "max";  // max | avg

  // Quest.
  int quest_page_size = 16;
  int quest_dense_layers = 2;

  // StreamingLLM.
  int sink_tokens = 4;

  // Checks the settings that do not depend on the model (names, ranges).
  Status Validate() const;
  // Budget T in tokens for a context of `context_tokens`.
  int64_t BudgetTokens(int64_t context_tokens) const;
  // The re-rank's candidate floor in chunks of `chunk_size` tokens: ceil(rerank_min_tokens /
  // chunk_size).
  int64_t RerankFloorChunks(int64_t chunk_size) const {
    if (chunk_size <= 0) return 0;
    return rerank_min_tokens / chunk_size + (rerank_min_tokens % chunk_size != 0 ? 1 : 0);
  }
  // Re-rank candidates for a budget of `budget_chunks` chunks of `chunk_size` tokens:
  // max(rerank_factor * budget_chunks, the floor), before the cap by the selectable chunks.
  int64_t RerankCandidates(int64_t budget_chunks, int64_t chunk_size) const {
    return std::max(static_cast<int64_t>(rerank_factor) * budget_chunks,
                    RerankFloorChunks(chunk_size));
  }
  // The drift threshold of a sequence whose budget is `budget_tokens` (its chunks times the
  // chunk size): select_drift_small below drift_small_below, select_drift otherwise.
  double DriftForBudget(int64_t budget_tokens) const {
    return select_drift_small > 0.0 && budget_tokens < drift_small_below ? select_drift_small
                                                                         : select_drift;
  }
  // Chunks of a budget of `budget_chunks` drawn at random by select_sample: the share rounded
  // to the nearest chunk, leaving at least one ranked chunk (0 where the budget has one chunk).
  int64_t SampledChunks(int64_t budget_chunks) const {
    if (select_sample <= 0.0 || budget_chunks < 2) return 0;
    const auto sampled =
        static_cast<int64_t>(select_sample * static_cast<double>(budget_chunks) + 0.5);
    return std::min(sampled, budget_chunks - 1);
  }
  // Whether the re-rank scores its candidates from the stored exact keys (exact_keys without
  // rerank_rank): such a store is read at every selection, not only for the chunks a step misses,
  // so where it lives decides the selection's speed.
  bool RerankReadsStore() const { return exact_keys != 0 && rerank_rank == 0; }
  // Whether a KV head selects again where its queries turn (select_drift on, with a longest
  // interval above one step for it to shorten).
  bool ReselectsOnDrift() const { return kv::ReselectsOnDrift(select_drift, select_interval); }
  const std::string& display_name() const { return label.empty() ? policy : label; }
};

// The rank floor of either rule for keys of `head_dim` per KV head: max(rank_min,
// ceil(rank_head_ratio * head_dim)) rounded up to 8 (0 when both are 0). ResolveRank and
// RankForEnergy cap it (the basis width; rank_max under rank_energy).
int RankFloor(const KvPolicyConfig& config, int head_dim);

// With config.paper == 1, `config` with the method's published settings forced: the fixed rank rule
// r = ceil8(num_kv_heads * head_dim / 6.4) (rank 0, rank_ratio 1/6.4, no rank floor, rank_energy
// 0), selection landmarks at every step without successors, budget 1.56% of the context with a
// 256-token floor (no absolute budget, no ceiling), outliers 24 per 1024 budget tokens (-1), chunk
// 8, window 32, no exact layers, no exact keys, fp32 values, landmarks and keys. Deployment
// settings (basis_groups, value_store_path) are kept. Otherwise `config` unchanged.
KvPolicyConfig WithPaperSettings(KvPolicyConfig config);

// A policy with settings of its own, for comparing variants in one run: "NAME[:KEY=VALUE]...", e.g.
// "shadowkv:rank=64:budget=512". Keys: budget, budget_fraction, budget_min, budget_max, chunk,
// rank, rank_ratio, rank_energy, rank_min, rank_head_ratio, rank_max, select, rerank_factor,
// rerank_min, rerank_rank, mass, basis_groups, outliers, window, successors (0 or 1), interval
// (select_interval), drift (select_drift), drift_small (select_drift_small), drift_small_below,
// sample (select_sample), paper (0 or 1; with 1 no setting it forces may be named too: kInvalidArgument), exact_layers,
// exact_keys (0 or 1), fp8_values (0 or 1), fp8_landmarks (0 or 1), fp8_keys (0 or 1, with
// exact_keys), snap_window, snap_kernel, snap_pooling, page, dense_layers, sinks. accurate=1
// (shadowkv only; not with paper=1) names the setting measured within 2 points of full attention
// on Qwen2.5-Coder-0.5B at 16K and 32K, on the questions its settings were chosen on and on
// held-out ones, and on SmolLM2 at 4K (docs/RESULTS.md, "The accurate setting's candidates",
// "Held-out questions" and "Sampled chunks"): exact_keys=1, rank=8 (with exact keys no decode
// step reads the rank-r factors), budget_fraction=0.125 (12.5% of the context) with
// budget_min=768 and budget_max=2048 (12.5% reaches it at about 16K; at 32K half the budget of
// 12.5% kept the accuracy with the drawn chunks), rerank_factor=3 with rerank_min=8192 (at least
// 1,024 candidate chunks), interval=8, drift=0.85, drift_small=0.9 below drift_small_below=3072
// budget tokens (so every budget under the ceiling reselects at 0.9; 0.85 applies where
// budget_max is raised), and sample=0.25 (a quarter of the budget drawn at random and
// weighted); each of those keys named beside it keeps the named value, whatever the order. Settings not named
// come from `base`. Unknown keys, malformed values and invalid results are kInvalidArgument.
Result<KvPolicyConfig> ParseKvVariant(const std::string& text, const KvPolicyConfig& base);

// The policy names MakeKvPolicy knows.
const std::vector<std::string>& KnownKvPolicies();

}  // namespace shadowkv::kv
