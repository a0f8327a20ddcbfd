// The KV-policy seam: how a sequence's keys and values are kept, and what attention reads.
//
// A KvPolicy is a factory (one per engine and setting); a SequenceKv holds one sequence's KV
// state for every layer and is owned by the engine's sequence. The forward pass, per layer:
//   1. computes q, k (pre- and post-RoPE) and v for the new tokens of each sequence;
//   2. SequenceKv::Append(layer, block)         -- the only call that adds tokens;
//   3. SequenceKv::Prepare(layer, q, ..., &in)  -- the policy picks what the queries see;
//   4. the backend's attention op consumes `in` (plain pointers; it never sees a policy);
//   5. after the last chunk of the prompt: SequenceKv::FinishPrefill(layer) (compression point).
// Pointers placed in an AttentionInput stay valid until the next Append/Prepare/FinishPrefill
// on that sequence. A SequenceKv is used by one thread at a time; different sequences may be
// driven from different threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/attention_input.h"
#include "core/rope.h"
#include "core/status.h"
#include "kv/kv_config.h"

namespace shadowkv::kv {

// Shape of a model's attention, as the policies need it.
struct KvGeometry {
  int num_layers = 0;
  int num_query_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t max_context = 0;  // tokens per sequence
  RopeConfig rope;          // to rotate rebuilt keys at their original positions
  // Sliding-window layers (gemma3's local layers, Mistral-style models): a query at position p
  // of layer l with layer_windowed[l] sees only positions p - sliding_window + 1 .. p.
  // layer_windowed is [num_layers], or empty when no layer slides. The window is applied by the
  // attention op from the positions of the segments a policy prepares, so a windowed layer needs
  // every token of its window kept exactly at its position, and nothing else matters to it. For
  // such a geometry MakeKvPolicy splits the layers (kv/sliding_split_policy.cc): the windowed
  // ones keep exactly the tokens a future query's window can reach (older ones are dropped), the
  // global ones take the named policy, made for a geometry of those layers alone
  // (GlobalLayersGeometry in kv/policies.h). A sparse policy on a geometry whose every layer
  // slides has nothing to serve and is refused; 'full' is then the windows alone.
  int64_t sliding_window = 0;
  std::vector<bool> layer_windowed;

  int kv_width() const { return num_kv_heads * head_dim; }
  int q_width() const { return num_query_heads * head_dim; }
  int group_size() const { return num_query_heads / num_kv_heads; }
};

// New tokens of one sequence at one layer (rows are tokens, consecutive positions).
struct TokenBlock {
  int num_tokens = 0;
  int64_t first_position = 0;
  const float* keys_pre_rope = nullptr;  // [num_tokens, num_kv_heads * head_dim]
  const float* keys = nullptr;           // [num_tokens, num_kv_heads * head_dim] post-RoPE
  const float* values = nullptr;         // [num_tokens, num_kv_heads * head_dim]
  const float* queries = nullptr;        // [num_tokens, num_query_heads * head_dim] post-RoPE
};

// The attention op's input types live below both kv and ops; the policies speak of them as kv's.
using ::shadowkv::AttentionInput;
using ::shadowkv::KvSegment;

// Bytes held per memory tier (fast: GPU memory or RAM next to compute; slow: host RAM or file).
struct MemoryUsage {
  int64_t fast_bytes = 0;
  int64_t slow_bytes = 0;
  MemoryUsage& operator+=(const MemoryUsage& o) {
    fast_bytes += o.fast_bytes;
    slow_bytes += o.slow_bytes;
    return *this;
  }
};

// Counters a policy keeps across a sequence's decode steps (summed over layers and KV heads).
struct PolicyStats {
  int64_t prepare_calls = 0;
  int64_t context_tokens = 0;    // tokens the sequence holds, summed per prepare
  int64_t attended_tokens = 0;   // tokens the attention actually read, summed per prepare
  int64_t chunk_selections = 0;  // chunks selected (sparse policies)
  int64_t chunk_hits = 0;        // of those, reused from the previous step
  // ShadowKV: (layer, KV head) decode steps that could select chunks, and those that did (fewer
  // with select_interval or select_drift).
  int64_t head_steps = 0;
  int64_t head_selections = 0;
  int64_t bytes_fetched = 0;     // bytes moved from the slow tier
  // Host time spent compressing the prompt, where a backend measures it (the GPU server's
  // ShadowKV: the engine loop waits for it).
  double compress_seconds = 0;
  double selection_share() const {
    return head_steps ? static_cast<double>(head_selections) / head_steps : 0.0;
  }
  double hit_rate() const {
    return chunk_selections ? static_cast<double>(chunk_hits) / chunk_selections : 0.0;
  }
  PolicyStats& operator+=(const PolicyStats& o);
  PolicyStats& operator-=(const PolicyStats& o);  // what was added since `o` was taken
};

class SequenceKv {
 public:
  virtual ~SequenceKv() = default;

