// ShadowKV-on-GPU planning: geometry, compression constants and per-step row plans.
#include "gpu/model/shadowkv_plan.h"

#include <algorithm>

#include "kv/chunk_selection.h"
#include "kv/low_rank.h"

namespace shadowkv::cuda {

int64_t SkvGeometry::DeviceBytesPerSequence() const {
  const int64_t bf16 = 2;
  const int64_t layers = num_layers, heads = num_kv_heads;
  const int64_t chunked_rows = static_cast<int64_t>(capacity_chunks) * chunk_size;
  return layers * (2 * heads * attn_capacity * head_dim * bf16       // attention K and V
                   + recent_capacity * kv_width() * bf16             // exact pre-RoPE keys
                   + chunked_rows * rank * bf16                      // A
                   + static_cast<int64_t>(rank) * kv_width() * bf16  // B
                   + heads * capacity_chunks                         // outlier flags
                   + heads * max_budget * 4                          // gather slots
                   + (max_sample > 0 ? heads * max_budget * 4 : 0)   // their log weights
                   + 4)                                              // the layer's rank
         + LandmarkBytesPerSequence() + WindowBytesPerSequence() + DriftBytesPerSequence();
}

int64_t SkvGeometry::DriftBytesPerSequence() const {
  if (!drift()) return 0;
  return int64_t{num_layers} * num_kv_heads * (int64_t{group} * head_dim * 4 + 4);
}

int64_t SkvGeometry::WindowBytesPerSequence() const {
  return int64_t{2} * window_layers * num_kv_heads * window_rows * head_dim * 2;
}

int64_t SkvGeometry::LandmarkBytesPerSequence() const {
  const int64_t landmarks = static_cast<int64_t>(num_layers) * num_kv_heads * capacity_chunks;
  return fp8_landmarks ? landmarks * (head_dim + 4) : landmarks * head_dim * 2;
}

int64_t SkvGeometry::ValueCodeBytesPerSequence() const {
  return static_cast<int64_t>(num_layers) * num_kv_heads * capacity_chunks * chunk_size * head_dim *
         (fp8_values ? 1 : 2);
}

int64_t SkvGeometry::ValueBytesPerSequence() const {
  const int64_t runs = static_cast<int64_t>(num_layers) * num_kv_heads * capacity_chunks;
  return ValueCodeBytesPerSequence() + (fp8_values ? runs * 4 : 0);
}

int64_t SkvGeometry::KeyBytesPerSequence() const {
  if (!exact_keys) return 0;
  const int64_t runs = static_cast<int64_t>(num_layers) * num_kv_heads * capacity_chunks;
  const int64_t elements = runs * chunk_size * head_dim;
  return fp8_keys ? elements + runs * 4 : elements * 2;
}

int64_t SkvGeometry::StoreBytesPerSequence() const {
  return ValueBytesPerSequence() + KeyBytesPerSequence();
}

Result<SkvGeometry> MakeSkvGeometry(const kv::KvPolicyConfig& config, int num_layers,
                                    int num_kv_heads, int head_dim, int64_t capacity_tokens) {
  SKV_RETURN_IF_ERROR(config.Validate());
  if (config.exact_layers != 0) {
    return Error(ErrorCode::kUnsupported, "ShadowKV exact_layers runs on the CPU only");
  }
  if (config.basis_groups != 1) {
    return Error(ErrorCode::kUnsupported,
                 "ShadowKV basis_groups runs on the CPU only (on the "
                 "GPU, --tensor-parallel N gives each rank's heads their own basis)");
  }
  if (config.selection != "landmarks" && config.selection != "rerank" &&
      config.selection != "heads") {
    return Error(ErrorCode::kUnsupported,
                 "ShadowKV on the GPU: chunk selection '{}' is not implemented yet",
                 config.selection);
  }
  if (config.local_window < 1) {
    // A step graduates its chunk before appending its token (LaunchSkvGraduate), so the chunk
    // must hold earlier tokens only.
    return Error(ErrorCode::kUnsupported,
                 "ShadowKV on the GPU keeps at least 1 exact recent token (window=0 runs on the "
                 "CPU only)");
  }
  if (config.select_successors != 0 && config.selection != "landmarks") {
    return Error(ErrorCode::kUnsupported,
                 "ShadowKV on the GPU: successor selection (successors=1) goes with the landmark "
                 "selection only, not '{}'",
                 config.selection);
  }
  SkvGeometry g;
  g.num_layers = num_layers;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.chunk_size = config.chunk_size;
  g.local_window = config.local_window;
  if (config.rank_energy > 0.0) {
    // The kernels work in multiples of 8, so the cap must be one (the width always is for the
    // head sizes they take); the floor rounds up to one.
    g.rank_energy = config.rank_energy;
    g.rank = config.rank_max > 0 ? std::min(config.rank_max, g.kv_width()) : g.kv_width();
    if (g.rank % 8 != 0) {
      return Error(ErrorCode::kUnsupported,
                   "ShadowKV on the GPU needs a rank cap (rank_max) that is a multiple of 8; {} "
                   "is not",
                   g.rank);
    }
    g.rank_floor = std::min(g.rank, std::max(8, kv::RankFloor(config, head_dim)));
  } else {
    SKV_ASSIGN_OR_RETURN(g.rank, kv::ResolveRank(config.rank, config.rank_ratio,
                                                 kv::RankFloor(config, head_dim), g.kv_width()));
  }
  if (g.rank % 8 != 0) {
    return Error(ErrorCode::kUnsupported,
                 "ShadowKV on the GPU needs a rank that is a multiple of "
                 "8; {} is not",
                 g.rank);
  }
  if (capacity_tokens < 1 || capacity_tokens / g.chunk_size > (1 << 24)) {
    return Error(ErrorCode::kInvalidArgument, "ShadowKV capacity of {} tokens", capacity_tokens);
  }
  g.capacity_tokens = capacity_tokens;
  g.capacity_chunks = static_cast<int>(capacity_tokens / g.chunk_size);
  g.fp8_values = config.fp8_values != 0;
  g.fp8_landmarks = config.fp8_landmarks != 0;
  g.exact_keys = config.exact_keys != 0;
  g.fp8_keys = g.exact_keys && config.fp8_keys != 0;
  // A multiple of 16 chunks: the tensor-core scoring's tile (bf16 landmarks at other capacities
  // fall back to the CUDA-core scoring; FP8 landmarks have no other).
  g.capacity_chunks = (g.capacity_chunks + 15) / 16 * 16;
  const int64_t budget = config.BudgetTokens(capacity_tokens);
  g.max_budget = static_cast<int>(std::max<int64_t>(1, budget / g.chunk_size));
  g.max_outliers = static_cast<int>(kv::ResolveOutlierChunks(
      config.outlier_chunks, static_cast<int64_t>(g.max_budget) * g.chunk_size, g.capacity_chunks));
  if (config.selection == "rerank") {
    g.rerank_factor = config.rerank_factor;
    g.rerank_rank = config.rerank_rank;
    g.rerank_min_chunks = static_cast<int>(
        std::min<int64_t>(config.RerankFloorChunks(g.chunk_size), g.capacity_chunks));
    const int64_t candidates =
        std::min<int64_t>(config.RerankCandidates(g.max_budget, g.chunk_size), g.capacity_chunks);
    if (candidates > kSkvMaxRerankCandidates) {
      return Error(ErrorCode::kUnsupported,
                   "ShadowKV on the GPU re-ranks at most {} candidate chunks; rerank_factor {} x "
                   "a budget of {} chunks (at least {} tokens) asks for {}",
                   kSkvMaxRerankCandidates, config.rerank_factor, g.max_budget,
                   config.rerank_min_tokens, candidates);
    }
    g.max_candidates = static_cast<int>(candidates);
  }
  g.select_heads = config.selection == "heads";
  g.max_sample = static_cast<int>(config.SampledChunks(g.max_budget));
  g.select_interval = config.select_interval;
  g.select_drift = config.select_drift;
  g.recent_capacity = g.local_window + g.chunk_size;
  g.attn_capacity =
      static_cast<int64_t>(g.max_outliers + g.max_budget) * g.chunk_size + g.recent_capacity;
  return g;
}

SkvLayerParts SkvLayerPartsOf(const ModelConfig& model) {
  SkvLayerParts parts;
  int windowed = 0;
  for (int l = 0; l < model.num_layers; ++l) {
    const bool slides = model.IsWindowed(l);
    parts.windowed.push_back(slides);
    parts.index.push_back(slides ? windowed++ : static_cast<int>(parts.global.size()));
    if (!slides) parts.global.push_back(l);
  }
  return parts;
}

Result<SkvGeometry> MakeSkvGeometryFor(const kv::KvPolicyConfig& config, const ModelConfig& model,
                                       int num_kv_heads, int64_t capacity_tokens) {
  const SkvLayerParts parts = SkvLayerPartsOf(model);
  const int global = static_cast<int>(parts.global.size());
  const int windowed = model.num_layers - global;
  if (global == 0) {
    return Error(ErrorCode::kUnsupported,
                 "KV policy 'shadowkv' has nothing to serve on this model: all {} of its layers "
                 "attend to a sliding window of {} tokens, which they keep exactly; it applies to "
                 "global layers only, and this model has none (use 'full')",
                 model.num_layers, model.sliding_window);
  }
  SKV_ASSIGN_OR_RETURN(SkvGeometry g, MakeSkvGeometry(config, global, num_kv_heads,
                                                      model.head_dim, capacity_tokens));
  g.group = model.num_query_heads / model.num_kv_heads;
  if (windowed > 0) {
    g.window_layers = windowed;
    g.window_rows = static_cast<int>(std::min<int64_t>(model.sliding_window, capacity_tokens));
  }
  return g;
}

int SkvRankForEnergy(std::span<const double> eigenvalues, double total_energy, double energy,
                     int floor, int cap) {
  // The CPU policy's rule on the top-`cap` eigenvalues the GPU's solver returns: a share they do
  // not reach takes the cap either way.
  return kv::RankForEnergy(eigenvalues.first(std::min<size_t>(eigenvalues.size(), cap)),
                           total_energy, energy, floor, cap);
}

Result<SkvCompressionPlan> PlanSkvCompression(const kv::KvPolicyConfig& config,
                                              const SkvGeometry& g, int64_t prompt_tokens) {
  const int chunk = g.chunk_size;
  const int64_t spare = prompt_tokens - g.local_window;
  SkvCompressionPlan plan;
  plan.num_chunks = spare >= chunk ? spare / chunk : 0;
  plan.exact_first = plan.num_chunks * chunk;
  const int64_t budget_chunks = config.BudgetTokens(prompt_tokens) / chunk;
  const int64_t outliers =
      kv::ResolveOutlierChunks(config.outlier_chunks, budget_chunks * chunk, plan.num_chunks);
  if (prompt_tokens > g.capacity_tokens) {
    return Error(ErrorCode::kOutOfRange, "prompt of {} tokens exceeds the ShadowKV capacity {}",
                 prompt_tokens, g.capacity_tokens);
  }
  if (budget_chunks < 1 || budget_chunks > g.max_budget || outliers > g.max_outliers) {
    return Error(ErrorCode::kInternal, "budget of {} chunks and {} outliers outside the layout",
                 budget_chunks, outliers);
  }
  if (plan.num_chunks - outliers < budget_chunks) {
    return Error(ErrorCode::kUnsupported,
                 "a prompt of {} tokens forms {} chunks; ShadowKV on the GPU needs at least the "
                 "budget ({} chunks) plus the outliers ({}) (use the CPU policy or a smaller "
                 "budget)",
                 prompt_tokens, plan.num_chunks, budget_chunks, outliers);
  }
  plan.info.outlier_chunks = static_cast<int32_t>(outliers);
  plan.info.budget_chunks = static_cast<int32_t>(budget_chunks);
  plan.info.gather_base = static_cast<int32_t>(outliers * chunk);
  plan.info.recent_base = static_cast<int32_t>((outliers + budget_chunks) * chunk);
  plan.info.decode_origin = static_cast<int32_t>(prompt_tokens);
  plan.info.select_drift = static_cast<float>(config.DriftForBudget(budget_chunks * chunk));
  plan.info.sample_chunks = static_cast<int32_t>(config.SampledChunks(budget_chunks));
  return plan;
}

int64_t SkvExactFirst(int64_t length, int64_t exact_first0, int chunk_size, int local_window) {
  const int64_t beyond = length - exact_first0 - local_window;
  return exact_first0 + (beyond >= chunk_size ? beyond / chunk_size * chunk_size : 0);
}

SkvRowMeta PlanSkvRow(int seq, int64_t length, int64_t exact_first0, const SkvSequenceInfo& info,
                      int chunk_size, int local_window, int select_interval) {
  SkvRowMeta m;
  m.seq = seq;
  const int64_t before = SkvExactFirst(length, exact_first0, chunk_size, local_window);
  const int64_t after = SkvExactFirst(length + 1, exact_first0, chunk_size, local_window);
  // The graduation (a chunk of earlier tokens) runs before the new token is written, which then
  // goes in after the exact rows that remain.
  m.held_rows = static_cast<int32_t>(length - before);
  m.pre_row = static_cast<int32_t>(length - after);
  m.attn_row = info.recent_base + m.pre_row;
  m.graduate_chunk = after > before ? static_cast<int32_t>(before / chunk_size) : -1;
  m.num_chunks = static_cast<int32_t>(after / chunk_size);
  m.attn_last = info.recent_base + static_cast<int32_t>(length + 1 - after) - 1;
  m.reuse = select_interval > 1 && (length - info.decode_origin) % select_interval != 0 ? 1 : 0;
  m.position = static_cast<int32_t>(length);
  return m;
}

}  // namespace shadowkv::cuda
