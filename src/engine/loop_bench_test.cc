// RunLoopBench on a tiny random model: every request runs to its length through the loop, the
// shared prompt reaches every request by copy where the policy forks, the figures are filled.
#include "engine/loop_bench.h"

#include <gtest/gtest.h>

#include "../../tests/unit/tiny_model.h"

namespace shadowkv::engine {
namespace {

TEST(LoopBenchTest, MeasuresTheLoopAndSharesThePromptWhereStatesFork) {
  testing::TinyModelSpec spec;
  spec.context = 1024;
  auto model = CpuModel::Load(testing::WriteTinyModel(spec, "loop_bench"), 1).value();
  CpuServingModel serving(*model);
  for (const char* name : {"full", "snapkv"}) {
    SCOPED_TRACE(name);
    kv::KvPolicyConfig config;
    config.policy = name;
    config.budget_tokens = 64;
    auto policy = serving.MakePolicy(config).value();
    LoopBenchCase c;
    c.context = 300;
    c.batch = 3;
    c.gen_tokens = 20;
    c.prefill_chunk = 128;
    auto r = RunLoopBench(serving, *policy, c);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->batch, 3);
    // Full attention's states fork; SnapKV's do not, so each request prefilled its own prompt.
    EXPECT_EQ(r->forked, std::string(name) == "full");
    EXPECT_GT(r->steady_tokens_per_s, 0);
    EXPECT_GT(r->whole_tokens_per_s, 0);
    EXPECT_GT(r->steady_itl_p50_ms, 0);
    EXPECT_GT(r->model_ms, 0);
    EXPECT_GE(r->step_ms, r->model_ms);
    EXPECT_GT(r->prefill_seconds, 0);
    EXPECT_GT(r->memory.fast_bytes, 0);
  }
  LoopBenchCase bad;
  bad.context = 2000;  // past the model's context
  bad.batch = 1;
  kv::KvPolicyConfig full;
  auto policy = serving.MakePolicy(full).value();
  EXPECT_FALSE(RunLoopBench(serving, *policy, bad).ok());
}

}  // namespace
}  // namespace shadowkv::engine
