// Recording a full-attention prefill and replaying it into any KV policy.
#include "eval/prefill_record.h"

#include <algorithm>

namespace shadowkv::eval {
namespace {

// Full attention that copies each appended block into a PrefillRecord.
class RecordingSequence final : public kv::ForwardingSequenceKv {
 public:
  RecordingSequence(std::unique_ptr<kv::SequenceKv> inner, PrefillRecord* record)
      : ForwardingSequenceKv(std::move(inner)), record_(record) {}

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

 private:
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
  const kv::KvGeometry geometry = model.kv_geometry();
  PrefillRecord record;
  record.kv_width = geometry.kv_width();
  record.q_width = geometry.q_width();
  for (auto* layers : {&record.keys_pre_rope, &record.keys, &record.values, &record.queries}) {
    layers->resize(geometry.num_layers);
    const int width = layers == &record.queries ? record.q_width : record.kv_width;
    for (auto& layer : *layers) layer.reserve(prompt.size() * width);
  }
  SKV_RETURN_IF_ERROR(ExtendPrefill(model, prompt, &record, chunk_tokens));
  return record;
}

Status ExtendPrefill(CpuModel& model, std::span<const int32_t> prompt, PrefillRecord* record,
                     int chunk_tokens) {
  if (chunk_tokens <= 0) {
    return Error(ErrorCode::kInvalidArgument, "prefill chunk of {} tokens", chunk_tokens);
  }
  const kv::KvGeometry geometry = model.kv_geometry();
  const int64_t held = record->num_tokens, total = static_cast<int64_t>(prompt.size());
  if (held >= total) {
    return Error(ErrorCode::kInvalidArgument,
                 "a prompt of {} tokens leaves nothing to run after the {} recorded", total, held);
  }
  if (record->kv_width != geometry.kv_width() || record->q_width != geometry.q_width()) {
    return Error(ErrorCode::kInvalidArgument,
                 "the record's widths (kv {}, q {}) are not the model's (kv {}, q {})",
                 record->kv_width, record->q_width, geometry.kv_width(), geometry.q_width());
  }
  const size_t held_elems = static_cast<size_t>(held) * record->kv_width;
  for (auto* layers : {&record->keys_pre_rope, &record->keys, &record->values, &record->queries}) {
    if (static_cast<int>(layers->size()) != geometry.num_layers) {
      return Error(ErrorCode::kInvalidArgument, "the record has {} layers, the model {}",
                   layers->size(), geometry.num_layers);
    }
    for (const auto& layer : *layers) {
      const size_t expected = layers == &record->queries ? 0 : held_elems;
      if (layer.size() != expected) {
        return Error(ErrorCode::kInvalidArgument,
                     "a record layer holds {} values where {} tokens make {}", layer.size(),
                     held, expected);
      }
    }
  }

  kv::KvPolicyConfig full_config;
  full_config.policy = "full";
  SKV_ASSIGN_OR_RETURN(auto full, kv::MakeKvPolicy(full_config, geometry));
  SKV_ASSIGN_OR_RETURN(auto inner, full->NewSequence());
  if (held > 0) {
    for (int layer = 0; layer < geometry.num_layers; ++layer) {
      kv::TokenBlock block;
      block.num_tokens = static_cast<int>(held);
      block.keys_pre_rope = record->keys_pre_rope[layer].data();
      block.keys = record->keys[layer].data();
      block.values = record->values[layer].data();
      SKV_RETURN_IF_ERROR(inner->Append(layer, block));
    }
  }
  record->last_logits.resize(model.config().vocab_size);
  RecordingSequence sequence(std::move(inner), record);
  for (int64_t done = held; done < total; done += chunk_tokens) {
    const int64_t count = std::min<int64_t>(chunk_tokens, total - done);
    StepInput in;
    in.kv = &sequence;
    in.tokens = prompt.subspan(done, count);
    in.finish_prefill = done + count == total;
    in.logits = in.finish_prefill ? StepInput::Logits::kLast : StepInput::Logits::kNone;
    in.logits_out = record->last_logits.data();
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const StepInput>(&in, 1)));
  }
  record->num_tokens = total;
  return Status::Ok();
}

Status ReplayPrefill(const PrefillRecord& record, kv::SequenceKv& sequence) {
  if (sequence.num_tokens() != 0) {
    return Error(ErrorCode::kInvalidArgument, "replay needs an empty sequence, this one holds {}",
                 sequence.num_tokens());
  }
  const int num_layers = static_cast<int>(record.keys.size());
  for (int layer = 0; layer < num_layers; ++layer) {
    const int64_t query_rows =
        static_cast<int64_t>(record.queries[layer].size()) / std::max(record.q_width, 1);
    const int64_t first_query = record.num_tokens - query_rows;
    auto block = [&](int64_t begin, int64_t end, const float* queries) {
      kv::TokenBlock b;
      b.num_tokens = static_cast<int>(end - begin);
      b.first_position = begin;
      const size_t at = static_cast<size_t>(begin) * record.kv_width;
      b.keys_pre_rope = record.keys_pre_rope[layer].data() + at;
      b.keys = record.keys[layer].data() + at;
      b.values = record.values[layer].data() + at;
      b.queries = queries;
      return b;
    };
    if (first_query > 0) {
      SKV_RETURN_IF_ERROR(sequence.Append(layer, block(0, first_query, nullptr)));
    }
    SKV_RETURN_IF_ERROR(sequence.Append(
        layer, block(first_query, record.num_tokens, record.queries[layer].data())));
    SKV_RETURN_IF_ERROR(sequence.FinishPrefill(layer));
  }
  return Status::Ok();
}

}  // namespace shadowkv::eval
