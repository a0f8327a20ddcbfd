// The server's GPU model made without weights (CudaServingModel::CreateSynthetic) and pools sized
// from the device memory left after the model (sequences = 0), with the batch following them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "format/chat_template.h"
#include "gpu/serving/cuda_serving_model.h"
#include "gpu/serving/pool_memory.h"
#include "gpu/tp/cuda_model_group.h"
#include "gpu_test_util.h"
#include "model/synthetic.h"
#include "ops/cuda/common/cuda_backend.h"

namespace shadowkv::cuda {
namespace {

ModelConfig SmallShapes() { return SyntheticModelConfig("smollm2-135m").value(); }

CudaServingOptions PoolOptions(const std::string& policy, int sequences, int64_t context) {
  CudaServingOptions o;
  o.kv.policy = policy;
  if (policy != "full") o.kv.budget_tokens = 256;
  o.max_batch = 0;  // the pool's size
  o.prefill_chunk = 256;
  o.sequences = sequences;
  o.context = context;
  return o;
}

// Pure arithmetic: runs without a GPU.
TEST(CudaServingPoolTest, LeastSequenceBytesIsEachGpusShare) {
  const ModelConfig c = SyntheticModelConfig("llama3-8b").value();
  const int64_t context = 124928;
  const int64_t whole = int64_t{2} * c.num_layers * c.num_kv_heads * c.head_dim * 2 * context;
  EXPECT_EQ(LeastSequenceBytes(c, context, nullptr, false, {}).value(), whole);
  EXPECT_EQ(LeastSequenceBytes(c, context, nullptr, false, {2, false}).value(), whole / 2);
  EXPECT_EQ(LeastSequenceBytes(c, context, nullptr, false, {2, true}).value(), whole);
  kv::KvPolicyConfig skv;
  skv.policy = "shadowkv";
  skv.budget_tokens = 2048;
  const int64_t with_values = LeastSequenceBytes(c, context, &skv, false, {}).value();
  const int64_t without = LeastSequenceBytes(c, context, &skv, true, {}).value();
  // The values are half the full cache; the rest (landmarks, factors, gathered rows) far less.
  EXPECT_LT(without, with_values);
  EXPECT_EQ(with_values - without, whole / 2);
  EXPECT_LT(with_values, whole);
  EXPECT_EQ(LeastSequenceBytes(c, 0, nullptr, false, {}).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(LeastSequenceBytes(c, context, nullptr, false, {3, false}).status().code(),
            ErrorCode::kInvalidArgument);
}

TEST(CudaServingPoolTest, SyntheticModelServesItsVocabularyAndSaysSo) {
  SKV_SKIP_WITHOUT_GPU();
  auto model = CudaServingModel::CreateSynthetic(SmallShapes(), PoolOptions("full", 3, 2048));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  CudaServingModel& m = **model;
  EXPECT_TRUE(m.synthetic());
  EXPECT_EQ(m.tokenizer().vocab_size(), m.config().vocab_size);
  EXPECT_EQ(m.sequences(), 3);
  EXPECT_EQ(m.max_batch(), 3);  // the batch follows the pool
  auto chat = DetectChatTemplate(m.file());
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();
  EXPECT_EQ(chat->format, ChatFormat::kChatML);

  auto policy = m.MakePolicy(PoolOptions("full", 3, 2048).kv);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  auto sequence = (*policy)->NewSequence();
  ASSERT_TRUE(sequence.ok());
  const std::vector<int32_t> prompt = m.tokenizer().Encode("random words", false, false);
  // NaN first: every entry must be written.
  std::vector<float> logits(m.config().vocab_size, std::nanf(""));
  engine::StepRow in;
  in.kv = sequence->get();
  in.tokens = prompt;
  in.finish_prefill = true;
  in.logits_out = logits.data();
  const SamplingParams greedy;
  in.sampling = &greedy;
  int32_t next = -1;
  ASSERT_TRUE(m.Step(std::span<const engine::StepRow>(&in, 1), std::span<int32_t>(&next, 1)).ok());
  for (float value : logits) ASSERT_TRUE(std::isfinite(value));
  // The token drawn on the device is the argmax of the logits that came back.
  EXPECT_EQ(next, std::max_element(logits.begin(), logits.end()) - logits.begin());
}

TEST(CudaServingPoolTest, SyntheticContextMayPassTheNamedModels) {
  SKV_SKIP_WITHOUT_GPU();
  const ModelConfig shapes = SmallShapes();
  const int64_t context = 2 * shapes.context_length;
  auto model = CudaServingModel::CreateSynthetic(shapes, PoolOptions("full", 1, context));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->config().context_length, context);
}

TEST(CudaServingPoolTest, FullAttentionPoolFillsTheFreeMemory) {
  SKV_SKIP_WITHOUT_GPU();
  const int64_t context = 8192;
  auto model = CudaServingModel::CreateSynthetic(SmallShapes(), PoolOptions("full", 0, context));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  CudaServingModel& m = **model;
  ASSERT_GE(m.sequences(), 1);
  EXPECT_EQ(m.max_batch(), std::min(m.sequences(), kMaxStepBatch));
  EXPECT_LE(m.max_batch(), m.group().options().max_batch);  // the step buffers hold the batch
  EXPECT_NE(m.Describe().find("bounded by device memory"), std::string::npos) << m.Describe();
  // One more slot would not have fitted beside the reserve.
  const DeviceInfo device = QueryDevice().value();
  EXPECT_LT(device.free_bytes, kPoolReserveBytes + m.group().KvBytesPerToken() * context);
}

TEST(CudaServingPoolTest, ShadowKvPoolKeepsTwoPromptSlotsAndCompressedSequences) {
  SKV_SKIP_WITHOUT_GPU();
  auto model = CudaServingModel::CreateSynthetic(SmallShapes(), PoolOptions("shadowkv", 0, 8192));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  CudaServingModel& m = **model;
  ASSERT_GE(m.sequences(), kDefaultPrefillSlots);
  EXPECT_NE(m.Describe().find("2 full-cache slots"), std::string::npos) << m.Describe();
  EXPECT_EQ(m.max_batch(), std::min(m.sequences(), kMaxStepBatch));
}

TEST(CudaServingPoolTest, AnExplicitBatchStandsBesideAPoolFromMemory) {
  SKV_SKIP_WITHOUT_GPU();
  CudaServingOptions o = PoolOptions("full", 0, 8192);
  o.max_batch = 5;
  auto model = CudaServingModel::CreateSynthetic(SmallShapes(), o);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->max_batch(), 5);
  EXPECT_EQ((*model)->group().options().max_batch, 5);
  EXPECT_GT((*model)->sequences(), 5);
}

}  // namespace
}  // namespace shadowkv::cuda
