// The server's GPU model (CudaServingModel): its steps against the CPU model's on the same
// inputs (one GPU, and split over two ranks on it), the scheduler over a pool smaller than the
// requests, and ShadowKV serving that compresses long prompts and keeps short ones exact.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine/scheduler.h"
#include "gpu/serving/cuda_serving_model.h"
#include "gpu/tp/cuda_model_group.h"
#include "gpu_test_util.h"
#include "tiny_model.h"

namespace shadowkv::cuda {
namespace {

using namespace std::chrono_literals;
using testing::RelativeError;

std::string ServingModelPath() {
  static const std::string path = shadowkv::testing::WriteTinyModel(
      shadowkv::testing::SmallSpec("llama", 256, 4, 2, gguf::GgmlType::kF32, true, 41),
      "gpu_serving");
  return path;
}

CudaServingOptions Options(const std::string& policy, TensorParallelOptions tp = {}) {
  CudaServingOptions o;
  o.kv.policy = policy;
  // ShadowKV: 16 chunks of 8 and 3 outlier chunks, so prompts of 184 tokens or more compress.
  // Full attention keeps the default settings (what kv::KvPolicyConfig{} asks for).
  if (policy != "full") o.kv.budget_tokens = 128;
  o.max_batch = 4;
  o.prefill_chunk = 700;  // the direct steps below put up to 660 prompt tokens in one forward
  o.sequences = 3;
  o.context = 1024;
  o.tensor_parallel = tp;
  return o;
}

// One row's step (no token drawn).
Status StepOne(engine::ServingModel& model, const engine::StepRow& row) {
  int32_t unused = 0;
  return model.Step(std::span<const engine::StepRow>(&row, 1), std::span<int32_t>(&unused, 1));
}

std::vector<int32_t> Tokens(int count, uint32_t seed) {
  return shadowkv::testing::SomeTokens(count, seed);
}

// Feeds both models the same steps (teacher-forced: every decode row takes a fixed token) and
// returns the worst relative error of the logits over all outputs.
struct Stepper {
  engine::ServingModel& model;
  std::unique_ptr<kv::KvPolicy> policy;
  std::vector<std::unique_ptr<kv::SequenceKv>> seqs;

  std::vector<std::vector<float>> Step(
      const std::vector<std::pair<int, std::vector<int32_t>>>& rows,
      const std::vector<bool>& finish) {
    const int64_t vocab = model.config().vocab_size;
    std::vector<std::vector<float>> logits(rows.size(), std::vector<float>(vocab));
    std::vector<engine::StepRow> inputs(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      inputs[i].kv = seqs[rows[i].first].get();
      inputs[i].tokens = rows[i].second;
      inputs[i].finish_prefill = finish[i];
      inputs[i].logits_out = logits[i].data();
    }
    std::vector<int32_t> unused(rows.size());
    const Status status = model.Step(inputs, unused);
    EXPECT_TRUE(status.ok()) << status.ToString();
    return logits;
  }
};

void CheckStepsMatchTheCpu(TensorParallelOptions tp, const char* label) {
  auto gpu = CudaServingModel::Load(ServingModelPath(), Options("full", tp));
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  auto cpu_model = CpuModel::Load(ServingModelPath(), 1);
  ASSERT_TRUE(cpu_model.ok());
  engine::CpuServingModel cpu(**cpu_model);
  kv::KvPolicyConfig full;
  Stepper a{**gpu, (*gpu)->MakePolicy(full).value(), {}};
  Stepper b{cpu, cpu.MakePolicy(full).value(), {}};
  for (Stepper* s : {&a, &b}) {
    for (int i = 0; i < 2; ++i) s->seqs.push_back(s->policy->NewSequence().value());
  }
  const std::vector<int32_t> p0 = Tokens(90, 1), p1 = Tokens(70, 2);
  // Step 1: half of prompt 0. Step 2: the rest. Step 3: a decode row of 0 beside all of
  // prompt 1 (one mixed forward). Steps 4-8: decode rows of both (graph-replayed decode steps).
  std::vector<std::vector<std::pair<int, std::vector<int32_t>>>> steps = {
      {{0, {p0.begin(), p0.begin() + 45}}},
      {{0, {p0.begin() + 45, p0.end()}}},
      {{0, {17}}, {1, p1}}};
  std::vector<std::vector<bool>> finish = {{false}, {true}, {false, true}};
  for (int t = 0; t < 5; ++t) {
    steps.push_back({{0, {static_cast<int32_t>(30 + t)}}, {1, {static_cast<int32_t>(60 + t)}}});
    finish.push_back({false, false});
  }
  double worst = 0;
  int compared = 0;
  for (size_t k = 0; k < steps.size(); ++k) {
    const auto got = a.Step(steps[k], finish[k]);
    const auto want = b.Step(steps[k], finish[k]);
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, RelativeError(got[i], want[i]));
      ++compared;
    }
  }
  EXPECT_EQ(a.seqs[0]->num_tokens(), 90 + 6);
  EXPECT_EQ(a.seqs[1]->num_tokens(), 70 + 5);
  std::printf("[ parity   ] serving %s: %d logit vectors, worst relative error %.2e\n", label,
              compared, worst);
  EXPECT_LT(worst, 3e-2);  // the bound of the whole-model parity tests
}

