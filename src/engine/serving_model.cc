// CpuServingModel: a step is one CpuModel forward with the sampled rows' last logits, then a
// counter-based draw per row on the host.
#include "engine/serving_model.h"

namespace shadowkv::engine {

Status CpuServingModel::Step(std::span<const StepRow> rows, std::span<int32_t> next_tokens) {
  if (next_tokens.size() != rows.size()) {
    return Error(ErrorCode::kInvalidArgument, "{} token slots for {} rows", next_tokens.size(),
                 rows.size());
  }
  const int64_t vocab = model_.config().vocab_size;
  size_t scratch = 0;
  for (const StepRow& row : rows) scratch += row.sampling && !row.logits_out;
  logits_.resize(scratch * static_cast<size_t>(vocab));
  inputs_.clear();
  size_t next = 0;
  for (const StepRow& row : rows) {
    StepInput in;
    in.kv = row.kv;
    in.tokens = row.tokens;
    in.finish_prefill = row.finish_prefill;
    const bool wanted = row.sampling || row.logits_out;
    in.logits = wanted ? StepInput::Logits::kLast : StepInput::Logits::kNone;
    in.logits_out = row.logits_out;
    if (row.sampling && !row.logits_out) in.logits_out = logits_.data() + (next++) * vocab;
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

}  // namespace shadowkv::engine
