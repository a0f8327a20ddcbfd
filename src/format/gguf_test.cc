// GGUF reader: typed getters, and refusal of truncated, malformed and hostile files with messages
// that say what is wrong.
#include "format/gguf.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>

#include "format/gguf_writer.h"
#include "format/quants.h"

namespace shadowkv::gguf {
namespace {

// Builds GGUF bytes field by field, so tests can write what the writer never would.
class RawImage {
 public:
  RawImage& U8(uint8_t value) { return Put(value); }
  RawImage& U32(uint32_t value) { return Put(value); }
  RawImage& U64(uint64_t value) { return Put(value); }
  RawImage& Str(std::string_view text) {
    U64(text.size());
    bytes_.insert(bytes_.end(), text.begin(), text.end());
    return *this;
  }
  RawImage& Zeros(size_t count) {
    bytes_.resize(bytes_.size() + count, 0);
    return *this;
  }
  RawImage& PadTo(size_t alignment) {
    return Zeros((alignment - bytes_.size() % alignment) % alignment);
  }
  // Magic, version, counts.
  RawImage& Header(uint64_t tensor_count, uint64_t metadata_count, uint32_t version = 3) {
    bytes_.insert(bytes_.end(), {'G', 'G', 'U', 'F'});
    return U32(version).U64(tensor_count).U64(metadata_count);
  }
  RawImage& TensorInfo(std::string_view name, std::vector<uint64_t> dims, GgmlType type,
                       uint64_t offset) {
    Str(name).U32(static_cast<uint32_t>(dims.size()));
    for (uint64_t dim : dims) U64(dim);
    return U32(static_cast<uint32_t>(type)).U64(offset);
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  template <typename T>
  RawImage& Put(T value) {
    const auto* raw = reinterpret_cast<const uint8_t*>(&value);
    bytes_.insert(bytes_.end(), raw, raw + sizeof(T));
    return *this;
  }
  std::vector<uint8_t> bytes_;
};

// Parsing must fail with `code` and a message containing every one of `fragments`.
void ExpectError(const std::vector<uint8_t>& image, ErrorCode code,
                 std::initializer_list<std::string_view> fragments) {
  Result<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(image);
  ASSERT_FALSE(file.ok()) << "parsed a file that should be refused";
  EXPECT_EQ(file.status().code(), code) << file.status().ToString();
  for (std::string_view fragment : fragments) {
    EXPECT_NE(file.status().message().find(fragment), std::string::npos)
        << "'" << fragment << "' not in: " << file.status().message();
  }
}

std::vector<uint8_t> SampleFile() {
  GgufWriter writer;
  writer.AddString("general.architecture", "llama");
  writer.AddUint32("llama.block_count", 2);
  writer.AddFloat32("llama.rope.freq_base", 10000.0f);
  writer.AddBool("tokenizer.ggml.add_bos_token", true);
  writer.AddStringArray("tokenizer.ggml.tokens", {"<s>", "</s>", "hi"});
  writer.AddInt32Array("tokenizer.ggml.token_type", {3, 3, 1});
  (void)writer.AddValue(
      "nested", MakeArray(ValueType::kArray,
                          {MakeArray(ValueType::kUint8, {MakeUint(ValueType::kUint8, 1)})}));
  std::vector<float> values(64);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 3.0f;
  (void)writer.AddTensorFromFloats("norm", {4}, GgmlType::kF32, std::span(values).first(4));
  (void)writer.AddTensorFromFloats("blk.0.attn_q.weight", {32, 2}, GgmlType::kQ4_1, values);
  (void)writer.AddTensorFromFloats("token_embd.weight", {32, 2}, GgmlType::kQ8_0, values);
  return writer.Finish();
}

TEST(GgufReaderTest, TypedGettersConvertWhenTheValueFits) {
  GgufWriter writer;
  writer.AddUint8("u8", 255);
  writer.AddInt16("negative", -3);
  writer.AddUint64("huge", std::numeric_limits<uint64_t>::max());
  writer.AddUint32("count", 7);
  writer.AddString("name", "x");
  writer.AddFloat32Array("floats", {1.5f});
  writer.AddInt32Array("ints", {1, 2});
  (void)writer.AddValue("big_array",
                        MakeArray(ValueType::kUint64, {MakeUint(ValueType::kUint64, 1ull << 63)}));
  Result<std::unique_ptr<GgufFile>> parsed = GgufFile::FromBytes(writer.Finish());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const GgufFile& file = **parsed;

  EXPECT_EQ(file.GetInt("u8").value(), 255);
  EXPECT_EQ(file.GetInt("negative").value(), -3);
  EXPECT_EQ(file.GetFloat("count").value(), 7.0);  // integers read as numbers too
  EXPECT_EQ(file.GetFloatArray("ints").value(), (std::vector<float>{1.0f, 2.0f}));

  Result<int64_t> huge = file.GetInt("huge");
  EXPECT_EQ(huge.status().code(), ErrorCode::kOutOfRange);
  EXPECT_NE(huge.status().message().find("'huge' is 18446744073709551615"), std::string::npos)
      << huge.status().message();
  EXPECT_EQ(file.GetIntArray("big_array").status().code(), ErrorCode::kOutOfRange);

  Result<int64_t> missing = file.GetInt("llama.block_count");
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(missing.status().message().find("'llama.block_count' not found"), std::string::npos);

  Result<int64_t> wrong = file.GetInt("name");
  EXPECT_EQ(wrong.status().code(), ErrorCode::kCorrupt);
  EXPECT_NE(wrong.status().message().find("'name' has type string, expected an integer"),
            std::string::npos)
      << wrong.status().message();
  Result<std::vector<std::string>> not_strings = file.GetStringArray("floats");
  EXPECT_NE(
      not_strings.status().message().find("has type array of float32, expected an array of string"),
      std::string::npos)
      << not_strings.status().message();
  EXPECT_FALSE(file.GetBool("u8").ok());
  EXPECT_FALSE(file.GetString("u8").ok());
  EXPECT_EQ(file.FindTensor("nothing"), nullptr);
}

TEST(GgufReaderTest, OpenReportsMissingFilesByName) {
  Result<std::unique_ptr<GgufFile>> file = GgufFile::Open("/nonexistent/model.gguf");
  EXPECT_EQ(file.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(file.status().message().find("/nonexistent/model.gguf"), std::string::npos);
}

TEST(GgufReaderTest, EveryTruncationIsAnError) {
  const std::vector<uint8_t> image = SampleFile();
  Result<std::unique_ptr<GgufFile>> whole = GgufFile::FromBytes(image);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  // The writer pads after the last tensor; a file cut inside that padding is still complete.
  uint64_t needed = 0;
  for (const TensorInfo& tensor : (*whole)->tensors()) {
    needed = std::max(needed, (*whole)->data_offset() + tensor.offset + tensor.size_bytes);
  }
  ASSERT_LT(needed, image.size());
  for (size_t length = 0; length < image.size(); ++length) {
    Result<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(std::span(image.data(), length));
    if (length >= needed) {
      EXPECT_TRUE(file.ok()) << length << ": " << file.status().ToString();
      continue;
    }
    ASSERT_FALSE(file.ok()) << "prefix of " << length << " bytes parsed";
    EXPECT_EQ(file.status().code(), ErrorCode::kCorrupt) << file.status().ToString();
    EXPECT_FALSE(file.status().message().empty());
  }
}

TEST(GgufReaderTest, TruncationMessagesSayWhatWasBeingRead) {
  const std::vector<uint8_t> image = SampleFile();
  // Cut inside the last token, "hi", which follows "</s>" and its 8-byte length.
  const std::string marker = "</s>";
  const auto at = std::search(image.begin(), image.end(), marker.begin(), marker.end());
  ASSERT_NE(at, image.end());
  const size_t cut = static_cast<size_t>(at - image.begin()) + 4 + 8 + 1;
  ExpectError(
      std::vector<uint8_t>(image.begin(), image.begin() + cut), ErrorCode::kCorrupt,
      {"metadata key 'tokenizer.ggml.tokens' element [2]: string of 2 bytes", "runs past the end"});
  // A count that cannot fit in what remains is refused before reading any element.
  const size_t early_cut = static_cast<size_t>(at - image.begin()) + 2;
  ExpectError(std::vector<uint8_t>(image.begin(), image.begin() + early_cut), ErrorCode::kCorrupt,
              {"metadata key 'tokenizer.ggml.tokens': array of 3 string elements"});

  const std::vector<uint8_t> short_data(image.begin(), image.end() - 40);
  ExpectError(short_data, ErrorCode::kCorrupt,
              {"tensor 'token_embd.weight': data [offset", "size 68)",
               "runs past the end of the file (size"});
  ExpectError(std::vector<uint8_t>(image.begin(), image.begin() + 6), ErrorCode::kCorrupt,
              {"too small for a GGUF header"});
}

TEST(GgufReaderTest, RejectsBadMagicVersionsAndByteOrder) {
  ExpectError(RawImage().U32(0x58554747).U32(3).U64(0).U64(0).bytes(), ErrorCode::kCorrupt,
              {"not a GGUF file", "47 47 55 58"});
  ExpectError(RawImage().Header(0, 0, 1).bytes(), ErrorCode::kUnsupported, {"version 1"});
  ExpectError(RawImage().Header(0, 0, 4).bytes(), ErrorCode::kUnsupported, {"version 4"});
  ExpectError(RawImage().Header(0, 0, 0x03000000).bytes(), ErrorCode::kUnsupported, {"big-endian"});
  EXPECT_TRUE(GgufFile::FromBytes(RawImage().Header(0, 0).bytes()).ok());
}

TEST(GgufReaderTest, RejectsHostileCountsWithoutAllocating) {
  constexpr uint64_t kHuge = 1ull << 60;
  ExpectError(RawImage().Header(0, kHuge).bytes(), ErrorCode::kCorrupt,
              {"1152921504606846976 metadata entries"});
  ExpectError(RawImage().Header(kHuge, 0).bytes(), ErrorCode::kCorrupt,
              {"1152921504606846976 tensors"});
  ExpectError(RawImage().Header(0, 1).Str("tokens").U32(9).U32(8).U64(kHuge).bytes(),
              ErrorCode::kCorrupt, {"'tokens'", "array of 1152921504606846976 string elements"});
  ExpectError(RawImage().Header(0, 1).Str("name").U32(8).U64(kHuge).Zeros(16).bytes(),
              ErrorCode::kCorrupt, {"metadata key 'name'", "string of 1152921504606846976 bytes"});
  ExpectError(RawImage().Header(0, 1).U64(std::numeric_limits<uint64_t>::max()).Zeros(16).bytes(),
              ErrorCode::kCorrupt, {"metadata entry #0 key"});
}

TEST(GgufReaderTest, CapsWhatAFileMayMakeUsAllocate) {
  // Counts that fit in the file but would cost ~60 bytes of memory per byte of input.
  constexpr uint64_t kValues = (1ull << 24) + 1;
  ExpectError(RawImage().Header(0, 1).Str("big").U32(9).U32(0).U64(kValues).Zeros(kValues).bytes(),
              ErrorCode::kResourceExhausted, {"'big': array of 16777217 elements", "refusing"});
  constexpr uint64_t kTensors = (1ull << 20) + 1;
  ExpectError(RawImage().Header(kTensors, 0).Zeros(kTensors * 33).bytes(),
              ErrorCode::kResourceExhausted, {"1048577 tensors; refusing to load more than"});
}

TEST(GgufReaderTest, RejectsMalformedMetadata) {
  ExpectError(RawImage().Header(0, 1).Str("k").U32(13).U32(0).bytes(), ErrorCode::kCorrupt,
              {"metadata key 'k': unknown value type 13"});
  ExpectError(RawImage().Header(0, 1).Str("k").U32(9).U32(77).U64(0).bytes(), ErrorCode::kCorrupt,
              {"unknown array element type 77"});
  ExpectError(RawImage().Header(0, 1).Str("flag").U32(7).U8(2).Zeros(12).bytes(),
              ErrorCode::kCorrupt, {"'flag'", "bool value is 2"});
  ExpectError(RawImage().Header(0, 1).Str("").U32(4).U32(1).bytes(), ErrorCode::kCorrupt,
              {"metadata entry #0 has an empty key"});
  ExpectError(RawImage().Header(0, 2).Str("a").U32(4).U32(1).Str("a").U32(5).U32(2).bytes(),
              ErrorCode::kCorrupt, {"metadata key 'a' appears twice"});
  RawImage deep;
  deep.Header(0, 1).Str("deep").U32(9);
  for (int depth = 0; depth < 12; ++depth) deep.U32(9).U64(1);
  deep.U32(0).U64(0).Zeros(64);
  ExpectError(deep.bytes(), ErrorCode::kCorrupt, {"'deep'", "nested more than 8 deep"});
}

TEST(GgufReaderTest, RejectsBadAlignmentValues) {
  for (uint32_t alignment : {0u, 3u, 48u}) {
    ExpectError(
        RawImage().Header(0, 1).Str("general.alignment").U32(4).U32(alignment).bytes(),
        ErrorCode::kCorrupt,
        {fmt::format("general.alignment is {}; it must be a nonzero power of two", alignment)});
  }
  ExpectError(RawImage().Header(0, 1).Str("general.alignment").U32(8).Str("32").bytes(),
              ErrorCode::kCorrupt, {"general.alignment has type string"});
  ExpectError(RawImage().Header(0, 1).Str("general.alignment").U32(5).U32(-32).bytes(),
              ErrorCode::kCorrupt, {"general.alignment is -32"});
}

// A file with one metadata entry (general.alignment = 32), the given tensor infos and
// `data_bytes` zero bytes of data.
std::vector<uint8_t> TensorFile(const std::function<void(RawImage&)>& infos, uint64_t tensor_count,
                                size_t data_bytes) {
  RawImage image;
  image.Header(tensor_count, 1).Str("general.alignment").U32(4).U32(32);
  infos(image);
  return image.PadTo(32).Zeros(data_bytes).bytes();
}

TEST(GgufReaderTest, RejectsBadTensorInfos) {
  using T = GgmlType;
  auto one = [](std::string_view name, std::vector<uint64_t> dims, T type, uint64_t offset) {
    return [=](RawImage& image) { image.TensorInfo(name, dims, type, offset); };
  };
  EXPECT_TRUE(GgufFile::FromBytes(TensorFile(one("w", {8}, T::kF32, 0), 1, 32)).ok());

  ExpectError(TensorFile(one("w", {8}, T::kF32, 0), 1, 16), ErrorCode::kCorrupt,
              {"tensor 'w': data [offset", "size 32) runs past the end of the file (size"});
  ExpectError(TensorFile(one("w", {8}, T::kF32, 16), 1, 64), ErrorCode::kCorrupt,
              {"tensor 'w': offset 16 is not a multiple of the alignment 32"});
  ExpectError(TensorFile(one("w", {8}, T::kF32, 1ull << 63), 1, 64), ErrorCode::kCorrupt,
              {"tensor 'w': data", "runs past the end of the file"});
  ExpectError(TensorFile(one("w", {8}, static_cast<T>(77), 0), 1, 64), ErrorCode::kUnsupported,
              {"tensor 'w': unknown tensor type id 77"});
  ExpectError(TensorFile(one("w", {48}, T::kQ4_0, 0), 1, 64), ErrorCode::kCorrupt,
              {"tensor 'w': row length 48 is not a multiple of the Q4_0 block size 32"});
  ExpectError(TensorFile(one("w", {8, 0}, T::kF32, 0), 1, 64), ErrorCode::kCorrupt,
              {"tensor 'w': dimension 1 is 0"});
  // Printed as read, not wrapped to a negative number.
  ExpectError(TensorFile(one("w", {8, 1ull << 63}, T::kF32, 0), 1, 64), ErrorCode::kCorrupt,
              {"tensor 'w': dimension 1 is 9223372036854775808 (must be positive"});
  ExpectError(TensorFile(one("w", {1, 1, 1, 1, 1}, T::kF32, 0), 1, 64), ErrorCode::kCorrupt,
              {"tensor 'w' has 5 dimensions"});
  ExpectError(TensorFile(one("w", {1ull << 32, 1ull << 32}, T::kF32, 0), 1, 64),
              ErrorCode::kCorrupt, {"tensor 'w': element count overflows"});
  ExpectError(TensorFile(one("w", {1ull << 62}, T::kF32, 0), 1, 64), ErrorCode::kCorrupt,
              {"tensor 'w': byte size overflows"});
  ExpectError(TensorFile(one("", {8}, T::kF32, 0), 1, 64), ErrorCode::kCorrupt,
              {"tensor #0 has an empty name"});

  auto two = [](std::string_view second_name, uint64_t second_offset) {
    return [=](RawImage& image) {
      image.TensorInfo("a", {16}, T::kF32, 0).TensorInfo(second_name, {8}, T::kF32, second_offset);
    };
  };
  EXPECT_TRUE(GgufFile::FromBytes(TensorFile(two("b", 64), 2, 96)).ok());
  ExpectError(TensorFile(two("b", 32), 2, 96), ErrorCode::kCorrupt,
              {"tensor 'b': data [offset", "overlaps tensor 'a'"});
  ExpectError(TensorFile(two("a", 64), 2, 96), ErrorCode::kCorrupt, {"tensor 'a' appears twice"});
}

TEST(GgufReaderTest, SampleFileContents) {
  Result<std::unique_ptr<GgufFile>> parsed = GgufFile::FromBytes(SampleFile());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const GgufFile& file = **parsed;
  EXPECT_EQ(file.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(file.GetInt("llama.block_count").value(), 2);
  EXPECT_EQ(file.GetFloat("llama.rope.freq_base").value(), 10000.0);
  EXPECT_TRUE(file.GetBool("tokenizer.ggml.add_bos_token").value());
  EXPECT_EQ(file.GetStringArray("tokenizer.ggml.tokens").value()[2], "hi");
  const TensorInfo* q = file.FindTensor("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->type, GgmlType::kQ4_1);
  EXPECT_EQ(q->rows(), 2);
  EXPECT_EQ(q->row_length(), 32);
  EXPECT_EQ(q->row_bytes(), 20u);
  EXPECT_EQ(q->size_bytes, 40u);
  const TensorInfo* norm = file.FindTensor("norm");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(DequantizeTensor(*norm).value(), (std::vector<float>{-3.0f, -2.75f, -2.5f, -2.25f}));
}

}  // namespace
}  // namespace shadowkv::gguf