TEST(CudaServingTest, StepsMatchTheCpuModel) {
  SKV_SKIP_WITHOUT_GPU();
  CheckStepsMatchTheCpu({}, "1 rank");
}

TEST(CudaServingTest, StepsSplitOverTwoRanksMatchTheCpuModel) {
  SKV_SKIP_WITHOUT_GPU();
  CheckStepsMatchTheCpu({2, true}, "2 ranks (local)");
}

TEST(CudaServingTest, RefusesOtherSettingsAndSequencesBeyondThePool) {
  SKV_SKIP_WITHOUT_GPU();
  auto snap = CudaServingModel::Load(ServingModelPath(), Options("snapkv"));
  EXPECT_EQ(snap.status().code(), ErrorCode::kUnsupported) << snap.status().ToString();
  CudaServingOptions too_long = Options("full");
  too_long.context = 1 << 30;
  EXPECT_EQ(CudaServingModel::Load(ServingModelPath(), too_long).status().code(),
            ErrorCode::kInvalidArgument);
  auto model = CudaServingModel::Load(ServingModelPath(), Options("full"));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->config().context_length, 1024);
  kv::KvPolicyConfig other;
  other.policy = "shadowkv";
  EXPECT_EQ((*model)->MakePolicy(other).status().code(), ErrorCode::kInvalidArgument);
  auto policy = (*model)->MakePolicy(kv::KvPolicyConfig{}).value();
  std::vector<std::unique_ptr<kv::SequenceKv>> held;
  for (int i = 0; i < 3; ++i) held.push_back(policy->NewSequence().value());
  EXPECT_EQ(policy->NewSequence().status().code(), ErrorCode::kResourceExhausted);
  held.pop_back();  // gives its slot back
  EXPECT_TRUE(policy->NewSequence().ok());
  // A step past the context is refused before any GPU work.
  std::vector<int32_t> many(1025, 5);
  engine::StepRow in;
  in.kv = held[0].get();
  in.tokens = many;
  EXPECT_EQ(StepOne(**model, in).code(), ErrorCode::kOutOfRange);
}

engine::SequenceRequest Request(const kv::KvPolicy& policy, std::vector<int32_t> prompt,
                                int max_new) {
  engine::SequenceRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  r.policy = &policy;
  r.stop_at_end_of_generation = false;
  return r;
}

std::vector<int32_t> Collect(engine::SequenceHandle& handle) {
  std::vector<int32_t> tokens;
  while (!handle.Wait(1000ms, &tokens)) {
  }
  return tokens;
}

