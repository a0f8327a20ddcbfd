// The eval runner: synthetic tasks × context lengths × samples under several KV policies, the
// NIAH depth grid, and multi-turn NIAH.
//
// Each sample is prefilled once (full attention, recorded) and replayed into a fresh sequence of
// every policy; the policies then decode greedily side by side in one batched forward step. With
// an AnswerBackend (the GPU) the backend answers instead; its conversations run one policy after
// another, each prefilling the sample itself.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "eval/greedy.h"
#include "eval/prompt_format.h"
#include "eval/tasks.h"
#include "kv/kv_config.h"
#include "kv/kv_policy.h"
#include "model/cpu_model.h"

namespace shadowkv::eval {

enum class EvalMode { kTasks, kNiahGrid, kMultiTurn };
const char* EvalModeName(EvalMode mode);

struct EvalSettings {
  EvalMode mode = EvalMode::kTasks;
  std::vector<std::string> tasks;  // kTasks; kNiahGrid uses the first
  std::vector<int64_t> lengths;    // target tokens (prompt + generation cap)
  int samples = 4;                 // per task and length (per grid cell, per length)
  uint64_t seed = 42;
  double depth = -1.0;              // kTasks: fixed needle depth, < 0 random
  std::vector<double> grid_depths;  // kNiahGrid
  int turns = 0;                    // kMultiTurn: needles = questions
  // kMultiTurn: each later turn prefills the policy's whole conversation so far into a new
  // sequence (full-attention prefill, then the policy compresses it) instead of appending the
  // follow-up to the held one: the reference that KV reuse across turns is measured against.
  bool fresh_turns = false;
  std::vector<kv::KvPolicyConfig> policies;  // one per policy, in report order
  int prefill_chunk = 512;
  // kTasks and kNiahGrid: after the answers, every policy follows the first policy's answer
  // token by token (teacher forcing, from the same prompt), and PolicyOutput::fidelity says how
  // closely its next-token distributions match the first's. With a backend, as far as it can
  // (AnswerBackend::Check refuses otherwise).
  bool fidelity = false;
};

// One policy's answer to one question.
struct PolicyOutput {
  std::string policy;
  std::string text;             // generated text, special tokens dropped
  std::vector<int32_t> tokens;  // generated tokens
  double score = 0.0;           // in [0, 1]
  int generated_tokens = 0;
  bool truncated = false;        // the context filled up before the answer ended
  int64_t budget_tokens = 0;     // the policy's budget for this prompt (0: full)
  int rank = 0;                  // shadowkv: rank of the key factorisation (layer 0)
  std::vector<int> layer_ranks;  // shadowkv: each layer's rank ([num_layers]; 0 uncompressed)
  int64_t outlier_chunks = 0;    // shadowkv: outlier chunks per KV head (layer 0, head 0)
  kv::PolicyStats stats;
  kv::MemoryUsage memory;
  int64_t kv_tokens = 0;  // tokens the sequence held when `memory` was taken (0: not reported)
  Fidelity fidelity;      // EvalSettings::fidelity: along the first policy's answer (0 steps: off)
};

// One question of one sample (multi-turn: one row per turn), answered by every policy.
struct QuestionOutcome {
  std::string task;
  int64_t length = 0;         // target tokens
  int index = 0;              // sample
  int turn = 0;               // multi-turn: 1-based; 0 otherwise
  double depth = -1.0;        // depth of the asked needle (grid, multi-turn); -1 when n/a
  int64_t prompt_tokens = 0;  // tokens before this question's answer
  std::vector<std::string> answers;
  std::vector<PolicyOutput> outputs;  // [policy], in settings order
  double prefill_seconds = 0.0;       // the shared prefill (first question of a sample)
  double decode_seconds = 0.0;        // all policies together
};

struct EvalReport {
  EvalSettings settings;
  std::string model_path;
  std::string model_sha256;  // filled by the caller where it can hash the file
  std::string model_summary;
  std::string numerics;  // the model's arithmetic (exact | int8)
  std::string prompt_format;
  std::string haystack_source;
  std::vector<QuestionOutcome> questions;
  double seconds = 0.0;
  bool complete = false;  // false in a report of a run still going (EvalProgress::partial)
};

// Work done so far, for progress lines; weights approximate cost (prompt tokens).
struct EvalProgress {
  int64_t done = 0, total = 0;  // questions (samples, grid cells × samples)
  double done_weight = 0, total_weight = 0;
  std::string current;  // what is running now
  // The report so far (the questions answered, in order; `complete` false), for a caller that
  // keeps what a stopped run did. Valid during the progress call only.
  const EvalReport* partial = nullptr;
};
using ProgressFn = std::function<void(const EvalProgress&)>;

// One policy's greedy answer from an AnswerBackend.
struct BackendAnswer {
  std::vector<int32_t> tokens;  // generated, end-of-generation token included when reached
  bool truncated = false;
  kv::PolicyStats stats;         // chunk selections and hits where the policy selects chunks
  kv::MemoryUsage memory;        // KV bytes of the answer's sequence (fast tier, slow tier)
  int rank = 0;                  // shadowkv
  std::vector<int> layer_ranks;  // shadowkv, [num_layers] where the backend reports them
  int64_t outlier_chunks = 0;    // shadowkv, per KV head
  Fidelity fidelity;             // asked for: along the first policy's answer (0 steps: none)
  int64_t kv_tokens = 0;         // tokens the sequence held when `memory` was taken (after the
                                 // answer, or the turn); 0: not reported, no bytes per token
};

// Answers questions somewhere other than the CPU model (the CUDA backend): every policy's
// greedy answer to one prompt and, where its Check accepts them, multi-turn conversations one
// policy at a time. The CPU model still synthesises, tokenises and scores.
class AnswerBackend {
 public:
  virtual ~AnswerBackend() = default;
  virtual std::string numerics() const = 0;  // shown in the report, e.g. "cuda-bf16"
  // Rejects policies the backend cannot run, or fidelity (EvalSettings::fidelity) or
  // conversations (multi-turn NIAH) where it cannot measure them, before any sample is made.
  virtual Status Check(const std::vector<kv::KvPolicyConfig>& policies, bool fidelity,
                       bool conversations) const = 0;
  // `answers` receives one entry per policy, in order; `prefill_seconds` the shared prefill.
  // With `fidelity`, each answer's fidelity along the first policy's answer as well.
  virtual Status Answer(const std::vector<int32_t>& prompt, int max_new_tokens,
                        const std::vector<kv::KvPolicyConfig>& policies, bool fidelity,
                        std::vector<BackendAnswer>* answers, double* prefill_seconds) = 0;

