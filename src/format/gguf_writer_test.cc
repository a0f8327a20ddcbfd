// GgufWriter: byte layout checked by hand, round trips through the reader, and the fuzz seeds.
#include "format/gguf_writer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "core/half.h"
#include "format/quants.h"
#include "support/gguf_fuzz_seeds.h"

namespace shadowkv::gguf {
namespace {

std::unique_ptr<GgufFile> Parse(const std::vector<uint8_t>& image) {
  Result<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(image);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  return file.ok() ? std::move(file).value() : nullptr;
}

using fuzz_seeds::PseudoRandom;

TEST(GgufWriterTest, MinimalFileHasTheSpecifiedBytes) {
  GgufWriter writer;
  writer.AddUint32("a", 7);
  const std::vector<uint8_t> image = writer.Finish();
  // magic, version 3, 0 tensors, 1 entry; key length 1, "a", type 4 (uint32), 7; zero padding to
  // the next multiple of 32 (41 -> 64).
  std::vector<uint8_t> expected = {'G', 'G', 'U', 'F', 3,   0, 0, 0, 0, 0, 0, 0, 0, 0,
                                   0,   0,   1,   0,   0,   0, 0, 0, 0, 0, 1, 0, 0, 0,
                                   0,   0,   0,   0,   'a', 4, 0, 0, 0, 7, 0, 0, 0};
  expected.resize(64, 0);
  EXPECT_EQ(image, expected);
}

TEST(GgufWriterTest, MetadataOfEveryTypeRoundTrips) {
  GgufWriter writer;
  writer.AddUint8("u8", 200);
  writer.AddInt8("i8", -100);
  writer.AddUint16("u16", 60000);
  writer.AddInt16("i16", -30000);
  writer.AddUint32("u32", 4000000000u);
  writer.AddInt32("i32", -2000000000);
  writer.AddUint64("u64", 18446744073709551615ull);
  writer.AddInt64("i64", -9000000000000000000ll);
  writer.AddFloat32("f32", 0.1f);
  writer.AddFloat64("f64", 0.1);
  writer.AddBool("yes", true);
  writer.AddString("text", "héllo\n");
  writer.AddStringArray("strings", {"a", "", "ccc"});
  writer.AddInt32Array("ints", {1, -2, 3});
  writer.AddFloat32Array("floats", {0.5f, -1.25f});
  writer.AddStringArray("empty", {});
  ASSERT_TRUE(writer
                  .AddValue("nested", MakeArray(ValueType::kArray,
                                                {MakeArray(ValueType::kUint16,
                                                           {MakeUint(ValueType::kUint16, 1),
                                                            MakeUint(ValueType::kUint16, 2)}),
                                                 MakeArray(ValueType::kUint16, {})}))
                  .ok());
  auto file = Parse(writer.Finish());
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->version(), 3u);
  EXPECT_EQ(file->alignment(), 32u);
  ASSERT_EQ(file->metadata().size(), 17u);
  EXPECT_EQ(file->metadata()[0].first, "u8");
  EXPECT_EQ(file->metadata()[16].first, "nested");