// Runs `prompts` through the scheduler at once; every request must end by its length.
std::vector<std::vector<int32_t>> Serve(CudaServingModel& model, const kv::KvPolicy& policy,
                                        const std::vector<std::vector<int32_t>>& prompts,
                                        int max_new) {
  engine::SchedulerOptions options;
  options.max_batch = 4;
  // Room for every prompt of the three sequences running at once in one step: each prompt is
  // one chunk, as in the reference run below.
  options.prefill_chunk = 600;
  options.max_held_states = 2;
  engine::Scheduler scheduler(model, options, nullptr);
  std::vector<std::shared_ptr<engine::SequenceHandle>> handles;
  for (const auto& prompt : prompts) {
    engine::SubmitResult s = scheduler.Submit(Request(policy, prompt, max_new));
    EXPECT_EQ(s.code, engine::SubmitResult::Code::kOk) << s.message;
    handles.push_back(s.handle);
  }
  std::vector<std::vector<int32_t>> out;
  for (auto& h : handles) {
    out.push_back(Collect(*h));
    EXPECT_EQ(h->end_reason(), engine::EndReason::kLength) << h->status().ToString();
  }
  return out;
}

TEST(CudaServingTest, SchedulerServesMoreRequestsThanThePoolHolds) {
  SKV_SKIP_WITHOUT_GPU();
  auto model = CudaServingModel::Load(ServingModelPath(), Options("full"));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto policy = (*model)->MakePolicy(kv::KvPolicyConfig{}).value();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 7; ++i) prompts.push_back(Tokens(20 + 31 * i, 100 + i));
  const auto out = Serve(**model, *policy, prompts, 12);
  ASSERT_EQ(out.size(), prompts.size());
  for (const auto& tokens : out) EXPECT_EQ(tokens.size(), 12u);
  // Greedy decoding on the GPU alone gives the same first token (the prompt's last logits).
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto& group = (*model)->group();
    ASSERT_EQ(out[i].empty(), false);
    std::vector<float> logits(group.config().vocab_size);
    auto seq = policy->NewSequence();
    ASSERT_TRUE(seq.ok()) << seq.status().ToString();  // the finished ones gave theirs back
    engine::StepRow in;  // the whole prompt in one chunk, as the scheduler ran it
    in.kv = seq->get();
    in.tokens = prompts[i];
    in.finish_prefill = true;
    in.logits_out = logits.data();
    ASSERT_TRUE(StepOne(**model, in).ok());
    EXPECT_EQ(out[i][0], std::max_element(logits.begin(), logits.end()) - logits.begin())
        << "request " << i;
  }
}

