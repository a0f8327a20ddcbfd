// Metrics: histogram buckets are cumulative; the text names every series the docs list.
#include "server/metrics.h"

#include <gtest/gtest.h>

namespace shadowkv::server {
namespace {

TEST(HistogramTest, CumulativeBucketsSumAndCount) {
  Histogram h({0.25, 1.0});
  for (double v : {0.125, 0.25, 0.5, 2.0}) h.Observe(v);
  std::string out;
  h.Render("x", &out);
  EXPECT_NE(out.find("x_bucket{le=\"0.25\"} 2\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"1\"} 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"+Inf\"} 4\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_sum 2.875\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_count 4\n"), std::string::npos) << out;
}

TEST(MetricsTest, RendersCountersGaugesAndHitRate) {
  Metrics m;
  m.CountRequest("/v1/completions", 200);
  m.CountRequest("/v1/completions", 200);
  m.CountRequest("/v1/completions", 429);
  m.AddPromptTokens(10, 4);
  m.AddGeneratedTokens(5);
  kv::PolicyStats stats;
  stats.chunk_selections = 8;
  stats.chunk_hits = 6;
  stats.compress_seconds = 0.25;
  m.AddPolicyStats("shadowkv", stats);
  m.AddPolicyStats("shadowkv", stats);
  EngineGauges g;
  g.queue_depth = 3;
  g.active_memory = {100, 200};
  m.SetEngineGauges(g);
  EXPECT_EQ(m.requests_total("/v1/completions", 200), 2);
  EXPECT_EQ(m.requests_total("/v1/completions", 404), 0);
  const std::string text = m.Render();
  for (const char* line :
       {"shadowkv_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2\n",
        "shadowkv_requests_total{endpoint=\"/v1/completions\",status=\"429\"} 1\n",
        "shadowkv_prompt_tokens_total 10\n", "shadowkv_reused_prompt_tokens_total 4\n",
        "shadowkv_generated_tokens_total 5\n", "shadowkv_generated_tokens_per_second 0.5\n",
        "shadowkv_queue_depth 3\n",
        "shadowkv_kv_memory_bytes{tier=\"slow\",owner=\"running\"} 200\n",
        "shadowkv_kv_hit_rate{policy=\"shadowkv\"} 0.75\n",
        "shadowkv_kv_compress_seconds_total{policy=\"shadowkv\"} 0.5\n",
        "# TYPE shadowkv_time_to_first_token_seconds histogram\n",
        "# TYPE shadowkv_inter_token_latency_seconds histogram\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace shadowkv::server
