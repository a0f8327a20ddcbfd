// ModelConfig::FromGguf on hostile metadata: integers out of range in the type they are held in,
// non-finite or out-of-range floats, keys of the wrong type; each refused naming the key.
#include "model/config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "format/gguf_writer.h"

namespace shadowkv {
namespace {

using gguf::MakeFloat;
using gguf::MakeInt;
using gguf::MakeString;
using gguf::MakeUint;
using gguf::Value;
using gguf::ValueType;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Entry {
  std::string key;
  Value value;
};

// A model's metadata (llama unless named; hidden 16, 2 heads of 8, 1 KV head) and its [16, 5]
// embedding; the metadata is what FromGguf reads, the one tensor what it checks the vocabulary
// against.
class ConfigFile {
 public:
  explicit ConfigFile(const std::string& arch = "llama") {
    Set("general.architecture", MakeString(arch));
    Set("general.name", MakeString("config-test"));
    Set(arch + ".block_count", MakeUint(ValueType::kUint32, 3));
    Set(arch + ".embedding_length", MakeUint(ValueType::kUint32, 16));
    Set(arch + ".attention.head_count", MakeUint(ValueType::kUint32, 2));
    Set(arch + ".attention.head_count_kv", MakeUint(ValueType::kUint32, 1));
    Set(arch + ".feed_forward_length", MakeUint(ValueType::kUint32, 48));
    Set(arch + ".context_length", MakeUint(ValueType::kUint32, 4096));
    Set(arch + ".attention.layer_norm_rms_epsilon", MakeFloat(ValueType::kFloat32, 1e-6));
    Set(arch + ".rope.freq_base", MakeFloat(ValueType::kFloat32, 500000.0));
  }

  ConfigFile& Set(const std::string& key, Value value) {
    for (Entry& entry : entries_) {
      if (entry.key == key) {
        entry.value = std::move(value);
        return *this;
      }
    }
    entries_.push_back({key, std::move(value)});
    return *this;
  }
  ConfigFile& Tensor(const std::string& name, std::vector<int64_t> shape,
                     std::vector<float> values) {
    tensors_.push_back({name, std::move(shape), std::move(values)});
    return *this;
  }

  Result<ModelConfig> Parse() const {
    gguf::GgufWriter writer;
    for (const Entry& entry : entries_) EXPECT_TRUE(writer.AddValue(entry.key, entry.value).ok());
    EXPECT_TRUE(writer
                    .AddTensorFromFloats("token_embd.weight", {16, 5}, gguf::GgmlType::kF32,
                                         std::vector<float>(80, 0.5f))
                    .ok());
    for (const PendingTensor& t : tensors_) {
      EXPECT_TRUE(writer.AddTensorFromFloats(t.name, t.shape, gguf::GgmlType::kF32, t.values).ok());
    }
    auto file = gguf::GgufFile::FromBytes(writer.Finish());
    if (!file.ok()) return file.status();
    return ModelConfig::FromGguf(**file);
  }

 private:
  struct PendingTensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> values;
  };
  std::vector<Entry> entries_;
  std::vector<PendingTensor> tensors_;
};

// FromGguf must fail with `code` and a message containing every one of `fragments`.
void ExpectRefused(const ConfigFile& file, ErrorCode code,
                   std::initializer_list<std::string> fragments) {
  Result<ModelConfig> config = file.Parse();
  ASSERT_FALSE(config.ok()) << "accepted: " << config->Summary();
  EXPECT_EQ(config.status().code(), code) << config.status().ToString();
  for (const std::string& fragment : fragments) {
    EXPECT_NE(config.status().message().find(fragment), std::string::npos)
        << "'" << fragment << "' not in: " << config.status().message();
  }
}

TEST(ModelConfigTest, ReadsAValidFile) {
  Result<ModelConfig> config = ConfigFile().Parse();
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->num_layers, 3);
  EXPECT_EQ(config->hidden_size, 16);
  EXPECT_EQ(config->num_query_heads, 2);
  EXPECT_EQ(config->num_kv_heads, 1);
  EXPECT_EQ(config->head_dim, 8);
  EXPECT_EQ(config->ffn_size, 48);
  EXPECT_EQ(config->context_length, 4096);
  EXPECT_EQ(config->vocab_size, 5);
  EXPECT_FLOAT_EQ(config->rms_norm_eps, 1e-6f);
  EXPECT_FLOAT_EQ(config->rope.theta_base, 500000.0f);
  EXPECT_EQ(config->rope.rotary_dim, 8);
}