TEST(CudaServingTest, ShadowKvCompressesLongPromptsAndKeepsShortOnesExact) {
  SKV_SKIP_WITHOUT_GPU();
  auto sparse = CudaServingModel::Load(ServingModelPath(), Options("shadowkv"));
  ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
  auto dense = CudaServingModel::Load(ServingModelPath(), Options("full"));
  ASSERT_TRUE(dense.ok()) << dense.status().ToString();
  kv::KvPolicyConfig skv_config = Options("shadowkv").kv;
  Stepper s{**sparse, (*sparse)->MakePolicy(skv_config).value(), {}};
  Stepper f{**dense, (*dense)->MakePolicy(kv::KvPolicyConfig{}).value(), {}};
  for (Stepper* x : {&s, &f}) {
    for (int i = 0; i < 2; ++i) x->seqs.push_back(x->policy->NewSequence().value());
  }
  const std::vector<int32_t> long_prompt = Tokens(600, 7), short_prompt = Tokens(60, 8);
  double long_worst = 0, short_worst = 0;
  auto compare = [&](const std::vector<std::pair<int, std::vector<int32_t>>>& rows,
                     const std::vector<bool>& finish, bool first) {
    const auto got = s.Step(rows, finish);
    const auto want = f.Step(rows, finish);
    for (size_t i = 0; i < rows.size(); ++i) {
      const double e = RelativeError(got[i], want[i]);
      if (first) {
        EXPECT_LT(e, 1e-6) << "the prefill's logits are full attention's";
      } else {
        (rows[i].first == 0 ? long_worst : short_worst) =
            std::max(rows[i].first == 0 ? long_worst : short_worst, e);
      }
    }
  };
  compare({{0, long_prompt}, {1, short_prompt}}, {true, true}, true);
  const kv::MemoryUsage compressed = s.seqs[0]->memory(), exact = s.seqs[1]->memory();
  for (int t = 0; t < 8; ++t) {
    compare({{0, {static_cast<int32_t>(40 + t)}}, {1, {static_cast<int32_t>(80 + t)}}},
            {false, false}, false);
  }
  // The long prompt holds no full-cache slot once compressed; the short one keeps its slot.
  EXPECT_LT(compressed.fast_bytes, exact.fast_bytes);
  // The compressed sequence's chunk selections: 16 chunks per layer and KV head at each of the
  // 8 steps, some of them already gathered; the exact one selects none.
  const ModelConfig& shape = (*sparse)->config();
  const kv::PolicyStats& counted = s.seqs[0]->stats();
  EXPECT_EQ(counted.chunk_selections, int64_t{8} * shape.num_layers * shape.num_kv_heads * 16);
  EXPECT_GT(counted.chunk_hits, 0);
  EXPECT_LE(counted.chunk_hits, counted.chunk_selections);
  EXPECT_EQ(s.seqs[1]->stats().chunk_selections, 0);
  EXPECT_EQ(s.seqs[0]->num_tokens(), 608);
  EXPECT_EQ((*sparse)->group().shadowkv_length(0) + (*sparse)->group().shadowkv_length(1) +
                (*sparse)->group().shadowkv_length(2),
            608);
  std::printf(
      "[ parity   ] serving shadowkv vs full: worst relative error %.2e (compressed "
      "600-token prompt), %.2e (60-token prompt, kept exact)\n",
      long_worst, short_worst);
  EXPECT_LT(short_worst, 3e-2);  // the same full attention: rounding only
  // The compressed sequence decodes through the sparse path: low-rank keys and 128 of 600
  // tokens, far from full attention on a random model (whose keys are not low-rank). How close
  // that path is to the CPU policy is the ShadowKV parity tests' subject; here, that it ran.
  EXPECT_TRUE(std::isfinite(long_worst));
  EXPECT_GT(long_worst, 1e-3);

  // Through the scheduler: three long and two short prompts, a pool of three.
  std::vector<std::vector<int32_t>> prompts = {Tokens(300, 11), Tokens(30, 12), Tokens(500, 13),
                                               Tokens(200, 14), Tokens(5, 15)};
  s.seqs.clear();
  const auto out = Serve(**sparse, *s.policy, prompts, 10);
  for (const auto& tokens : out) EXPECT_EQ(tokens.size(), 10u);
}