  EXPECT_EQ(file->GetInt("u8").value(), 200);
  EXPECT_EQ(file->GetInt("i8").value(), -100);
  EXPECT_EQ(file->GetInt("u16").value(), 60000);
  EXPECT_EQ(file->GetInt("i16").value(), -30000);
  EXPECT_EQ(file->GetInt("u32").value(), 4000000000ll);
  EXPECT_EQ(file->GetInt("i32").value(), -2000000000);
  EXPECT_EQ(file->GetInt("i64").value(), -9000000000000000000ll);
  EXPECT_EQ(file->Find("u64")->type, ValueType::kUint64);
  EXPECT_EQ(std::get<uint64_t>(file->Find("u64")->data), 18446744073709551615ull);
  EXPECT_EQ(file->GetFloat("f32").value(), static_cast<double>(0.1f));
  EXPECT_EQ(file->GetFloat("f64").value(), 0.1);
  EXPECT_EQ(file->GetBool("yes").value(), true);
  EXPECT_EQ(file->GetString("text").value(), "héllo\n");
  EXPECT_EQ(file->GetStringArray("strings").value(), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(file->GetIntArray("ints").value(), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(file->GetFloatArray("floats").value(), (std::vector<float>{0.5f, -1.25f}));
  const Value* empty = file->Find("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->element_type, ValueType::kString);
  EXPECT_TRUE(std::get<std::vector<Value>>(empty->data).empty());

  const Value* nested = file->Find("nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->element_type, ValueType::kArray);
  const auto& outer = std::get<std::vector<Value>>(nested->data);
  ASSERT_EQ(outer.size(), 2u);
  EXPECT_EQ(outer[0].element_type, ValueType::kUint16);
  const auto& inner = std::get<std::vector<Value>>(outer[0].data);
  ASSERT_EQ(inner.size(), 2u);
  EXPECT_EQ(std::get<uint64_t>(inner[1].data), 2u);
  EXPECT_TRUE(std::get<std::vector<Value>>(outer[1].data).empty());
}

TEST(GgufWriterTest, TensorsRoundTrip) {
  const std::vector<float> f32 = PseudoRandom(24, 1, 3.0f);
  const std::vector<float> halves = {1.0f, -2.0f, 0.5f, 65504.0f, -0.0f, 0.25f, 3.0f, 1024.0f};
  const std::vector<float> quantized = PseudoRandom(128, 2, 1.0f);
  GgufWriter writer;
  writer.AddString("general.architecture", "llama");
  ASSERT_TRUE(writer.AddTensorFromFloats("f32", {8, 3}, GgmlType::kF32, f32).ok());
  ASSERT_TRUE(writer.AddTensorFromFloats("f16", {8}, GgmlType::kF16, halves).ok());
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1}) {
    ASSERT_TRUE(writer.AddTensorFromFloats(TypeName(type), {64, 2}, type, quantized).ok());
  }
  auto file = Parse(writer.Finish());
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(file->tensors().size(), 5u);
  EXPECT_EQ(file->data_offset() % 32, 0u);

  const TensorInfo* tensor = file->FindTensor("f32");
  ASSERT_NE(tensor, nullptr);
  EXPECT_EQ(tensor->shape, (std::vector<int64_t>{8, 3}));
  EXPECT_EQ(tensor->type, GgmlType::kF32);
  EXPECT_EQ(tensor->num_elements, 24);
  EXPECT_EQ(tensor->size_bytes, 96u);
  EXPECT_EQ(tensor->offset, 0u);
  EXPECT_EQ(DequantizeTensor(*tensor).value(), f32);

  tensor = file->FindTensor("f16");
  ASSERT_NE(tensor, nullptr);
  EXPECT_EQ(tensor->offset, 96u);  // 96 bytes of F32 are already a multiple of 32
  EXPECT_EQ(DequantizeTensor(*tensor).value(), halves);

  uint64_t previous_end = 96 + 16;
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1}) {
    SCOPED_TRACE(TypeName(type));
    tensor = file->FindTensor(TypeName(type));
    ASSERT_NE(tensor, nullptr);
    EXPECT_EQ(tensor->type, type);
    EXPECT_EQ(tensor->offset, (previous_end + 31) / 32 * 32);
    EXPECT_EQ(tensor->size_bytes, static_cast<uint64_t>(4 * TraitsOf(type).type_size));
    EXPECT_EQ(tensor->data, file->tensors()[0].data + tensor->offset);
    previous_end = tensor->offset + tensor->size_bytes;
    std::vector<uint8_t> expected(tensor->size_bytes);
    ASSERT_TRUE(QuantizeRow(type, quantized.data(), expected.data(), 128).ok());
    EXPECT_EQ(std::vector<uint8_t>(tensor->data, tensor->data + tensor->size_bytes), expected);
  }
}

TEST(GgufWriterTest, OtherAlignmentIsRecordedAndUsed) {
  GgufWriter writer(64);
  ASSERT_TRUE(writer.AddTensorFromFloats("a", {3}, GgmlType::kF32, PseudoRandom(3, 3, 1)).ok());
  ASSERT_TRUE(writer.AddTensorFromFloats("b", {5}, GgmlType::kF32, PseudoRandom(5, 4, 1)).ok());
  const std::vector<uint8_t> image = writer.Finish();
  auto file = Parse(image);
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->alignment(), 64u);
  EXPECT_EQ(file->GetInt("general.alignment").value(), 64);
  EXPECT_EQ(file->data_offset() % 64, 0u);
  EXPECT_EQ(file->FindTensor("b")->offset, 64u);
  EXPECT_EQ(image.size() % 64, 0u);
}