// The case: 2^31 layers passed a `> 2^31` check and wrapped to INT_MIN in the int.
TEST(ModelConfigTest, RefusesEveryIntegerOutsideItsRangeBeforeNarrowing) {
  const std::vector<std::string> keys = {
      "llama.block_count",          "llama.embedding_length",
      "llama.attention.head_count", "llama.attention.head_count_kv",
      "llama.feed_forward_length",  "llama.context_length",
      "llama.rope.dimension_count", "llama.attention.key_length",
      "llama.vocab_size",           "llama.expert_count"};
  const std::vector<Value> values = {
      MakeUint(ValueType::kUint32, uint64_t{1} << 31),
      MakeUint(ValueType::kUint32, (uint64_t{1} << 32) - 1),
      MakeUint(ValueType::kUint64, uint64_t{1} << 40), MakeInt(ValueType::kInt32, -1),
      MakeInt(ValueType::kInt64, std::numeric_limits<int64_t>::min())};
  for (const std::string& key : keys) {
    for (const Value& value : values) {
      SCOPED_TRACE(key);
      ExpectRefused(ConfigFile().Set(key, value), ErrorCode::kCorrupt,
                    {"'" + key + "'", "outside the supported range"});
    }
  }
  ExpectRefused(ConfigFile().Set("llama.block_count", MakeUint(ValueType::kUint32, 0)),
                ErrorCode::kCorrupt, {"'llama.block_count' = 0 is outside"});
  ExpectRefused(
      ConfigFile().Set("llama.block_count", MakeUint(ValueType::kUint64, uint64_t{1} << 63)),
      ErrorCode::kOutOfRange, {"'llama.block_count'", "does not fit in int64"});
  // More KV heads than query heads, and the upper bound itself.
  ExpectRefused(ConfigFile().Set("llama.attention.head_count_kv", MakeUint(ValueType::kUint32, 3)),
                ErrorCode::kCorrupt, {"'llama.attention.head_count_kv' = 3", "[1, 2]"});
  ExpectRefused(ConfigFile().Set("llama.block_count", MakeUint(ValueType::kUint32, kMaxLayers + 1)),
                ErrorCode::kCorrupt, {"'llama.block_count'"});
  EXPECT_TRUE(
      ConfigFile().Set("llama.block_count", MakeUint(ValueType::kUint32, kMaxLayers)).Parse().ok());
}

TEST(ModelConfigTest, RefusesNonFiniteAndOutOfRangeFloats) {
  const std::string eps = "llama.attention.layer_norm_rms_epsilon";
  const std::string base = "llama.rope.freq_base";
  for (double bad : {kNaN, kInf, -kInf}) {
    for (ValueType type : {ValueType::kFloat32, ValueType::kFloat64}) {
      ExpectRefused(ConfigFile().Set(eps, MakeFloat(type, bad)), ErrorCode::kCorrupt,
                    {"'" + eps + "'", "not a finite number"});
      ExpectRefused(ConfigFile().Set(base, MakeFloat(type, bad)), ErrorCode::kCorrupt,
                    {"'" + base + "'", "not a finite number"});
      // Keys the engine does not read are still part of the model.
      ExpectRefused(ConfigFile().Set("llama.attention.scale", MakeFloat(type, bad)),
                    ErrorCode::kCorrupt, {"'llama.attention.scale'", "not a finite number"});
    }
  }
  for (double bad : {-1e-5, 0.0, 2.0, 1e-40}) {
    ExpectRefused(ConfigFile().Set(eps, MakeFloat(ValueType::kFloat64, bad)), ErrorCode::kCorrupt,
                  {"'" + eps + "'", "outside the supported range"});
  }
  for (double bad : {-10000.0, 0.0, 0.5, 1e300}) {
    ExpectRefused(ConfigFile().Set(base, MakeFloat(ValueType::kFloat64, bad)), ErrorCode::kCorrupt,
                  {"'" + base + "'", "outside the supported range"});
  }
  ExpectRefused(ConfigFile().Set(base, MakeFloat(ValueType::kFloat32, 1.0)), ErrorCode::kCorrupt,
                {"freq_base", "must exceed 1"});
  ExpectRefused(ConfigFile().Set(
                    "llama.rope.scaling_factors",
                    gguf::MakeArray(ValueType::kFloat32, {MakeFloat(ValueType::kFloat32, 1.0),
                                                          MakeFloat(ValueType::kFloat32, kNaN)})),
                ErrorCode::kCorrupt,
                {"'llama.rope.scaling_factors' element [1]", "not a finite number"});

  const std::string factor = "llama.rope.scaling.factor";
  for (double bad : {kNaN, 0.5, -2.0, 1e9}) {
    ExpectRefused(ConfigFile()
                      .Set("llama.rope.scaling.type", MakeString("linear"))
                      .Set(factor, MakeFloat(ValueType::kFloat32, bad)),
                  ErrorCode::kCorrupt, {"'" + factor + "'"});
  }
  Result<ModelConfig> scaled = ConfigFile()
                                   .Set("llama.rope.scaling.type", MakeString("linear"))
                                   .Set(factor, MakeFloat(ValueType::kFloat32, 4.0))
                                   .Parse();
  ASSERT_TRUE(scaled.ok()) << scaled.status().ToString();
  EXPECT_EQ(scaled->rope.linear_scale, 4.0f);
}

