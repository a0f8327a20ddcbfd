// Dequantisation, quantisers and fp16/bf16 conversion against the gguf Python package's values.
#include "format/quants.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/half.h"

namespace shadowkv::gguf {
namespace {

// Produced by scripts/goldens/dequant_goldens.py.
const std::string kGoldenDir = std::string(SHADOWKV_SOURCE_DIR) + "/tests/data/goldens/";

std::vector<uint8_t> ReadBytes(const std::string& name) {
  std::ifstream in(kGoldenDir + name, std::ios::binary);
  EXPECT_TRUE(in.good()) << "missing golden " << kGoldenDir + name;
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

nlohmann::json Manifest() {
  std::ifstream in(kGoldenDir + "dequant_goldens.json");
  EXPECT_TRUE(in.good()) << "missing dequant_goldens.json";
  return nlohmann::json::parse(in);
}

template <typename T>
std::vector<T> ReadArray(const std::vector<uint8_t>& bytes, size_t byte_offset, size_t count) {
  std::vector<T> values(count);
  EXPECT_LE(byte_offset + count * sizeof(T), bytes.size());
  if (byte_offset + count * sizeof(T) <= bytes.size()) {
    std::memcpy(values.data(), bytes.data() + byte_offset, count * sizeof(T));
  }
  return values;
}

TEST(DequantizeTest, MatchesReferenceBitForBit) {
  const nlohmann::json manifest = Manifest();
  ASSERT_GE(manifest["dequantize"].size(), 12u);
  for (const auto& entry : manifest["dequantize"]) {
    const std::string type_name = entry["type"];
    SCOPED_TRACE(type_name);
    const auto type = static_cast<GgmlType>(entry["type_id"].get<uint32_t>());
    ASSERT_STREQ(TypeName(type), type_name.c_str());
    const std::vector<uint8_t> bytes = ReadBytes(entry["file"]);
    const size_t raw_bytes = entry["raw_bytes"];
    const size_t num_elements = entry["num_elements"];
    ASSERT_EQ(bytes.size(), raw_bytes + 4 * num_elements);
    const std::vector<uint32_t> expected = ReadArray<uint32_t>(bytes, raw_bytes, num_elements);

    // Offset the source by one byte: blocks in a mapped file need not be aligned.
    std::vector<uint8_t> unaligned(raw_bytes + 1);
    std::memcpy(unaligned.data() + 1, bytes.data(), raw_bytes);
    std::vector<float> actual(num_elements, -1.0f);
    ASSERT_TRUE(
        DequantizeRow(type, unaligned.data() + 1, actual.data(), static_cast<int64_t>(num_elements))
            .ok());
    int mismatches = 0;
    for (size_t i = 0; i < num_elements && mismatches < 5; ++i) {
      if (FloatBits(actual[i]) != expected[i]) {
        ++mismatches;
        ADD_FAILURE() << type_name << " element " << i << ": got " << actual[i] << " expected "
                      << FloatFromBits(expected[i]);
      }
    }
  }
}

TEST(DequantizeTest, HandBuiltQ4_1Block) {
  // d = 0.5, m = -4: x[i] = 0.5 * q[i] - 4, with q[i] = i and q[16 + i] = 15 - i.
  BlockQ4_1 block{};
  block.d = 0x3800;  // 0.5
  block.m = 0xc400;  // -4.0
  for (int i = 0; i < 16; ++i) block.qs[i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  float values[32];
  ASSERT_TRUE(
      DequantizeRow(GgmlType::kQ4_1, reinterpret_cast<const uint8_t*>(&block), values, 32).ok());
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(values[i], 0.5f * i - 4.0f) << i;
    EXPECT_EQ(values[16 + i], 0.5f * (15 - i) - 4.0f) << i;
  }
}

TEST(DequantizeTest, HandBuiltQ8_0Block) {
  BlockQ8_0 block{};
  block.d = 0xb400;  // -0.25
  for (int i = 0; i < 32; ++i) block.qs[i] = static_cast<int8_t>(i * 8 - 128);
  float values[32];
  ASSERT_TRUE(
      DequantizeRow(GgmlType::kQ8_0, reinterpret_cast<const uint8_t*>(&block), values, 32).ok());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(values[i], -0.25f * (i * 8 - 128)) << i;
}

TEST(DequantizeTest, RejectsUnsupportedTypesAndPartialBlocks) {
  uint8_t raw[512] = {};
  float out[256];
  Status status = DequantizeRow(GgmlType::kIQ2_XXS, raw, out, 256);
  EXPECT_EQ(status.code(), ErrorCode::kUnsupported);
  EXPECT_NE(status.message().find("IQ2_XXS"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("Q4_1"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("Q6_K"), std::string::npos) << status.message();
  EXPECT_FALSE(CanDequantize(GgmlType::kQ8_K));
  EXPECT_TRUE(CanDequantize(GgmlType::kQ5_K));

  status = DequantizeRow(GgmlType::kQ4_0, raw, out, 48);
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(status.message().find("not a multiple of the Q4_0 block size 32"), std::string::npos)
      << status.message();
}

// A tensor over bytes held by the test: `bytes` must outlive it.
TensorInfo HostTensor(std::string name, std::vector<int64_t> shape, GgmlType type,
                      const void* bytes, size_t size) {
  TensorInfo tensor;
  tensor.name = std::move(name);
  tensor.shape = std::move(shape);
  tensor.type = type;
  tensor.num_elements = 1;
  for (int64_t extent : tensor.shape) tensor.num_elements *= extent;
  tensor.size_bytes = size;
  tensor.data = static_cast<const uint8_t*>(bytes);
  return tensor;
}

TEST(DequantizeTest, RowsOfATensor) {
  // A 3-row F16 tensor of length 4 pointing at a local buffer.
  const uint16_t halves[12] = {0x3c00, 0x4000, 0x4200, 0x4400,   // 1 2 3 4
                               0xbc00, 0xc000, 0xc200, 0xc400,   // -1 -2 -3 -4
                               0x3800, 0x3400, 0x0000, 0x8000};  // 0.5 0.25 0 -0
  const TensorInfo tensor = HostTensor("t", {4, 3}, GgmlType::kF16, halves, sizeof(halves));
  EXPECT_EQ(tensor.rows(), 3);
  EXPECT_EQ(tensor.row_length(), 4);
  EXPECT_EQ(tensor.row_bytes(), 8u);

  float rows[8];
  ASSERT_TRUE(DequantizeRows(tensor, 1, 2, rows).ok());
  const float expected[8] = {-1, -2, -3, -4, 0.5f, 0.25f, 0.0f, -0.0f};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(FloatBits(rows[i]), FloatBits(expected[i])) << i;

  const Status status = DequantizeRows(tensor, 2, 2, rows);
  EXPECT_EQ(status.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(status.message().find("tensor 't'"), std::string::npos) << status.message();

  Result<std::vector<float>> all = DequantizeTensor(tensor);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), 12u);
  EXPECT_EQ((*all)[3], 4.0f);
  EXPECT_EQ((*all)[9], 0.25f);
}

// A NaN or infinite weight makes every output it reaches NaN; decoding for a load refuses it.
TEST(DequantizeTest, RefusesNonFiniteValuesNamingWhere) {
  uint16_t halves[12] = {0x3c00, 0x4000, 0x4200, 0x4400, 0xbc00, 0xc000,
                         0xc200, 0xc400, 0x3800, 0x3400, 0x0000, 0x8000};
  const TensorInfo tensor =
      HostTensor("blk.3.ffn_norm.weight", {4, 3}, GgmlType::kF16, halves, sizeof(halves));
  EXPECT_TRUE(CheckTensorFinite(tensor).ok());
  for (uint16_t bad : {uint16_t{0x7e00}, uint16_t{0x7c00}, uint16_t{0xfc00}}) {  // NaN, +inf, -inf
    halves[6] = bad;
    float rows[12];
    for (const Status& status : {DequantizeRows(tensor, 0, 3, rows),
                                 DequantizeTensor(tensor).status(), CheckTensorFinite(tensor)}) {
      EXPECT_EQ(status.code(), ErrorCode::kCorrupt);
      EXPECT_NE(status.message().find("tensor 'blk.3.ffn_norm.weight' holds a non-finite weight"),
                std::string::npos)
          << status.message();
      EXPECT_NE(status.message().find("at row 1, column 2"), std::string::npos) << status.message();
    }
    // Rows that do not hold it still decode.
    EXPECT_TRUE(DequantizeRows(tensor, 2, 1, rows).ok());
  }

  // In a block format the scale carries it: a NaN d makes the whole Q8_0 block NaN.
  std::vector<float> values(64, 0.5f);
  std::vector<uint8_t> packed(2 * sizeof(BlockQ8_0));
  ASSERT_TRUE(QuantizeRow(GgmlType::kQ8_0, values.data(), packed.data(), 64).ok());
  const uint16_t nan_half = 0x7e00;
  std::memcpy(packed.data() + sizeof(BlockQ8_0), &nan_half, sizeof(nan_half));
  const TensorInfo q8 =
      HostTensor("attn_k.weight", {32, 2}, GgmlType::kQ8_0, packed.data(), packed.size());
  const Status status = CheckTensorFinite(q8);
  EXPECT_EQ(status.code(), ErrorCode::kCorrupt);
  EXPECT_NE(status.message().find("'attn_k.weight' holds a non-finite block scale (nan) at row 1, "
                                  "column 0"),
            std::string::npos)
      << status.message();
  EXPECT_FALSE(DequantizeTensor(q8).ok());

  // The min of Q4_1 is checked too, and a check of the scales agrees with decoding everything.
  std::vector<uint8_t> q4(2 * sizeof(BlockQ4_1));
  ASSERT_TRUE(QuantizeRow(GgmlType::kQ4_1, values.data(), q4.data(), 64).ok());
  const TensorInfo q4_1 =
      HostTensor("attn_k.weight", {64, 1}, GgmlType::kQ4_1, q4.data(), q4.size());
  EXPECT_TRUE(CheckTensorFinite(q4_1).ok());
  EXPECT_TRUE(DequantizeTensor(q4_1).ok());
  const uint16_t inf_half = 0x7c00;
  std::memcpy(q4.data() + sizeof(BlockQ4_1) + offsetof(BlockQ4_1, m), &inf_half, 2);
  const Status min_status = CheckTensorFinite(q4_1);
  EXPECT_NE(min_status.message().find("non-finite block scale (inf) at row 0, column 32"),
            std::string::npos)
      << min_status.message();
  EXPECT_FALSE(DequantizeTensor(q4_1).ok());
}

TEST(QuantizeTest, MatchesReferenceQuantiser) {
  const nlohmann::json manifest = Manifest();
  ASSERT_EQ(manifest["quantize"].size(), 3u);
  for (const auto& entry : manifest["quantize"]) {
    const std::string type_name = entry["type"];
    SCOPED_TRACE(type_name);
    const auto type = static_cast<GgmlType>(entry["type_id"].get<uint32_t>());
    const std::vector<uint8_t> bytes = ReadBytes(entry["file"]);
    const size_t num_elements = entry["num_elements"];
    const size_t raw_bytes = entry["raw_bytes"];
    ASSERT_EQ(bytes.size(), 4 * num_elements + raw_bytes);
    const std::vector<float> values = ReadArray<float>(bytes, 0, num_elements);
    std::vector<uint8_t> actual(raw_bytes, 0xcd);
    ASSERT_TRUE(
        QuantizeRow(type, values.data(), actual.data(), static_cast<int64_t>(num_elements)).ok());
    for (size_t i = 0; i < raw_bytes; ++i) {
      ASSERT_EQ(actual[i], bytes[4 * num_elements + i]) << "byte " << i;
    }
  }
}

TEST(QuantizeTest, RoundTripErrorWithinHalfAStep) {
  std::vector<float> values(256);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.37f * i) * (1 + i % 7);
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1}) {
    SCOPED_TRACE(TypeName(type));
    const TypeTraits traits = TraitsOf(type);
    std::vector<uint8_t> blocks(values.size() / 32 * traits.type_size);
    ASSERT_TRUE(QuantizeRow(type, values.data(), blocks.data(), 256).ok());
    std::vector<float> restored(values.size());
    ASSERT_TRUE(DequantizeRow(type, blocks.data(), restored.data(), 256).ok());
    for (size_t b = 0; b < 8; ++b) {
      float min = values[b * 32], max = values[b * 32], max_abs = 0;
      for (int i = 0; i < 32; ++i) {
        min = std::min(min, values[b * 32 + i]);
        max = std::max(max, values[b * 32 + i]);
        max_abs = std::max(max_abs, std::fabs(values[b * 32 + i]));
      }
      // Half a step between codes, plus the fp16 rounding of the scale (2^-11 relative). Q4_0
      // has one code fewer on the side opposite its extreme, so values there may be a full step
      // off.
      const float step = type == GgmlType::kQ8_0   ? max_abs / 127
                         : type == GgmlType::kQ4_0 ? max_abs / 8
                                                   : (max - min) / 15;
      const float tolerance = step * (type == GgmlType::kQ4_0 ? 1.0f : 0.5f) + max_abs * 2e-3f;
      for (int i = 0; i < 32; ++i) {
        EXPECT_NEAR(restored[b * 32 + i], values[b * 32 + i], tolerance) << b * 32 + i;
      }
    }
  }
  uint8_t out[64];
  EXPECT_EQ(QuantizeRow(GgmlType::kQ6_K, values.data(), out, 256).code(), ErrorCode::kUnsupported);
}

TEST(HalfTest, MatchesNumpyAndReferenceBf16) {
  const nlohmann::json manifest = Manifest();
  const std::vector<uint8_t> bytes = ReadBytes(manifest["half"]["file"]);
  const size_t count = manifest["half"]["num_values"];
  ASSERT_EQ(bytes.size(), count * 8);
  const std::vector<float> values = ReadArray<float>(bytes, 0, count);
  const std::vector<uint16_t> fp16 = ReadArray<uint16_t>(bytes, count * 4, count);
  const std::vector<uint16_t> bf16 = ReadArray<uint16_t>(bytes, count * 6, count);
  for (size_t i = 0; i < count; ++i) {
    EXPECT_EQ(Fp32ToFp16(values[i]), fp16[i]) << "value " << values[i] << " (#" << i << ")";
    EXPECT_EQ(Fp32ToBf16(values[i]), bf16[i]) << "value " << values[i] << " (#" << i << ")";
  }
}

TEST(HalfTest, HandCheckedValuesAndExhaustiveRoundTrip) {
  EXPECT_EQ(Fp16ToFp32(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFp32(0xc000), -2.0f);
  EXPECT_EQ(Fp16ToFp32(0x7bff), 65504.0f);
  EXPECT_EQ(Fp16ToFp32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFp32(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_TRUE(std::isinf(Fp16ToFp32(0xfc00)) && Fp16ToFp32(0xfc00) < 0);
  EXPECT_TRUE(std::isnan(Fp16ToFp32(0x7e00)));
  EXPECT_EQ(Bf16ToFp32(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFp32(0xc040), -3.0f);
  EXPECT_EQ(Fp32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie, stays even
  EXPECT_EQ(Fp32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie, rounds up to even
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto half = static_cast<uint16_t>(bits);
    const float value = Fp16ToFp32(half);
    if (std::isnan(value)) continue;
    ASSERT_EQ(Fp32ToFp16(value), half) << std::hex << bits;
    if (!std::isnan(Bf16ToFp32(half))) {
      ASSERT_EQ(Fp32ToBf16(Bf16ToFp32(half)), half) << bits;
    }
  }
}

}  // namespace
}  // namespace shadowkv::gguf