// A held compressed sequence's later turn (several new tokens, the last one sampled, as the
// scheduler sends a reused state's turn). With recompress_turns the sequence goes back into a
// prompt slot, the new tokens are prefilled there with full attention over the rebuilt keys (or,
// with keep_prompt_keys, the prompt's kept exact keys), and the whole is compressed again: at
// full rank the turn's logits are full attention's. Without, each new token is one ShadowKV
// step over the budget. Either way the sequence ends compressed, holding every token and no
// slot, and decodes on. With keep_prompt_keys and no host memory allowed for the copies
// (kept_keys_limit_bytes 0), the turn is recompressed from the rank-r keys, as without.
TEST(CudaServingTest, LaterTurnsOfHeldSequencesAreRecompressed) {
  SKV_SKIP_WITHOUT_GPU();
  auto dense = CudaServingModel::Load(ServingModelPath(), Options("full"));
  ASSERT_TRUE(dense.ok()) << dense.status().ToString();
  constexpr int kModes = 4;
  const char* name[kModes] = {"recompress", "exact", "decode", "exact, no room for copies"};
  double turn_errors[kModes] = {INFINITY, INFINITY, INFINITY, INFINITY};
  std::vector<float> turn_logits[kModes];
  for (int mode = 0; mode < kModes; ++mode) {
    SCOPED_TRACE(name[mode]);
    const bool recompress = mode != 2;
    CudaServingOptions o = Options("shadowkv");
    o.kv.rank = 128;  // every component: rebuilt keys are the keys up to rounding
    o.recompress_turns = recompress;
    o.keep_prompt_keys = mode == 1 || mode == 3;
    if (mode == 3) o.kept_keys_limit_bytes = 0;
    auto sparse = CudaServingModel::Load(ServingModelPath(), o);
    ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
    const std::string pool = (*sparse)->Describe();
    if (mode == 1) {
      EXPECT_NE(pool.find("from the prompt's exact keys"), std::string::npos) << pool;
    }
    if (mode == 3) {
      EXPECT_NE(pool.find(", 0 sequence(s) within"), std::string::npos) << pool;
    }
    Stepper s{**sparse, (*sparse)->MakePolicy(o.kv).value(), {}};
    Stepper f{**dense, (*dense)->MakePolicy(kv::KvPolicyConfig{}).value(), {}};
    for (Stepper* x : {&s, &f}) x->seqs.push_back(x->policy->NewSequence().value());
    s.Step({{0, Tokens(600, 23)}}, {true});
    f.Step({{0, Tokens(600, 23)}}, {true});
    const kv::MemoryUsage compressed = s.seqs[0]->memory();
    for (int t = 0; t < 4; ++t) {
      s.Step({{0, {static_cast<int32_t>(50 + t)}}}, {false});
      f.Step({{0, {static_cast<int32_t>(50 + t)}}}, {false});
    }
    // The turn: 20 new tokens in one row that samples its next token.
    const std::vector<int32_t> turn = Tokens(20, 24);
    const SamplingParams greedy;
    const int64_t vocab = (*sparse)->config().vocab_size;
    std::vector<float> got(vocab), want(vocab);
    for (auto [model, seq, logits] :
         {std::tuple{sparse->get(), s.seqs[0].get(), got.data()},
          std::tuple{dense->get(), f.seqs[0].get(), want.data()}}) {
      engine::StepRow row;
      row.kv = seq;
      row.tokens = turn;
      row.sampling = &greedy;
      row.logits_out = logits;
      ASSERT_TRUE(StepOne(*model, row).ok());
    }
    const double turn_error = RelativeError(got, want);
    std::printf("[ turns    ] %s: the later turn's logits against full attention, relative "
                "error %.2e\n", name[mode], turn_error);
    turn_errors[mode] = turn_error;
    turn_logits[mode] = got;
    if (recompress) {
      EXPECT_LT(turn_error, 3e-2);
    }
    EXPECT_EQ(s.seqs[0]->num_tokens(), 624);
    EXPECT_EQ(s.seqs[0]->memory().fast_bytes, compressed.fast_bytes) << "compressed, no slot";
    int64_t held = 0;
    for (int seq = 0; seq < 3; ++seq) held += (*sparse)->group().shadowkv_length(seq);
    EXPECT_EQ(held, 624);
    for (int t = 0; t < 3; ++t) {
      const auto after = s.Step({{0, {static_cast<int32_t>(70 + t)}}}, {false});
      for (float x : after[0]) ASSERT_TRUE(std::isfinite(x));
    }
    // Every prompt slot is free again: the pool's other two sequences can be had.
    auto a = s.policy->NewSequence(), b = s.policy->NewSequence();
    EXPECT_TRUE(a.ok() && b.ok());
  }
  // One ShadowKV step per new token reads 128 tokens of 600 on a random model: far from full
  // attention, and farther than the recompressed turn.
  EXPECT_TRUE(std::isfinite(turn_errors[2]));
  EXPECT_LT(turn_errors[0], turn_errors[2]);
  EXPECT_LT(turn_errors[1], turn_errors[2]);
  // The exact keys differ from the full-rank rebuild by its rounding; with no room for copies
  // the turn takes the rebuild's path, step for step.
  EXPECT_GT(RelativeError(turn_logits[1], turn_logits[0]), 0.0);
  EXPECT_LT(RelativeError(turn_logits[3], turn_logits[0]), 1e-6);
}