TEST(ModelConfigTest, RefusesBadRopeFrequencyFactors) {
  for (float bad : {std::nanf(""), 0.0f, -1.0f, std::numeric_limits<float>::infinity(), 1e-30f}) {
    ExpectRefused(ConfigFile().Tensor("rope_freqs.weight", {4}, {1.0f, 2.0f, bad, 4.0f}),
                  ErrorCode::kCorrupt, {"'rope_freqs.weight' element [2]"});
  }
  Result<ModelConfig> config =
      ConfigFile().Tensor("rope_freqs.weight", {4}, {1.0f, 2.0f, 3.0f, 4.0f}).Parse();
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->rope.freq_factors, (std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}));
}

TEST(ModelConfigTest, RefusesOptionalKeysOfTheWrongType) {
  // These were skipped when not of the expected type, so a broken file loaded with defaults.
  ExpectRefused(ConfigFile().Set("llama.vocab_size", MakeString("5")), ErrorCode::kCorrupt,
                {"'llama.vocab_size'", "expected an integer"});
  ExpectRefused(ConfigFile().Set("llama.rope.scaling.type", MakeUint(ValueType::kUint32, 1)),
                ErrorCode::kCorrupt, {"'llama.rope.scaling.type'", "expected a string"});
  ExpectRefused(ConfigFile().Set("general.name", MakeUint(ValueType::kUint32, 1)),
                ErrorCode::kCorrupt, {"'general.name'", "expected a string"});
  ExpectRefused(ConfigFile().Set("llama.attention.head_count_kv", MakeString("1")),
                ErrorCode::kCorrupt, {"'llama.attention.head_count_kv'", "expected an integer"});
}

TEST(ModelConfigTest, RefusesInconsistentShapes) {
  ExpectRefused(ConfigFile().Set("llama.expert_count", MakeUint(ValueType::kUint32, 8)),
                ErrorCode::kUnsupported, {"mixture-of-experts", "= 8"});
  EXPECT_TRUE(ConfigFile().Set("llama.expert_count", MakeUint(ValueType::kUint32, 0)).Parse().ok());
  ExpectRefused(ConfigFile().Set("llama.attention.head_count", MakeUint(ValueType::kUint32, 3)),
                ErrorCode::kCorrupt, {"not a multiple of 3 heads"});
  ExpectRefused(ConfigFile().Set("llama.rope.dimension_count", MakeUint(ValueType::kUint32, 3)),
                ErrorCode::kCorrupt, {"rope dimension count 3"});
  ExpectRefused(ConfigFile().Set("llama.attention.value_length", MakeUint(ValueType::kUint32, 4)),
                ErrorCode::kUnsupported, {"'llama.attention.value_length' = 4 differs"});
  ExpectRefused(ConfigFile().Set("llama.vocab_size", MakeUint(ValueType::kUint32, 6)),
                ErrorCode::kCorrupt, {"vocab_size 6 differs from token_embd rows 5"});
}

