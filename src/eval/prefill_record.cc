// Recording a full-attention prefill and replaying it into any KV policy.
#include "eval/prefill_record.h"

#include <algorithm>

namespace shadowkv::eval {
namespace {

// Full attention that copies each appended block into a PrefillRecord.
class RecordingSequence final : public kv::SequenceKv {
 public:
  RecordingSequence(std::unique_ptr<kv::SequenceKv> inner, PrefillRecord* record)
      : inner_(std::move(inner)), record_(record) {}

  Status Append(int layer, const kv::TokenBlock& block) override {
    SKV_RETURN_IF_ERROR(inner_->Append(layer, block));
    const size_t kv_count = static_cast<size_t>(block.num_tokens) * record_->kv_width;
    const size_t q_count = static_cast<size_t>(block.num_tokens) * record_->q_width;
    auto add = [](std::vector<float>& to, const float* from, size_t count) {
      to.insert(to.end(), from, from + count);
    };
    add(record_->keys_pre_rope[layer], block.keys_pre_rope, kv_count);
    add(record_->keys[layer], block.keys, kv_count);
    add(record_->values[layer], block.values, kv_count);
    add(record_->queries[layer], block.queries, q_count);
    return Status::Ok();
  }
  Status Prepare(int layer, const float* queries, int num_queries,
                 kv::AttentionInput* out) override {
    return inner_->Prepare(layer, queries, num_queries, out);
  }
  Status FinishPrefill(int layer) override { return inner_->FinishPrefill(layer); }
  int64_t num_tokens() const override { return inner_->num_tokens(); }
  kv::MemoryUsage memory() const override { return inner_->memory(); }
  const kv::PolicyStats& stats() const override { return inner_->stats(); }

 private:
  std::unique_ptr<kv::SequenceKv> inner_;
  PrefillRecord* record_;
};

}  // namespace

int64_t PrefillRecord::bytes() const {
  int64_t total = static_cast<int64_t>(last_logits.size());
  for (const auto* layers : {&keys_pre_rope, &keys, &values, &queries}) {
    for (const auto& layer : *layers) total += static_cast<int64_t>(layer.size());
  }
  return total * static_cast<int64_t>(sizeof(float));
}

Result<PrefillRecord> RecordPrefill(CpuModel& model, std::span<const int32_t> prompt,
                                    int chunk_tokens) {
  if (prompt.empty()) return Error(ErrorCode::kInvalidArgument, "empty prompt");
  if (chunk_tokens <= 0) {
    return Error(ErrorCode::kInvalidArgument, "prefill chunk of {} tokens", chunk_tokens);
  }
  const kv::KvGeometry geometry = model.kv_geometry();
  PrefillRecord record;
  record.num_tokens = static_cast<int64_t>(prompt.size());
  record.kv_width = geometry.kv_width();
  record.q_width = geometry.q_width();
  for (auto* layers : {&record.keys_pre_rope, &record.keys, &record.values, &record.queries}) {
    layers->resize(geometry.num_layers);
    const int width = layers == &record.queries ? record.q_width : record.kv_width;
    for (auto& layer : *layers) layer.reserve(static_cast<size_t>(record.num_tokens) * width);
  }
  record.last_logits.resize(model.config().vocab_size);

  kv::KvPolicyConfig full_config;
  full_config.policy = "full";
  SKV_ASSIGN_OR_RETURN(auto full, kv::MakeKvPolicy(full_config, geometry));
  SKV_ASSIGN_OR_RETURN(auto inner, full->NewSequence());
  RecordingSequence sequence(std::move(inner), &record);
  for (int64_t done = 0; done < record.num_tokens; done += chunk_tokens) {
    const int64_t count = std::min<int64_t>(chunk_tokens, record.num_tokens - done);
    StepInput in;
    in.kv = &sequence;
    in.tokens = prompt.subspan(done, count);
    in.finish_prefill = done + count == record.num_tokens;
    in.logits = in.finish_prefill ? StepInput::Logits::kLast : StepInput::Logits::kNone;
    in.logits_out = record.last_logits.data();
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const StepInput>(&in, 1)));
  }
  return record;
}

Status ReplayPrefill(const PrefillRecord& record, kv::SequenceKv& sequence) {
  if (sequence.num_tokens() != 0) {
    return Error(ErrorCode::kInvalidArgument, "replay needs an empty sequence, this one holds {}",
                 sequence.num_tokens());
  }
  const int num_layers = static_cast<int>(record.keys.size());
  for (int layer = 0; layer < num_layers; ++layer) {
    kv::TokenBlock block;
    block.num_tokens = static_cast<int>(record.num_tokens);
    block.first_position = 0;
    block.keys_pre_rope = record.keys_pre_rope[layer].data();
    block.keys = record.keys[layer].data();
    block.values = record.values[layer].data();
    block.queries = record.queries[layer].data();
    SKV_RETURN_IF_ERROR(sequence.Append(layer, block));
    SKV_RETURN_IF_ERROR(sequence.FinishPrefill(layer));
  }
  return Status::Ok();
}

}  // namespace shadowkv::eval
