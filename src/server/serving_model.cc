// CpuServingModel: a step is one CpuModel forward with the sampled rows' last logits, then a
// counter-based draw per row on the host.
#include "server/serving_model.h"

namespace shadowkv::server {

Status CpuServingModel::Step(std::span<const StepRow> rows, std::span<int32_t> next_tokens) {
  if (next_tokens.size() != rows.size()) {
    return Error(ErrorCode::kInvalidArgument, "{} token slots for {} rows", next_tokens.size(),
                 rows.size());
  }
  const int64_t vocab = model_.config().vocab_size;
  size_t sampled = 0;
  for (const StepRow& row : rows) sampled += row.sampling != nullptr;
  logits_.resize(sampled * static_cast<size_t>(vocab));
  inputs_.clear();
  size_t next = 0;
  for (const StepRow& row : rows) {
    StepInput in;
    in.kv = row.kv;
    in.tokens = row.tokens;
    in.finish_prefill = row.finish_prefill;
    in.logits = row.sampling ? StepInput::Logits::kLast : StepInput::Logits::kNone;
    if (row.sampling) in.logits_out = logits_.data() + (next++) * vocab;
    inputs_.push_back(in);
  }
  SKV_RETURN_IF_ERROR(model_.Forward(inputs_));
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].sampling) continue;
    next_tokens[i] = SampleAt(std::span<const float>(inputs_[i].logits_out, vocab),
                              *rows[i].sampling, rows[i].draw);
  }
  return Status::Ok();
}

}  // namespace shadowkv::server