TEST(ModelConfigTest, RefusesAnUnknownArchitectureNamingTheSupportedOnes) {
  ExpectRefused(ConfigFile("mamba"), ErrorCode::kUnsupported,
                {"architecture 'mamba' is not supported", "llama", "qwen2", "qwen3", "gemma3",
                 "phi3", "glm4", "chatglm"});
}

gguf::Value BoolArray(std::vector<bool> flags) {
  gguf::Value array;
  array.type = ValueType::kArray;
  array.element_type = ValueType::kBool;
  std::vector<gguf::Value> elements;
  for (bool flag : flags) {
    gguf::Value element;
    element.type = ValueType::kBool;
    element.data = flag;
    elements.push_back(element);
  }
  array.data = std::move(elements);
  return array;
}

TEST(ModelConfigTest, ReadsQwen3AndGemma3HeadWidthsAndFeatures) {
  Result<ModelConfig> qwen3 =
      ConfigFile("qwen3")
          .Set("qwen3.attention.key_length", MakeUint(ValueType::kUint32, 32))
          .Set("qwen3.attention.value_length", MakeUint(ValueType::kUint32, 32))
          .Parse();
  ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
  EXPECT_EQ(qwen3->head_dim, 32);  // not hidden / heads = 8
  EXPECT_TRUE(qwen3->qk_norm);
  EXPECT_FALSE(qwen3->post_norms);
  EXPECT_EQ(qwen3->rope.style, RopeConfig::Style::kHalves);
  EXPECT_TRUE(qwen3->layer_windowed.empty());
  // A llama file still needs key_length = hidden / heads.
  ExpectRefused(ConfigFile().Set("llama.attention.key_length", MakeUint(ValueType::kUint32, 32)),
                ErrorCode::kUnsupported, {"'llama.attention.key_length' = 32 differs"});

  ConfigFile gemma("gemma3");
  gemma.Set("gemma3.attention.sliding_window", MakeUint(ValueType::kUint32, 512));
  Result<ModelConfig> gemma3 = gemma.Parse();
  ASSERT_TRUE(gemma3.ok()) << gemma3.status().ToString();
  EXPECT_TRUE(gemma3->qk_norm && gemma3->post_norms);
  EXPECT_EQ(gemma3->activation, FfnActivation::kGeluTanh);
  EXPECT_FLOAT_EQ(gemma3->embedding_scale, 4.0f);
  EXPECT_EQ(gemma3->sliding_window, 512);
  EXPECT_EQ(gemma3->layer_windowed, (std::vector<bool>{true, true, true}));  // period 6
  EXPECT_FLOAT_EQ(gemma3->rope_windowed.theta_base, 10000.0f);
  EXPECT_FLOAT_EQ(gemma3->rope.theta_base, 500000.0f);
  EXPECT_FLOAT_EQ(gemma3->final_logit_softcap, 0.0f);
  ExpectRefused(ConfigFile("gemma3"), ErrorCode::kNotFound,
                {"'gemma3.attention.sliding_window' is missing"});
}

TEST(ModelConfigTest, ReadsTheSlidingWindowPattern) {
  ConfigFile gemma("gemma3");
  gemma.Set("gemma3.attention.sliding_window", MakeUint(ValueType::kUint32, 8))
      .Set("gemma3.attention.sliding_window_pattern", BoolArray({false, true, false}))
      .Set("gemma3.rope.freq_base_swa", MakeFloat(ValueType::kFloat32, 20000.0))
      .Set("gemma3.final_logit_softcapping", MakeFloat(ValueType::kFloat32, 30.0));
  Result<ModelConfig> config = gemma.Parse();
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->layer_windowed, (std::vector<bool>{false, true, false}));
  EXPECT_FALSE(config->IsWindowed(0));
  EXPECT_TRUE(config->IsWindowed(1));
  EXPECT_FLOAT_EQ(config->RopeOf(1).theta_base, 20000.0f);
  EXPECT_FLOAT_EQ(config->RopeOf(0).theta_base, 500000.0f);
  EXPECT_FLOAT_EQ(config->final_logit_softcap, 30.0f);

  gemma.Set("gemma3.attention.sliding_window_pattern", MakeUint(ValueType::kUint32, 2));
  config = gemma.Parse();
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->layer_windowed, (std::vector<bool>{true, false, true}));

  ExpectRefused(
      ConfigFile(gemma).Set("gemma3.attention.sliding_window_pattern", BoolArray({true, false})),
      ErrorCode::kCorrupt, {"'gemma3.attention.sliding_window_pattern'", "3 layers"});
  ExpectRefused(
      ConfigFile(gemma).Set("gemma3.attention.sliding_window", MakeUint(ValueType::kUint32, 0)),
      ErrorCode::kCorrupt, {"'gemma3.attention.sliding_window' = 0"});

  // Mistral-style: a llama file with a window slides in every layer; qwen files ignore theirs.
  Result<ModelConfig> mistral =
      ConfigFile().Set("llama.attention.sliding_window", MakeUint(ValueType::kUint32, 4)).Parse();
  ASSERT_TRUE(mistral.ok()) << mistral.status().ToString();
  EXPECT_EQ(mistral->layer_windowed, (std::vector<bool>{true, true, true}));
  EXPECT_EQ(mistral->sliding_window, 4);
  Result<ModelConfig> qwen2 =
      ConfigFile("qwen2")
          .Set("qwen2.attention.sliding_window", MakeUint(ValueType::kUint32, 4))
          .Parse();
  ASSERT_TRUE(qwen2.ok()) << qwen2.status().ToString();
  EXPECT_TRUE(qwen2->layer_windowed.empty());
}

