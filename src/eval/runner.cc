// The eval runner: shared prefill per sample, every policy replayed and decoded side by side.
#include "eval/runner.h"

#include <chrono>
#include <memory>

#include "engine/sampler.h"
#include "eval/greedy.h"
#include "eval/prefill_record.h"
#include "eval/scoring.h"
#include "kv/policies.h"
#include "kv/shadowkv_policy.h"

namespace shadowkv::eval {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A ShadowKV sequence's rank and outlier chunks (its first global layer: layer 0 but on
// sliding-window models, whose windowed layers are not compressed; KV head 0) and every layer's
// rank (0 for a windowed layer); other policies: unchanged.
void ShadowKvShape(const kv::SequenceKv& sequence, const ModelConfig& config, int* rank,
                   std::vector<int>* layer_ranks, int64_t* outlier_chunks) {
  if (const auto* shadow = dynamic_cast<const kv::ShadowKvSequence*>(&sequence)) {
    int first = 0;
    while (first + 1 < config.num_layers && config.IsWindowed(first)) ++first;
    const kv::ShadowKvLayerInfo info = shadow->Inspect(first);
    *rank = info.rank;
    layer_ranks->clear();
    for (int l = 0; l < config.num_layers; ++l) layer_ranks->push_back(shadow->Inspect(l).rank);
    *outlier_chunks =
        info.outlier_chunks.empty() ? 0 : static_cast<int64_t>(info.outlier_chunks[0].size());
  }
}

// Puts the next question of a conversation into `stream`'s feed: the last generated token,
// never fed, opens the follow-up (where it ended the turn, it stands for the end-of-turn markup
// the follow-up starts with). False, feed left empty, where the conversation has no room left.
bool OpenFollowup(const std::string& followup, int max_new_tokens, const Tokenizer& tokenizer,
                  GreedyStream& stream) {
  if (stream.truncated) return false;
  const int32_t last = stream.generated.back();
  std::string text = followup;
  const std::string last_text = tokenizer.Decode(std::span<const int32_t>(&last, 1));
  if (stream.ended && text.starts_with(last_text)) text.erase(0, last_text.size());
  stream.feed = {last};
  const std::vector<int32_t> more = tokenizer.Encode(text, false, true);
  stream.feed.insert(stream.feed.end(), more.begin(), more.end());
  stream.remaining = max_new_tokens;
  stream.ended = false;
  return true;
}

// One sample's sequences, one per policy, kept across the turns of a conversation.
struct Conversation {
  std::vector<std::unique_ptr<kv::SequenceKv>> sequences;  // [policy]
  std::vector<GreedyStream> streams;                       // [policy]
  std::vector<size_t> turn_start;                          // [policy] first token of this turn
  std::vector<std::vector<int32_t>> held;                  // [policy] tokens its sequence holds
  int64_t prefill_tokens = 0;                              // the shared prompt
  std::vector<Fidelity> fidelity;  // [policy] EvalSettings::fidelity, first turn
};

class Runner {
 public:
  Runner(CpuModel& model, const PromptFormat& format, const TaskContext& tasks,
         const EvalSettings& settings, const ProgressFn& progress, AnswerBackend* backend)
      : model_(model),
        format_(format),
        tasks_(tasks),
        settings_(settings),
        progress_(progress),
        backend_(backend) {}

  Result<EvalReport> Run();