  // Conversations (multi-turn NIAH), one open at a time, each under one policy:
  //   1. OpenConversation prefills `tokens` under `policy` (replacing any open conversation) and
  //      gives the token the prompt predicts;
  //   2. RunConversation feeds `stream` (its pending tokens, then its own greedy tokens) until
  //      it is done, in the open conversation's sequence; `answer` receives the sequence's
  //      counts since the open (stats, memory, rank, kv_tokens), not tokens;
  //   3. CloseConversation frees the sequence.
  // A later turn is RunConversation again on the same stream with the follow-up in its feed.
  virtual Status OpenConversation(const std::vector<int32_t>& tokens,
                                  const kv::KvPolicyConfig& policy, int32_t* first,
                                  double* prefill_seconds);
  virtual Status RunConversation(GreedyStream& stream, BackendAnswer* answer);
  virtual void CloseConversation() {}
};

struct PrefillRecord;

// Every CPU policy's greedy answer to a recorded prompt (for a backend that prefilled elsewhere
// and hands the rest to the CPU): each policy replays `record` into a sequence of its own, then
// all decode side by side on `model`. `answers` receives one entry per policy, in order.
Status AnswerFromRecord(CpuModel& model, const PrefillRecord& record,
                        const std::vector<kv::KvPolicyConfig>& policies, int max_new_tokens,
                        std::vector<BackendAnswer>* answers);

// Runs settings.mode over `model`. `tasks` renders with `format` and counts with the model's
// tokenizer (see MakeTaskContext). With `backend`, the answers come from it (tasks and grid).
Result<EvalReport> RunEval(CpuModel& model, const PromptFormat& format, const TaskContext& tasks,
                           const EvalSettings& settings, const ProgressFn& progress = nullptr,
                           AnswerBackend* backend = nullptr);

// A task context for `model`: prompts rendered by `format`, lengths counted by its tokenizer.
TaskContext MakeTaskContext(const CpuModel& model, const PromptFormat& format,
                            const EssayCorpus* corpus, const std::vector<std::string>* vocabulary);

}  // namespace shadowkv::eval
