// Shared prefill: run a prompt once with full attention, keep every layer's K/V/Q and the last
// logits, then replay that into a fresh sequence of any KV policy without model compute.
//
// Every policy attends exactly during prefill (compression happens at FinishPrefill), so the
// K/V/Q a policy would see in its own prefill are the recorded ones, and replay (per layer:
// Append the whole prompt, then FinishPrefill) leaves it in the state its own prefill would.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "kv/kv_policy.h"
#include "model/cpu_model.h"

namespace shadowkv::eval {

struct PrefillRecord {
  int64_t num_tokens = 0;
  int kv_width = 0;                               // num_kv_heads * head_dim
  int q_width = 0;                                // num_query_heads * head_dim
  std::vector<std::vector<float>> keys_pre_rope;  // [layer][num_tokens * kv_width]
  std::vector<std::vector<float>> keys;           // [layer][num_tokens * kv_width] post-RoPE
  std::vector<std::vector<float>> values;         // [layer][num_tokens * kv_width]
  // [layer][rows * q_width] post-RoPE, for the last `rows` prompt tokens: every token when
  // recorded here, fewer when the record was started elsewhere (see ExtendPrefill).
  std::vector<std::vector<float>> queries;
  std::vector<float> last_logits;                 // [vocab] after the last prompt token

  int64_t bytes() const;
};

// Runs `prompt` through the model under full attention in chunks of `chunk_tokens`.
Result<PrefillRecord> RecordPrefill(CpuModel& model, std::span<const int32_t> prompt,
                                    int chunk_tokens = 512);

// Completes a record that holds the keys and values of the prompt's first record->num_tokens
// tokens (made elsewhere, e.g. by the GPU; no queries) by running the rest of `prompt` through
// `model` under full attention, recording those tokens with their queries, and the last logits.
// At least one token must remain.
Status ExtendPrefill(CpuModel& model, std::span<const int32_t> prompt, PrefillRecord* record,
                     int chunk_tokens = 512);

// Puts the recorded prompt into `sequence` (new, empty): per layer one Append of the whole
// prompt (two when the queries cover only the last tokens: the earlier rows come without
// queries), then FinishPrefill. The next token to feed is Argmax(record.last_logits).
Status ReplayPrefill(const PrefillRecord& record, kv::SequenceKv& sequence);

}  // namespace shadowkv::eval