  // Adds block.num_tokens tokens at `layer`, starting at position block.first_position (which
  // must equal the number of tokens the layer already holds).
  virtual Status Append(int layer, const TokenBlock& block) = 0;

  // Chooses what the `num_queries` queries just appended at `layer` attend to
  // (queries: [num_queries, num_query_heads * head_dim] post-RoPE). Fills `out`.
  virtual Status Prepare(int layer, const float* queries, int num_queries, AttentionInput* out) = 0;

  // The prompt is complete at `layer`: compress (snapkv, shadowkv) or do nothing.
  virtual Status FinishPrefill(int layer) = 0;

  // Tokens this sequence holds (same for every layer between steps).
  virtual int64_t num_tokens() const = 0;
  virtual MemoryUsage memory() const = 0;
  virtual const PolicyStats& stats() const = 0;
  // The same counters per layer ([num_layers]) where the policy keeps them; empty otherwise.
  virtual std::vector<PolicyStats> layer_stats() const { return {}; }

  // A copy of this sequence that goes on independently (a held prompt shared by several
  // requests). kUnsupported where the policy does not copy its states, kResourceExhausted when
  // there is no room for another sequence. Called between steps, on the engine loop's thread.
  virtual Result<std::unique_ptr<SequenceKv>> Fork() const {
    return Error(ErrorCode::kUnsupported, "this KV policy's states are not copied");
  }
};

// A sequence that passes every call to another: the base of wrappers that add to one or two of
// them (recording what is appended, counting, freeing a slot when destroyed).
class ForwardingSequenceKv : public SequenceKv {
 public:
  explicit ForwardingSequenceKv(std::unique_ptr<SequenceKv> inner) : inner_(std::move(inner)) {}
  Status Append(int layer, const TokenBlock& block) override {
    return inner_->Append(layer, block);
  }
  Status Prepare(int layer, const float* queries, int num_queries, AttentionInput* out) override {
    return inner_->Prepare(layer, queries, num_queries, out);
  }
  Status FinishPrefill(int layer) override { return inner_->FinishPrefill(layer); }
  int64_t num_tokens() const override { return inner_->num_tokens(); }
  MemoryUsage memory() const override { return inner_->memory(); }
  const PolicyStats& stats() const override { return inner_->stats(); }
  std::vector<PolicyStats> layer_stats() const override { return inner_->layer_stats(); }

 protected:
  std::unique_ptr<SequenceKv> inner_;
};

class KvPolicy {
 public:
  virtual ~KvPolicy() = default;
  virtual std::string_view name() const = 0;
  const KvPolicyConfig& config() const { return config_; }
  const KvGeometry& geometry() const { return geometry_; }

  virtual Result<std::unique_ptr<SequenceKv>> NewSequence() const = 0;
  // Memory a sequence of `num_tokens` tokens will hold once prefilled (admission control).
  virtual MemoryUsage EstimateMemory(int64_t num_tokens) const = 0;

 protected:
  KvPolicy(KvPolicyConfig config, KvGeometry geometry)
      : config_(std::move(config)), geometry_(std::move(geometry)) {}
  KvPolicyConfig config_;
  KvGeometry geometry_;
};

// Builds the policy named by config.policy (on a sliding-window geometry: for its global layers,
// beside the windowed layers' windows); impossible settings give kInvalidArgument, a policy that
// cannot serve the geometry (a sparse one where every layer slides) kUnsupported.
Result<std::unique_ptr<KvPolicy>> MakeKvPolicy(const KvPolicyConfig& config,
                                               const KvGeometry& geometry);

}  // namespace shadowkv::kv