// The start-up warm-up (a throwaway prompt prefilled, compressed and decoded) gives its
// sequence back and leaves nothing behind: the whole pool is free, and the same steps give the
// same logits as on a model that never warmed up.
TEST(CudaServingTest, WarmUpLeavesThePoolAsItFoundIt) {
  SKV_SKIP_WITHOUT_GPU();
  auto warmed = CudaServingModel::Load(ServingModelPath(), Options("shadowkv"));
  ASSERT_TRUE(warmed.ok()) << warmed.status().ToString();
  auto cold = CudaServingModel::Load(ServingModelPath(), Options("shadowkv"));
  ASSERT_TRUE(cold.ok()) << cold.status().ToString();
  const Status warm = (*warmed)->WarmUp();
  ASSERT_TRUE(warm.ok()) << warm.ToString();
  const kv::KvPolicyConfig config = Options("shadowkv").kv;
  Stepper a{**warmed, (*warmed)->MakePolicy(config).value(), {}};
  Stepper b{**cold, (*cold)->MakePolicy(config).value(), {}};
  for (Stepper* x : {&a, &b}) {
    for (int i = 0; i < Options("shadowkv").sequences; ++i) {
      auto sequence = x->policy->NewSequence();
      ASSERT_TRUE(sequence.ok()) << "sequence " << i << ": " << sequence.status().ToString();
      x->seqs.push_back(std::move(*sequence));
    }
  }
  const std::vector<int32_t> p0 = Tokens(600, 21), p1 = Tokens(400, 22);
  double worst = 0;
  auto step = [&](const std::vector<std::pair<int, std::vector<int32_t>>>& rows,
                  const std::vector<bool>& finish) {
    const auto got = a.Step(rows, finish);
    const auto want = b.Step(rows, finish);
    for (size_t i = 0; i < rows.size(); ++i) worst = std::max(worst, RelativeError(got[i], want[i]));
  };
  step({{0, p0}}, {true});
  step({{1, p1}}, {true});
  for (int t = 0; t < 12; ++t) {
    step({{0, {static_cast<int32_t>(40 + t)}}, {1, {static_cast<int32_t>(90 + t)}}},
         {false, false});
  }
  EXPECT_LT(worst, 1e-6) << "the warm-up's sequence left state that a later one saw";
}

// A held sequence forks on the device: the copy (and the original) decode exactly as the
// original would have, for a full-cache slot and for a compressed ShadowKV sequence.
TEST(CudaServingTest, ForkedSequencesDecodeAsTheOriginal) {
  SKV_SKIP_WITHOUT_GPU();
  for (const char* name : {"full", "shadowkv"}) {
    SCOPED_TRACE(name);
    auto model = CudaServingModel::Load(ServingModelPath(), Options(name));
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    auto policy = (*model)->MakePolicy(Options(name).kv).value();
    auto original = policy->NewSequence().value();
    const int64_t vocab = (*model)->config().vocab_size;
    std::vector<float> logits(vocab);
    const std::vector<int32_t> prompt = Tokens(600, 21);  // long enough to compress
    engine::StepRow row;
    row.kv = original.get();
    row.tokens = prompt;
    row.finish_prefill = true;
    row.logits_out = logits.data();
    ASSERT_TRUE(StepOne(**model, row).ok());
    auto copy = original->Fork();
    ASSERT_TRUE(copy.ok()) << copy.status().ToString();
    EXPECT_EQ((*copy)->num_tokens(), original->num_tokens());
    EXPECT_EQ((*copy)->memory().fast_bytes, original->memory().fast_bytes);
    // The same tokens, one step each, through both: the same logits.
    for (int t = 0; t < 6; ++t) {
      const int32_t token = 40 + t;
      std::vector<float> a(vocab), b(vocab);
      engine::StepRow step;
      step.tokens = std::span<const int32_t>(&token, 1);
      step.kv = original.get();
      step.logits_out = a.data();
      ASSERT_TRUE(StepOne(**model, step).ok());
      step.kv = copy->get();
      step.logits_out = b.data();
      ASSERT_TRUE(StepOne(**model, step).ok());
      EXPECT_EQ(a, b) << "step " << t;
    }
    // The pool (3 sequences) holds one more copy, then says so.
    auto second = original->Fork();
    ASSERT_TRUE(second.ok()) << second.status().ToString();
    EXPECT_EQ(original->Fork().status().code(), ErrorCode::kResourceExhausted);
  }
}

}  // namespace
}  // namespace shadowkv::cuda