TEST(GgufWriterTest, VersionTwoFilesAreRead) {
  GgufWriter writer;
  writer.set_version(2);
  writer.AddString("general.name", "v2");
  auto file = Parse(writer.Finish());
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->version(), 2u);
  EXPECT_EQ(file->GetString("general.name").value(), "v2");
}

TEST(GgufWriterTest, WriteFileThenOpenMapsTheSameContents) {
  GgufWriter writer;
  writer.AddInt32("answer", 42);
  const std::vector<float> values = PseudoRandom(64, 5, 2.0f);
  ASSERT_TRUE(writer.AddTensorFromFloats("w", {32, 2}, GgmlType::kQ8_0, values).ok());
  const std::string path = testing::TempDir() + "gguf_writer_test.gguf";
  ASSERT_TRUE(writer.WriteFile(path).ok());
  Result<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_EQ((*file)->file_size(), writer.Finish().size());
  EXPECT_EQ((*file)->GetInt("answer").value(), 42);
  const TensorInfo* tensor = (*file)->FindTensor("w");
  ASSERT_NE(tensor, nullptr);
  std::vector<float> row(32);
  ASSERT_TRUE(DequantizeRows(*tensor, 1, 1, row.data()).ok());
  for (int i = 0; i < 32; ++i) EXPECT_NEAR(row[i], values[32 + i], 2.0f / 127) << i;
  std::remove(path.c_str());

  const Status status = writer.WriteFile("/nonexistent-dir/x.gguf");
  EXPECT_EQ(status.code(), ErrorCode::kIo);
  EXPECT_NE(status.message().find("/nonexistent-dir/x.gguf"), std::string::npos);
}

TEST(GgufWriterTest, RejectsInconsistentInput) {
  GgufWriter writer;
  Status status = writer.AddValue("bad", Value{ValueType::kUint32, std::string("x")});
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(status.message().find("'bad'"), std::string::npos) << status.message();
  status = writer.AddValue(
      "mixed", MakeArray(ValueType::kInt32, {MakeInt(ValueType::kInt32, 1), MakeString("x")}));
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument);

  status = writer.AddTensor("short", {32}, GgmlType::kQ8_0, std::vector<uint8_t>(33));
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(status.message().find("33 bytes given, 34 needed"), std::string::npos)
      << status.message();
  status = writer.AddTensorFromFloats("ragged", {48}, GgmlType::kQ4_0, PseudoRandom(48, 6, 1));
  EXPECT_NE(status.message().find("not a multiple of the Q4_0 block size"), std::string::npos)
      << status.message();
  status = writer.AddTensorFromFloats("count", {32}, GgmlType::kF32, PseudoRandom(31, 7, 1));
  EXPECT_NE(status.message().find("31 values given, 32 needed"), std::string::npos)
      << status.message();
  status = writer.AddTensorFromFloats("k", {256}, GgmlType::kQ4_K, PseudoRandom(256, 8, 1));
  EXPECT_EQ(status.code(), ErrorCode::kUnsupported);
}

TEST(GgufWriterTest, FuzzSeedsParseAndMatchTheCommittedCorpus) {
  const std::string corpus = std::string(SHADOWKV_SOURCE_DIR) + "/tests/fuzz/gguf_corpus/";
  for (const auto& [name, image] : fuzz_seeds::GgufFuzzSeeds()) {
    SCOPED_TRACE(name);
    auto file = Parse(image);
    ASSERT_NE(file, nullptr);
    for (const TensorInfo& tensor : file->tensors()) {
      EXPECT_TRUE(DequantizeTensor(tensor).ok()) << tensor.name;
    }
    std::ifstream in(corpus + name, std::ios::binary);
    const std::vector<uint8_t> committed(std::istreambuf_iterator<char>(in), {});
    EXPECT_EQ(committed, image) << "regenerate with build/tests/write_gguf_fuzz_seeds " << corpus;
    EXPECT_LT(image.size(), 2048u);
  }
}

}  // namespace
}  // namespace shadowkv::gguf
