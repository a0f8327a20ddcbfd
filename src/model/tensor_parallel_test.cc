// Tensor-parallel sharding arithmetic: head and FFN ranges per rank, validation errors, the
// shard's shapes, ShadowKV's per-rank rank, and (on the CPU) that the row / column slices the
// ranges name reproduce the full attention-output and FFN products when the ranks' partial
// products are summed, as the all-reduce does.
#include "model/tensor_parallel.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "model/synthetic.h"

namespace shadowkv {
namespace {

ModelConfig Shape(int query_heads, int kv_heads, int head_dim, int ffn) {
  ModelConfig c;
  c.architecture = "llama";
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_query_heads = query_heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.ffn_size = ffn;
  c.vocab_size = 100;
  c.context_length = 128;
  return c;
}

TEST(TensorParallelTest, Llama3_8bSplitsHeadsAndFfnEvenly) {
  const ModelConfig c = SyntheticModelConfig("llama3-8b").value();  // 32 q, 8 KV, ffn 14336
  for (int size : {1, 2, 4, 8}) {
    int64_t q_next = 0, kv_next = 0, ffn_next = 0;
    for (int rank = 0; rank < size; ++rank) {
      auto shard = MakeShard(c, size, rank);
      ASSERT_TRUE(shard.ok()) << shard.status().ToString();
      EXPECT_EQ(shard->kv_heads, (IndexRange{kv_next, 8 / size}));
      EXPECT_EQ(shard->query_heads, (IndexRange{q_next, 32 / size}));
      EXPECT_EQ(shard->ffn, (IndexRange{ffn_next, 14336 / size}));
      EXPECT_EQ(shard->QueryRows(128), (IndexRange{q_next * 128, 32 / size * 128}));
      EXPECT_EQ(shard->KvRows(128), (IndexRange{kv_next * 128, 8 / size * 128}));
      EXPECT_EQ(shard->OutputProjectionColumns(128), shard->QueryRows(128));
      EXPECT_EQ(shard->DownColumns(), shard->FfnRows());
      q_next = shard->query_heads.end();
      kv_next = shard->kv_heads.end();
      ffn_next = shard->ffn.end();
      const ModelConfig local = ShardConfig(c, *shard);
      EXPECT_EQ(local.num_query_heads, 32 / size);
      EXPECT_EQ(local.num_kv_heads, 8 / size);
      EXPECT_EQ(local.ffn_size, 14336 / size);
      EXPECT_EQ(local.hidden_size, c.hidden_size);
      EXPECT_EQ(local.vocab_size, c.vocab_size);
      EXPECT_EQ(local.head_dim, c.head_dim);
    }
    EXPECT_EQ(q_next, 32);
    EXPECT_EQ(kv_next, 8);
    EXPECT_EQ(ffn_next, 14336);
  }
}

TEST(TensorParallelTest, QueryHeadsFollowTheirKvHead) {
  // 12 query heads on 4 KV heads (groups of 3), 2 ranks: rank 1 holds KV heads 2, 3 and query
  // heads 6..11, exactly the heads h with h / 3 in {2, 3}.
  const ModelConfig c = Shape(12, 4, 64, 96);
  auto shard = MakeShard(c, 2, 1).value();
  EXPECT_EQ(shard.kv_heads, (IndexRange{2, 2}));
  EXPECT_EQ(shard.query_heads, (IndexRange{6, 6}));
  for (int64_t h = shard.query_heads.begin; h < shard.query_heads.end(); ++h) {
    EXPECT_GE(h / 3, shard.kv_heads.begin);
    EXPECT_LT(h / 3, shard.kv_heads.end());
  }
}

TEST(TensorParallelTest, UnevenFfnGivesTheFirstRanksMore) {
  const ModelConfig c = Shape(8, 4, 64, 10);  // not a multiple of 8: unit by unit
  const IndexRange want[4] = {{0, 3}, {3, 3}, {6, 2}, {8, 2}};
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(MakeShard(c, 4, rank)->ffn, want[rank]);
  const ModelConfig eights = Shape(8, 4, 64, 40);  // five granules of 8 over 4 ranks
  const IndexRange want_eights[4] = {{0, 16}, {16, 8}, {24, 8}, {32, 8}};
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(MakeShard(eights, 4, rank)->ffn, want_eights[rank]);
  }
  const ModelConfig narrow = Shape(8, 8, 64, 16);  // 2 granules cannot feed 8 ranks: units
  for (int rank = 0; rank < 8; ++rank) EXPECT_EQ(MakeShard(narrow, 8, rank)->ffn.count, 2);
}

TEST(TensorParallelTest, RefusesSplitsThatCutAKvHead) {
  const ModelConfig smollm = SyntheticModelConfig("smollm2-135m").value();  // 9 q, 3 KV heads
  EXPECT_TRUE(CheckTensorParallel(smollm, 1).ok());
  EXPECT_TRUE(CheckTensorParallel(smollm, 3).ok());
  const Status two = CheckTensorParallel(smollm, 2);
  EXPECT_EQ(two.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(two.message().find("3 KV heads"), std::string::npos) << two.message();
  EXPECT_EQ(CheckTensorParallel(smollm, 0).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CheckTensorParallel(smollm, -2).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CheckTensorParallel(Shape(8, 8, 64, 4), 8).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(MakeShard(smollm, 3, 3).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(MakeShard(smollm, 3, -1).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(CheckTensorParallel(SyntheticModelConfig("llama3-70b").value(), 8).ok());
}

TEST(TensorParallelTest, ShadowKvRankPerShard) {
  kv::KvPolicyConfig config;
  config.policy = "shadowkv";
  EXPECT_EQ(ShardKvPolicy(config, 2).rank, 0);  // the ratio applies to each rank's width
  config.rank = 160;
  EXPECT_EQ(ShardKvPolicy(config, 1).rank, 160);
  EXPECT_EQ(ShardKvPolicy(config, 2).rank, 80);
  EXPECT_EQ(ShardKvPolicy(config, 4).rank, 40);
  EXPECT_EQ(ShardKvPolicy(config, 8).rank, 24);  // ceil8(20)
}

// y = W·x with W [out, in] row-major.
std::vector<double> MatVec(const std::vector<double>& w, int64_t out, int64_t in,
                           const std::vector<double>& x) {
  std::vector<double> y(out, 0.0);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) y[o] += w[o * in + i] * x[i];
  }
  return y;
}

// The rows [rows.begin, rows.end) and columns [cols.begin, cols.end) of W [out, in].
std::vector<double> Slice(const std::vector<double>& w, int64_t in, IndexRange rows,
                          IndexRange cols) {
  std::vector<double> s;
  for (int64_t r = rows.begin; r < rows.end(); ++r) {
    for (int64_t c = cols.begin; c < cols.end(); ++c) s.push_back(w[r * in + c]);
  }
  return s;
}

// Column-parallel W_gate / W_up, an elementwise activation, row-parallel W_down: the ranks'
// partial outputs sum to the full FFN's (the same holds for W_q·, attention per head, W_o).
TEST(TensorParallelTest, PartialProductsOfTheSlicesSumToTheFullProduct) {
  const ModelConfig c = Shape(8, 4, 4, 13);  // uneven FFN split over 2 ranks too
  const int64_t hidden = c.hidden_size, ffn = c.ffn_size, q_width = 8 * 4;
  std::mt19937 rng(5);
  std::normal_distribution<double> normal;
  auto random = [&](int64_t n) {
    std::vector<double> v(n);
    for (double& x : v) x = normal(rng);
    return v;
  };
  const std::vector<double> w_up = random(ffn * hidden), w_down = random(hidden * ffn);
  const std::vector<double> w_o = random(hidden * q_width);
  const std::vector<double> x = random(hidden), attn = random(q_width);
  auto activation = [](std::vector<double> v) {
    for (double& e : v) e = e > 0 ? e : 0.1 * e;
    return v;
  };
  const std::vector<double> ffn_full =
      MatVec(w_down, hidden, ffn, activation(MatVec(w_up, ffn, hidden, x)));
  const std::vector<double> o_full = MatVec(w_o, hidden, q_width, attn);
  for (int size : {2, 4}) {
    std::vector<double> ffn_sum(hidden, 0.0), o_sum(hidden, 0.0);
    for (int rank = 0; rank < size; ++rank) {
      const TensorParallelShard s = MakeShard(c, size, rank).value();
      const IndexRange all_hidden{0, hidden};
      const std::vector<double> up = Slice(w_up, hidden, s.FfnRows(), all_hidden);
      const std::vector<double> down = Slice(w_down, ffn, all_hidden, s.DownColumns());
      const std::vector<double> part = MatVec(
          down, hidden, s.ffn.count, activation(MatVec(up, s.ffn.count, hidden, x)));
      const IndexRange cols = s.OutputProjectionColumns(c.head_dim);
      const std::vector<double> o = Slice(w_o, q_width, all_hidden, cols);
      const std::vector<double> attn_part(attn.begin() + cols.begin, attn.begin() + cols.end());
      const std::vector<double> o_part = MatVec(o, hidden, cols.count, attn_part);
      for (int64_t i = 0; i < hidden; ++i) {
        ffn_sum[i] += part[i];
        o_sum[i] += o_part[i];
      }
    }
    for (int64_t i = 0; i < hidden; ++i) {
      EXPECT_NEAR(ffn_sum[i], ffn_full[i], 1e-9) << "size " << size << ", row " << i;
      EXPECT_NEAR(o_sum[i], o_full[i], 1e-9) << "size " << size << ", row " << i;
    }
  }
}

}  // namespace
}  // namespace shadowkv
