// The GGUF reader on the real SmolLM2-135M file: header facts, metadata, tensor table, and
// dequantised rows against values the gguf Python package read from the same file.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "format/gguf.h"
#include "format/quants.h"
#include "model_path.h"

namespace shadowkv::gguf {
namespace {

class SmolLm2GgufTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::ifstream in(testing::DataPath("goldens/dequant_smollm2.json"));
    ASSERT_TRUE(in.good()) << "missing tests/data/goldens/dequant_smollm2.json";
    golden_ = new nlohmann::json(nlohmann::json::parse(in));
    Result<std::unique_ptr<GgufFile>> file = GgufFile::Open(testing::DefaultModelPath());
    if (file.ok()) file_ = std::move(file).value().release();
  }
  static void TearDownTestSuite() {
    delete file_;
    delete golden_;
    file_ = nullptr;
    golden_ = nullptr;
  }
  void SetUp() override {
    if (file_ == nullptr) GTEST_SKIP() << "no model at " << testing::DefaultModelPath();
    if (file_->file_size() != (*golden_)["file_size"].get<size_t>()) {
      GTEST_SKIP() << testing::DefaultModelPath() << " is not the SmolLM2-135M Q4_1 file";
    }
  }

  static GgufFile* file_;
  static nlohmann::json* golden_;
};

GgufFile* SmolLm2GgufTest::file_ = nullptr;
nlohmann::json* SmolLm2GgufTest::golden_ = nullptr;

TEST_F(SmolLm2GgufTest, HeaderAndMetadata) {
  const GgufFile& file = *file_;
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.alignment(), 32u);
  EXPECT_EQ(file.tensors().size(), 272u);
  EXPECT_EQ(file.metadata().size(), 33u);
  EXPECT_EQ(file.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(file.GetInt("llama.block_count").value(), 30);
  EXPECT_EQ(file.GetInt("llama.context_length").value(), 8192);
  EXPECT_EQ(file.GetInt("llama.embedding_length").value(), 576);
  EXPECT_EQ(file.GetInt("llama.feed_forward_length").value(), 1536);
  EXPECT_EQ(file.GetInt("llama.attention.head_count").value(), 9);
  EXPECT_EQ(file.GetInt("llama.attention.head_count_kv").value(), 3);
  EXPECT_EQ(file.GetFloat("llama.rope.freq_base").value(), 100000.0);
  EXPECT_EQ(static_cast<float>(file.GetFloat("llama.attention.layer_norm_rms_epsilon").value()),
            1e-5f);
  EXPECT_FALSE(file.GetBool("tokenizer.ggml.add_bos_token").value());
  EXPECT_EQ(file.GetInt("tokenizer.ggml.bos_token_id").value(), 1);
  EXPECT_EQ(file.GetInt("tokenizer.ggml.eos_token_id").value(), 2);

  const std::vector<std::string> tokens = file.GetStringArray("tokenizer.ggml.tokens").value();
  ASSERT_EQ(tokens.size(), 49152u);
  EXPECT_EQ(tokens[0], "<|endoftext|>");
  EXPECT_EQ(tokens[1], "<|im_start|>");
  EXPECT_EQ(tokens[2], "<|im_end|>");
  const std::vector<int64_t> token_types = file.GetIntArray("tokenizer.ggml.token_type").value();
  ASSERT_EQ(token_types.size(), 49152u);
  EXPECT_EQ(token_types[0], 3);
  const std::vector<std::string> merges = file.GetStringArray("tokenizer.ggml.merges").value();
  ASSERT_EQ(merges.size(), 48900u);
  EXPECT_EQ(merges[0], "\xc4\xa0 t");  // "Ġ t"
  EXPECT_EQ(
      file.GetString("tokenizer.chat_template").value().rfind("{% for message in messages %}", 0),
      0u);
}

TEST_F(SmolLm2GgufTest, TensorTable) {
  const GgufFile& file = *file_;
  struct Expected {
    const char* name;
    std::vector<int64_t> shape;
    GgmlType type;
  };
  const Expected expected[] = {
      {"token_embd.weight", {576, 49152}, GgmlType::kQ8_0},
      {"blk.0.attn_norm.weight", {576}, GgmlType::kF32},
      {"blk.0.attn_q.weight", {576, 576}, GgmlType::kQ4_1},
      {"blk.0.attn_k.weight", {576, 192}, GgmlType::kQ4_1},
      {"blk.0.attn_v.weight", {576, 192}, GgmlType::kQ4_1},
      {"blk.29.ffn_down.weight", {1536, 576}, GgmlType::kQ4_1},
      {"blk.29.ffn_gate.weight", {576, 1536}, GgmlType::kQ4_1},
      {"output_norm.weight", {576}, GgmlType::kF32},
  };
  for (const Expected& want : expected) {
    SCOPED_TRACE(want.name);
    const TensorInfo* tensor = file.FindTensor(want.name);
    ASSERT_NE(tensor, nullptr);
    EXPECT_EQ(tensor->shape, want.shape);
    EXPECT_EQ(tensor->type, want.type);
  }
  EXPECT_EQ(file.FindTensor("output.weight"), nullptr);  // tied to token_embd
  const TensorInfo& embedding = *file.FindTensor("token_embd.weight");
  EXPECT_EQ(embedding.row_bytes(), 576u / 32 * 34);
  EXPECT_EQ(embedding.size_bytes, 49152u * 612);
  EXPECT_EQ(file.FindTensor("blk.0.attn_q.weight")->size_bytes, 576u * 576 / 32 * 20);
  for (const TensorInfo& tensor : file.tensors()) {
    EXPECT_EQ((tensor.data - file.tensors()[0].data + file.data_offset()) % 32, 0u) << tensor.name;
  }
}

TEST_F(SmolLm2GgufTest, DequantisedRowsMatchTheReference) {
  const auto& tensors = (*golden_)["tensors"];
  ASSERT_EQ(tensors.size(), 4u);
  for (const auto& entry : tensors) {
    const std::string name = entry["name"];
    SCOPED_TRACE(name);
    const TensorInfo* tensor = file_->FindTensor(name);
    ASSERT_NE(tensor, nullptr);
    EXPECT_STREQ(TypeName(tensor->type), entry["type"].get<std::string>().c_str());
    std::vector<float> row(static_cast<size_t>(tensor->row_length()));
    for (const auto& [row_text, values] : entry["rows"].items()) {
      const int64_t row_index = std::stoll(row_text);
      ASSERT_TRUE(DequantizeRows(*tensor, row_index, 1, row.data()).ok());
      ASSERT_LE(values.size(), row.size());
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(row[i], values[i].get<float>()) << "row " << row_index << " element " << i;
      }
    }
  }
  // The whole-tensor path agrees with the row path.
  const TensorInfo& q = *file_->FindTensor("blk.0.attn_q.weight");
  const std::vector<float> all = DequantizeTensor(q).value();
  const nlohmann::json* golden_q = nullptr;
  for (const auto& entry : tensors) {
    if (entry["name"] == "blk.0.attn_q.weight") golden_q = &entry;
  }
  ASSERT_NE(golden_q, nullptr);
  const auto& last_row = (*golden_q)["rows"]["575"];
  ASSERT_FALSE(last_row.empty());
  for (size_t i = 0; i < last_row.size(); ++i) {
    ASSERT_EQ(all[575 * 576 + i], last_row[i].get<float>()) << i;
  }
}

}  // namespace
}  // namespace shadowkv::gguf