 private:
  Status RunTasks();
  Status RunGrid();
  Status AskQuestion(const TaskInfo& task, const SampleRequest& request, const std::string& what,
                     double grid_depth);
  Status RunMultiTurn();
  // One multi-turn sample on the backend: each policy's conversation in turn. `turns` holds one
  // outcome per turn (what was asked); the outputs are appended in policy order.
  Status ConverseOnBackend(const std::vector<int32_t>& prompt, const MultiTurnSample& sample,
                           int max_new_tokens, std::vector<QuestionOutcome>* turns);
  // Prefills `prompt` once and decodes its answer under every policy.
  Status Start(const std::vector<int32_t>& prompt, int max_new_tokens, Conversation* conversation,
               QuestionOutcome* outcome);
  // Asks the next question in every policy's own conversation.
  Status Continue(const std::string& followup, int max_new_tokens, Conversation* conversation,
                  QuestionOutcome* outcome);
  void Collect(Conversation& conversation, Metric metric, QuestionOutcome* outcome);
  // EvalSettings::fresh_turns: replaces policy `p`'s sequence by a fresh prefill of what it held
  // plus its pending feed, and pushes the token that prefill predicts.
  Status PrefillAgain(size_t p, Conversation* conversation);
  // kInternal where a sequence holds other than the tokens recorded for it.
  Status CheckHeld(const Conversation& conversation) const;
  // The backend's answers to one prompt, scored into `outcome`.
  Status AskBackend(const std::vector<int32_t>& prompt, int max_new_tokens, Metric metric,
                    QuestionOutcome* outcome);
  // Text, score and budget of policy `p`'s answer.
  PolicyOutput Output(size_t p, std::span<const int32_t> answer, Metric metric,
                      const QuestionOutcome& outcome, int64_t prefill_tokens) const;
  Result<std::vector<int32_t>> Encode(const std::string& prompt, int max_new_tokens) const;
  void Report(const std::string& current);
  Status Annotate(const Status& status, const std::string& what) const {
    return status.ok() ? status : Error(status.code(), "{}: {}", what, status.message());
  }