// LongRoPE: the long factors once the model's context passes the pretraining length, the short
// ones within it; the attention factor scales q·k by its square.
TEST(ModelConfigTest, ChoosesLongRopeFactorsByTheContext) {
  const std::vector<float> long_factors = {1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<float> short_factors = {1.0f, 1.5f, 1.5f, 1.5f};
  ConfigFile phi3("phi3");
  phi3.Set("phi3.rope.scaling.original_context_length", MakeUint(ValueType::kUint32, 1024))
      .Set("phi3.rope.scaling.attn_factor", MakeFloat(ValueType::kFloat32, 1.5))
      .Tensor("rope_factors_long.weight", {4}, long_factors)
      .Tensor("rope_factors_short.weight", {4}, short_factors);
  Result<ModelConfig> config = phi3.Parse();  // context 4096 > 1024
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->rope.freq_factors, long_factors);
  EXPECT_EQ(config->rope.style, RopeConfig::Style::kHalves);
  EXPECT_FLOAT_EQ(config->attention_scale, 1.5f * 1.5f / std::sqrt(8.0f));

  // Within the pretraining length; without attn_factor it is sqrt(1 + ln(s) / ln(original)).
  ConfigFile within(phi3);
  within.Set("phi3.rope.scaling.original_context_length", MakeUint(ValueType::kUint32, 4096));
  config = within.Parse();
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->rope.freq_factors, short_factors);
  ConfigFile computed("phi3");
  computed.Set("phi3.rope.scaling.original_context_length", MakeUint(ValueType::kUint32, 1024))
      .Tensor("rope_factors_long.weight", {4}, long_factors)
      .Tensor("rope_factors_short.weight", {4}, short_factors);
  config = computed.Parse();
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const double factor = std::sqrt(1.0 + std::log(4.0) / std::log(1024.0));
  EXPECT_NEAR(config->attention_scale, factor * factor / std::sqrt(8.0), 1e-6);

  ExpectRefused(
      ConfigFile("phi3")
          .Set("phi3.rope.scaling.original_context_length", MakeUint(ValueType::kUint32, 1024))
          .Tensor("rope_factors_long.weight", {4}, long_factors),
      ErrorCode::kCorrupt, {"rope_factors_long and rope_factors_short"});
  ExpectRefused(ConfigFile("phi3")
                    .Tensor("rope_factors_long.weight", {4}, long_factors)
                    .Tensor("rope_factors_short.weight", {4}, short_factors),
                ErrorCode::kNotFound, {"phi3.rope.scaling.original_context_length"});
  ExpectRefused(
      ConfigFile("phi3")
          .Set("phi3.rope.scaling.original_context_length", MakeUint(ValueType::kUint32, 1024))
          .Tensor("rope_factors_long.weight", {3}, {1.0f, 1.0f, 1.0f})
          .Tensor("rope_factors_short.weight", {4}, short_factors),
      ErrorCode::kCorrupt, {"'rope_factors_long.weight' must be F32 [4]"});
}

}  // namespace
}  // namespace shadowkv