  CpuModel& model_;
  const PromptFormat& format_;
  const TaskContext& tasks_;
  const EvalSettings& settings_;
  const ProgressFn& progress_;
  AnswerBackend* backend_;
  std::vector<std::unique_ptr<kv::KvPolicy>> policies_;
  EvalReport report_;
  EvalProgress state_;
};

Result<EvalReport> Runner::Run() {
  if (settings_.lengths.empty()) return Error(ErrorCode::kInvalidArgument, "no context lengths");
  if (settings_.samples <= 0) return Error(ErrorCode::kInvalidArgument, "no samples");
  if (settings_.policies.empty()) return Error(ErrorCode::kInvalidArgument, "no KV policies");
  for (int64_t length : settings_.lengths) {
    if (length > model_.config().context_length) {
      return Error(ErrorCode::kOutOfRange, "context length {} exceeds the model's context of {}",
                   length, model_.config().context_length);
    }
  }
  for (const kv::KvPolicyConfig& config : settings_.policies) {
    SKV_RETURN_IF_ERROR(config.Validate());
    if (backend_) continue;
    SKV_ASSIGN_OR_RETURN(auto policy, kv::MakeKvPolicy(config, model_.kv_geometry()));
    policies_.push_back(std::move(policy));
  }
  if (settings_.fidelity && settings_.mode == EvalMode::kMultiTurn) {
    return Error(ErrorCode::kUnsupported,
                 "fidelity (teacher forcing) is measured for tasks and the NIAH grid");
  }
  if (backend_) {
    SKV_RETURN_IF_ERROR(backend_->Check(settings_.policies, settings_.fidelity,
                                        settings_.mode == EvalMode::kMultiTurn));
  }
  report_.settings = settings_;
  report_.model_summary = model_.config().Summary();
  report_.numerics = backend_ ? backend_->numerics() : NumericsName(model_.numerics());
  report_.prompt_format = format_.name();
  report_.haystack_source = tasks_.corpus ? tasks_.corpus->source : "";
  const auto start = Clock::now();
  switch (settings_.mode) {
    case EvalMode::kTasks:
      SKV_RETURN_IF_ERROR(RunTasks());
      break;
    case EvalMode::kNiahGrid:
      SKV_RETURN_IF_ERROR(RunGrid());
      break;
    case EvalMode::kMultiTurn:
      SKV_RETURN_IF_ERROR(RunMultiTurn());
      break;
  }
  report_.seconds = Since(start);
  report_.complete = true;
  return std::move(report_);
}

void Runner::Report(const std::string& current) {
  state_.current = current;
  state_.partial = &report_;
  if (progress_) progress_(state_);
}

Result<std::vector<int32_t>> Runner::Encode(const std::string& prompt, int max_new_tokens) const {
  std::vector<int32_t> tokens = model_.tokenizer().Encode(prompt, true, true);
  const int64_t context = model_.config().context_length;
  if (static_cast<int64_t>(tokens.size()) + max_new_tokens > context) {
    return Error(ErrorCode::kOutOfRange,
                 "a prompt of {} tokens plus {} to generate exceeds the model's context of {}",
                 tokens.size(), max_new_tokens, context);
  }
  return tokens;
}

Status Runner::Start(const std::vector<int32_t>& prompt, int max_new_tokens,
                     Conversation* conversation, QuestionOutcome* outcome) {
  auto start = Clock::now();
  std::vector<float> first_logits;
  PrefillRecord kept;  // EvalSettings::fidelity replays the prompt once more after the answers
  {
    SKV_ASSIGN_OR_RETURN(PrefillRecord record,
                         RecordPrefill(model_, prompt, settings_.prefill_chunk));
    for (const auto& policy : policies_) {
      SKV_ASSIGN_OR_RETURN(auto sequence, policy->NewSequence());
      SKV_RETURN_IF_ERROR(ReplayPrefill(record, *sequence));
      conversation->sequences.push_back(std::move(sequence));
    }
    first_logits = record.last_logits;
    if (settings_.fidelity) kept = std::move(record);
  }  // otherwise the record is freed before decoding
  outcome->prefill_seconds = Since(start);
  outcome->prompt_tokens = static_cast<int64_t>(prompt.size());
  conversation->prefill_tokens = outcome->prompt_tokens;
  start = Clock::now();
  const int32_t first = Argmax(first_logits);
  conversation->streams.resize(policies_.size());
  conversation->turn_start.assign(policies_.size(), 0);
  conversation->held.assign(policies_.size(), prompt);
  std::vector<GreedyStream*> streams;
  for (size_t p = 0; p < policies_.size(); ++p) {
    GreedyStream& stream = conversation->streams[p];
    stream.kv = conversation->sequences[p].get();
    stream.remaining = max_new_tokens;
    PushToken(stream, first, model_.tokenizer());
    streams.push_back(&stream);
  }
  SKV_RETURN_IF_ERROR(RunGreedy(model_, streams));
  outcome->decode_seconds = Since(start);
  for (size_t p = 0; p < policies_.size(); ++p) {
    // Every generated token but the last was fed.
    const auto& generated = conversation->streams[p].generated;
    conversation->held[p].insert(conversation->held[p].end(), generated.begin(),
                                 generated.end() - 1);
  }
  SKV_RETURN_IF_ERROR(CheckHeld(*conversation));
  if (settings_.fidelity) {
    std::vector<std::unique_ptr<kv::SequenceKv>> followers;
    std::vector<kv::SequenceKv*> pointers;
    for (const auto& policy : policies_) {
      SKV_ASSIGN_OR_RETURN(auto sequence, policy->NewSequence());
      SKV_RETURN_IF_ERROR(ReplayPrefill(kept, *sequence));
      pointers.push_back(sequence.get());
      followers.push_back(std::move(sequence));
    }
    SKV_RETURN_IF_ERROR(RunTeacherForced(model_, pointers, conversation->streams[0].generated,
                                         &conversation->fidelity));
  }
  return Status::Ok();
}

Status Runner::PrefillAgain(size_t p, Conversation* conversation) {
  GreedyStream& stream = conversation->streams[p];
  std::vector<int32_t> tokens = conversation->held[p];
  tokens.insert(tokens.end(), stream.feed.begin(), stream.feed.end());
  SKV_ASSIGN_OR_RETURN(PrefillRecord record,
                       RecordPrefill(model_, tokens, settings_.prefill_chunk));
  SKV_ASSIGN_OR_RETURN(auto sequence, policies_[p]->NewSequence());
  SKV_RETURN_IF_ERROR(ReplayPrefill(record, *sequence));
  conversation->sequences[p] = std::move(sequence);
  conversation->held[p] = std::move(tokens);
  stream.kv = conversation->sequences[p].get();
  stream.feed.clear();
  PushToken(stream, Argmax(record.last_logits), model_.tokenizer());
  return Status::Ok();
}

Status Runner::Continue(const std::string& followup, int max_new_tokens, Conversation* conversation,
                        QuestionOutcome* outcome) {
  const auto start = Clock::now();
  const Tokenizer& tokenizer = model_.tokenizer();
  std::vector<GreedyStream*> streams;
  for (size_t p = 0; p < policies_.size(); ++p) {
    GreedyStream& stream = conversation->streams[p];
    conversation->turn_start[p] = stream.generated.size();
    if (OpenFollowup(followup, max_new_tokens, tokenizer, stream)) streams.push_back(&stream);
  }
  const GreedyStream& reference = conversation->streams[0];
  outcome->prompt_tokens =
      conversation->sequences[0]->num_tokens() + static_cast<int64_t>(reference.feed.size());
  std::vector<size_t> fed_from(policies_.size());  // [policy] first token generated this turn
  for (size_t p = 0; p < policies_.size(); ++p) {
    GreedyStream& stream = conversation->streams[p];
    if (stream.feed.empty()) continue;
    if (settings_.fresh_turns) {
      SKV_RETURN_IF_ERROR(PrefillAgain(p, conversation));
    } else {
      conversation->held[p].insert(conversation->held[p].end(), stream.feed.begin(),
                                   stream.feed.end());
    }
    fed_from[p] = stream.generated.size() - (settings_.fresh_turns ? 1 : 0);
  }
  SKV_RETURN_IF_ERROR(RunGreedy(model_, streams));
  outcome->decode_seconds = Since(start);
  for (size_t p = 0; p < policies_.size(); ++p) {
    const auto& generated = conversation->streams[p].generated;
    if (conversation->streams[p].truncated || fed_from[p] == 0) continue;
    // This turn's generated tokens, all but the last, went into the sequence.
    conversation->held[p].insert(conversation->held[p].end(), generated.begin() + fed_from[p],
                                 generated.end() - 1);
  }
  return CheckHeld(*conversation);
}

Status Runner::CheckHeld(const Conversation& conversation) const {
  for (size_t p = 0; p < policies_.size(); ++p) {
    const int64_t held = static_cast<int64_t>(conversation.held[p].size());
    if (!conversation.streams[p].truncated && held != conversation.sequences[p]->num_tokens()) {
      return Error(ErrorCode::kInternal, "policy {}: {} tokens recorded, its sequence holds {}",
                   policies_[p]->config().display_name(), held,
                   conversation.sequences[p]->num_tokens());
    }
  }
  return Status::Ok();
}

PolicyOutput Runner::Output(size_t p, std::span<const int32_t> answer, Metric metric,
                            const QuestionOutcome& outcome, int64_t prefill_tokens) const {
  PolicyOutput out;
  out.policy = settings_.policies[p].display_name();
  out.text = model_.tokenizer().Decode(answer, /*skip_special=*/true);
  out.tokens.assign(answer.begin(), answer.end());
  out.score = Score(metric, out.text, outcome.answers);
  out.generated_tokens = static_cast<int>(answer.size());
  if (!kv::IsPolicy(settings_.policies[p], kv::PolicyKind::kFull)) {
    out.budget_tokens = settings_.policies[p].BudgetTokens(prefill_tokens);
  }
  return out;
}

Status Runner::AskBackend(const std::vector<int32_t>& prompt, int max_new_tokens, Metric metric,
                          QuestionOutcome* outcome) {
  std::vector<BackendAnswer> answers;
  const auto start = Clock::now();
  SKV_RETURN_IF_ERROR(backend_->Answer(prompt, max_new_tokens, settings_.policies,
                                       settings_.fidelity, &answers, &outcome->prefill_seconds));
  outcome->decode_seconds = Since(start) - outcome->prefill_seconds;
  outcome->prompt_tokens = static_cast<int64_t>(prompt.size());
  if (answers.size() != settings_.policies.size()) {
    return Error(ErrorCode::kInternal, "the backend answered {} of {} policies", answers.size(),
                 settings_.policies.size());
  }
  for (size_t p = 0; p < answers.size(); ++p) {
    PolicyOutput out = Output(p, answers[p].tokens, metric, *outcome, outcome->prompt_tokens);
    out.truncated = answers[p].truncated;
    out.stats = answers[p].stats;
    out.memory = answers[p].memory;
    out.kv_tokens = answers[p].kv_tokens;
    out.rank = answers[p].rank;
    out.layer_ranks = answers[p].layer_ranks;
    out.outlier_chunks = answers[p].outlier_chunks;
    out.fidelity = answers[p].fidelity;
    outcome->outputs.push_back(std::move(out));
  }
  return Status::Ok();
}

void Runner::Collect(Conversation& conversation, Metric metric, QuestionOutcome* outcome) {
  for (size_t p = 0; p < policies_.size(); ++p) {
    const GreedyStream& stream = conversation.streams[p];
    const kv::SequenceKv& sequence = *conversation.sequences[p];
    const size_t begin = std::min(conversation.turn_start[p], stream.generated.size());
    PolicyOutput out = Output(p, std::span<const int32_t>(stream.generated).subspan(begin), metric,
                              *outcome, conversation.prefill_tokens);
    out.truncated = stream.truncated;
    ShadowKvShape(sequence, model_.config(), &out.rank, &out.layer_ranks, &out.outlier_chunks);
    out.stats = sequence.stats();
    out.memory = sequence.memory();
    out.kv_tokens = sequence.num_tokens();
    if (p < conversation.fidelity.size()) out.fidelity = conversation.fidelity[p];
    outcome->outputs.push_back(std::move(out));
  }
}

Status Runner::RunTasks() {
  for (const std::string& name : settings_.tasks) {
    if (!FindTask(name)) {
      return Error(ErrorCode::kInvalidArgument, "unknown task '{}' ({})", name,
                   kUnavailableTasksNote);
    }
  }
  state_.total =
      static_cast<int64_t>(settings_.lengths.size() * settings_.tasks.size()) * settings_.samples;
  for (int64_t length : settings_.lengths) {
    state_.total_weight += static_cast<double>(length) * settings_.tasks.size() * settings_.samples;
  }
  for (int64_t length : settings_.lengths) {
    for (const std::string& name : settings_.tasks) {
      const TaskInfo& task = *FindTask(name);
      for (int index = 0; index < settings_.samples; ++index) {
        const std::string what = fmt::format("{} at {} tokens, sample {}", name, length, index + 1);
        Report(what);
        SampleRequest request{name, length, settings_.seed, index, settings_.depth};
        SKV_RETURN_IF_ERROR(AskQuestion(task, request, what, -1.0));
      }
    }
  }
  Report("");
  return Status::Ok();
}

// One single-question sample: synthesise, prefill once, decode with every policy, score.
// The recorded depth is `grid_depth` when >= 0, else the needle's when the sample has one.
Status Runner::AskQuestion(const TaskInfo& task, const SampleRequest& request,
                           const std::string& what, double grid_depth) {
  SKV_ASSIGN_OR_RETURN(Sample sample, SynthesizeSample(request, tasks_));
  auto prompt = Encode(sample.prompt, task.max_new_tokens);
  SKV_RETURN_IF_ERROR(Annotate(prompt.status(), what));
  QuestionOutcome outcome;
  outcome.task = task.name;
  outcome.length = request.target_tokens;
  outcome.index = request.index;
  outcome.depth =
      grid_depth >= 0 ? grid_depth : (sample.depths.size() == 1 ? sample.depths[0] : -1.0);
  outcome.answers = sample.answers;
  if (backend_) {
    SKV_RETURN_IF_ERROR(
        Annotate(AskBackend(*prompt, task.max_new_tokens, task.metric, &outcome), what));
  } else {
    Conversation conversation;
    SKV_RETURN_IF_ERROR(
        Annotate(Start(*prompt, task.max_new_tokens, &conversation, &outcome), what));
    Collect(conversation, task.metric, &outcome);
  }
  report_.questions.push_back(std::move(outcome));
  state_.done++;
  state_.done_weight += static_cast<double>(request.target_tokens);
  return Status::Ok();
}

Status Runner::RunGrid() {
  if (settings_.tasks.size() != 1 || !settings_.tasks[0].starts_with("niah_single")) {
    return Error(ErrorCode::kInvalidArgument, "the NIAH grid takes one niah_single_* task");
  }
  if (settings_.grid_depths.empty()) return Error(ErrorCode::kInvalidArgument, "no grid depths");
  const TaskInfo& task = *FindTask(settings_.tasks[0]);
  const int64_t cells = static_cast<int64_t>(settings_.grid_depths.size()) * settings_.samples;
  state_.total = cells * static_cast<int64_t>(settings_.lengths.size());
  for (int64_t length : settings_.lengths)
    state_.total_weight += static_cast<double>(length) * cells;
  for (int64_t length : settings_.lengths) {
    for (double depth : settings_.grid_depths) {
      for (int index = 0; index < settings_.samples; ++index) {
        const std::string what = fmt::format("{} at {} tokens, depth {:g}%, sample {}", task.name,
                                             length, depth, index + 1);
        Report(what);
        SampleRequest request{task.name, length, settings_.seed, index, depth};
        SKV_RETURN_IF_ERROR(AskQuestion(task, request, what, depth));
      }
    }
  }
  Report("");
  return Status::Ok();
}

Status Runner::RunMultiTurn() {
  if (settings_.turns < 1) return Error(ErrorCode::kInvalidArgument, "multi-turn needs turns");
  state_.total = static_cast<int64_t>(settings_.lengths.size()) * settings_.samples;
  for (int64_t length : settings_.lengths) {
    state_.total_weight += static_cast<double>(length) * settings_.samples;
  }
  for (int64_t length : settings_.lengths) {
    for (int index = 0; index < settings_.samples; ++index) {
      const std::string what = fmt::format("multi-turn NIAH ({} turns) at {} tokens, sample {}",
                                           settings_.turns, length, index + 1);
      Report(what);
      SKV_ASSIGN_OR_RETURN(
          MultiTurnSample sample,
          SynthesizeMultiTurn(settings_.turns, length, settings_.seed, index, tasks_));
      const int max_new_tokens = sample.first.max_new_tokens;
      // The whole conversation must fit: its sizing reserved room for every turn.
      auto prompt = Encode(sample.first.prompt, max_new_tokens);
      SKV_RETURN_IF_ERROR(Annotate(prompt.status(), what));
      std::vector<QuestionOutcome> turns(settings_.turns);
      for (int turn = 0; turn < settings_.turns; ++turn) {
        QuestionOutcome& outcome = turns[turn];
        outcome.task = "niah_multi_turn";
        outcome.length = length;
        outcome.index = index;
        outcome.turn = turn + 1;
        outcome.depth = sample.key_depths[turn];
        outcome.answers = {sample.values[turn]};
      }
      if (backend_) {
        SKV_RETURN_IF_ERROR(
            Annotate(ConverseOnBackend(*prompt, sample, max_new_tokens, &turns), what));
      }
      Conversation conversation;
      for (int turn = 0; turn < settings_.turns && !backend_; ++turn) {
        QuestionOutcome& outcome = turns[turn];
        if (turn == 0) {
          SKV_RETURN_IF_ERROR(
              Annotate(Start(*prompt, max_new_tokens, &conversation, &outcome), what));
        } else {
          const std::string followup = format_.Followup(sample.followups[turn - 1]);
          SKV_RETURN_IF_ERROR(
              Annotate(Continue(followup, max_new_tokens, &conversation, &outcome), what));
        }
        Collect(conversation, Metric::kStringMatchAll, &outcome);
      }
      for (QuestionOutcome& outcome : turns) report_.questions.push_back(std::move(outcome));
      state_.done++;
      state_.done_weight += static_cast<double>(length);
    }
  }
  Report("");
  return Status::Ok();
}

Status Runner::ConverseOnBackend(const std::vector<int32_t>& prompt, const MultiTurnSample& sample,
                                 int max_new_tokens, std::vector<QuestionOutcome>* turns) {
  const Tokenizer& tokenizer = model_.tokenizer();
  for (size_t p = 0; p < settings_.policies.size(); ++p) {
    const kv::KvPolicyConfig& policy = settings_.policies[p];
    GreedyStream stream;
    std::vector<int32_t> held = prompt;  // what the sequence holds, as in Conversation::held
    BackendAnswer counts;
    for (size_t turn = 0; turn < turns->size(); ++turn) {
      QuestionOutcome& outcome = (*turns)[turn];
      const size_t turn_start = stream.generated.size();
      double prefill_seconds = 0.0;
      if (turn == 0 || (settings_.fresh_turns && !stream.truncated)) {
        if (turn > 0) {
          OpenFollowup(format_.Followup(sample.followups[turn - 1]), max_new_tokens, tokenizer,
                       stream);
          held.insert(held.end(), stream.feed.begin(), stream.feed.end());
          stream.feed.clear();
        }
        int32_t first = 0;
        SKV_RETURN_IF_ERROR(backend_->OpenConversation(held, policy, &first, &prefill_seconds));
        counts = BackendAnswer{};
        stream.remaining = max_new_tokens;
        PushToken(stream, first, tokenizer);
      } else if (OpenFollowup(format_.Followup(sample.followups[turn - 1]), max_new_tokens,
                              tokenizer, stream)) {
        held.insert(held.end(), stream.feed.begin(), stream.feed.end());
      }
      if (p == 0) outcome.prompt_tokens = static_cast<int64_t>(held.size());
      const auto start = Clock::now();
      if (!stream.truncated) SKV_RETURN_IF_ERROR(backend_->RunConversation(stream, &counts));
      outcome.prefill_seconds += prefill_seconds;
      outcome.decode_seconds += Since(start);
      if (!stream.truncated && stream.generated.size() > turn_start) {
        // This turn's generated tokens, all but the last, went into the sequence (the first
        // one too where this turn opened the conversation: the open pushed it to be fed).
        held.insert(held.end(), stream.generated.begin() + turn_start, stream.generated.end() - 1);
      }
      if (!stream.truncated && counts.kv_tokens != static_cast<int64_t>(held.size())) {
        return Error(ErrorCode::kInternal, "policy {}: {} tokens recorded, its sequence holds {}",
                     policy.display_name(), held.size(), counts.kv_tokens);
      }
      PolicyOutput out =
          Output(p, std::span<const int32_t>(stream.generated).subspan(turn_start),
                 Metric::kStringMatchAll, outcome, static_cast<int64_t>(prompt.size()));
      out.truncated = stream.truncated;
      out.stats = counts.stats;
      out.memory = counts.memory;
      out.rank = counts.rank;
      out.layer_ranks = counts.layer_ranks;
      out.outlier_chunks = counts.outlier_chunks;
      out.kv_tokens = counts.kv_tokens;
      outcome.outputs.push_back(std::move(out));
    }
    backend_->CloseConversation();
  }
  return Status::Ok();
}

}  // namespace

Status AnswerBackend::OpenConversation(const std::vector<int32_t>&, const kv::KvPolicyConfig&,
                                       int32_t*, double*) {
  return Error(ErrorCode::kUnsupported, "this backend holds no conversations (multi-turn NIAH)");
}

Status AnswerBackend::RunConversation(GreedyStream&, BackendAnswer*) {
  return Error(ErrorCode::kUnsupported, "this backend holds no conversations (multi-turn NIAH)");
}

const char* EvalModeName(EvalMode mode) {
  switch (mode) {
    case EvalMode::kTasks:
      return "tasks";
    case EvalMode::kNiahGrid:
      return "niah_grid";
    case EvalMode::kMultiTurn:
      return "multi_turn";
  }
  return "?";
}

Status AnswerFromRecord(CpuModel& model, const PrefillRecord& record,
                        const std::vector<kv::KvPolicyConfig>& policies, int max_new_tokens,
                        std::vector<BackendAnswer>* answers) {
  std::vector<std::unique_ptr<kv::SequenceKv>> sequences;
  for (const kv::KvPolicyConfig& config : policies) {
    SKV_ASSIGN_OR_RETURN(auto policy, kv::MakeKvPolicy(config, model.kv_geometry()));
    SKV_ASSIGN_OR_RETURN(auto sequence, policy->NewSequence());
    SKV_RETURN_IF_ERROR(ReplayPrefill(record, *sequence));
    sequences.push_back(std::move(sequence));
  }
  const int32_t first = Argmax(record.last_logits);
  std::vector<GreedyStream> streams(policies.size());
  std::vector<GreedyStream*> pointers;
  for (size_t p = 0; p < policies.size(); ++p) {
    streams[p].kv = sequences[p].get();
    streams[p].remaining = max_new_tokens;
    PushToken(streams[p], first, model.tokenizer());
    pointers.push_back(&streams[p]);
  }
  SKV_RETURN_IF_ERROR(RunGreedy(model, pointers));
  answers->assign(policies.size(), {});
  for (size_t p = 0; p < policies.size(); ++p) {
    BackendAnswer& answer = (*answers)[p];
    answer.tokens = std::move(streams[p].generated);
    answer.truncated = streams[p].truncated;
    answer.stats = sequences[p]->stats();
    answer.memory = sequences[p]->memory();
    answer.kv_tokens = sequences[p]->num_tokens();
    ShadowKvShape(*sequences[p], model.config(), &answer.rank, &answer.layer_ranks,
                  &answer.outlier_chunks);
  }
  return Status::Ok();
}

Result<EvalReport> RunEval(CpuModel& model, const PromptFormat& format, const TaskContext& tasks,
                           const EvalSettings& settings, const ProgressFn& progress,
                           AnswerBackend* backend) {
  Runner runner(model, format, tasks, settings, progress, backend);
  return runner.Run();
}

TaskContext MakeTaskContext(const CpuModel& model, const PromptFormat& format,
                            const EssayCorpus* corpus, const std::vector<std::string>* vocabulary) {
  TaskContext context;
  context.corpus = corpus;
  context.vocabulary = vocabulary;
  context.render = [format](const PromptParts& parts) { return format.First(parts); };
  const Tokenizer* tokenizer = &model.tokenizer();
  context.count_tokens = [tokenizer](const std::string& text) {
    return static_cast<int64_t>(tokenizer->Encode(text, true, true).size());
  };
  return context;
}

}  // namespace shadowkv::eval
