// The GGUF fuzz seeds GgufWriter makes, shared by the unit test that checks the committed corpus
// against them and dev/write_gguf_fuzz_seeds, which rewrites that corpus.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "format/gguf.h"
#include "format/gguf_writer.h"

namespace shadowkv::gguf::fuzz_seeds {

// Deterministic values in [-scale, scale).
inline std::vector<float> PseudoRandom(size_t count, uint32_t seed, float scale) {
  std::vector<float> values(count);
  uint32_t state = seed;
  for (float& value : values) {
    state = state * 1664525u + 1013904223u;
    value = (static_cast<float>(state >> 8) / 8388608.0f - 1.0f) * scale;
  }
  return values;
}

// The GgufWriter seeds of the libFuzzer corpus (tests/fuzz/gguf_corpus; the config_* seeds there
// come from scripts/make_hostile_models.py --seeds), by file name.
inline std::vector<std::pair<std::string, std::vector<uint8_t>>> GgufFuzzSeeds() {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> seeds;
  seeds.emplace_back("empty.gguf", GgufWriter().Finish());

  GgufWriter metadata;
  metadata.AddString("general.architecture", "llama");
  metadata.AddUint32("llama.block_count", 2);
  metadata.AddInt64("i64", -5);
  metadata.AddUint8("u8", 9);
  metadata.AddInt16("i16", -9);
  metadata.AddFloat32("f32", 1e-5f);
  metadata.AddFloat64("f64", 2.5);
  metadata.AddBool("flag", false);
  metadata.AddStringArray("tokenizer.ggml.tokens", {"<s>", "a", "b"});
  metadata.AddInt32Array("tokenizer.ggml.token_type", {3, 1, 1});
  metadata.AddFloat32Array("scores", {0.0f, -1.0f, -2.0f});
  (void)metadata.AddValue(
      "nested",
      MakeArray(ValueType::kArray, {MakeArray(ValueType::kInt8, {MakeInt(ValueType::kInt8, -1)})}));
  (void)metadata.AddTensorFromFloats("norm", {8, 2}, GgmlType::kF32, PseudoRandom(16, 9, 1));
  seeds.emplace_back("metadata.gguf", metadata.Finish());

  GgufWriter quantized(64);
  (void)quantized.AddTensorFromFloats("q4_0", {32, 2}, GgmlType::kQ4_0, PseudoRandom(64, 10, 1));
  (void)quantized.AddTensorFromFloats("q4_1", {64}, GgmlType::kQ4_1, PseudoRandom(64, 11, 1));
  (void)quantized.AddTensorFromFloats("q8_0", {32}, GgmlType::kQ8_0, PseudoRandom(32, 12, 1));
  (void)quantized.AddTensorFromFloats("f16", {4, 2}, GgmlType::kF16, PseudoRandom(8, 13, 1));
  (void)quantized.AddTensorFromFloats("bf16", {8}, GgmlType::kBF16, PseudoRandom(8, 14, 1));
  seeds.emplace_back("quantized.gguf", quantized.Finish());

  // One block of each K format and Q5_x: patterned bytes with the fp16 scales set to 0.0999.
  GgufWriter blocks;
  const struct {
    GgmlType type;
    std::vector<size_t> scale_offsets;
  } kFormats[] = {{GgmlType::kQ5_0, {0}},   {GgmlType::kQ5_1, {0, 2}}, {GgmlType::kQ2_K, {80, 82}},
                  {GgmlType::kQ3_K, {108}}, {GgmlType::kQ4_K, {0, 2}}, {GgmlType::kQ5_K, {0, 2}},
                  {GgmlType::kQ6_K, {208}}};
  for (const auto& format : kFormats) {
    const TypeTraits traits = TraitsOf(format.type);
    std::vector<uint8_t> bytes(traits.type_size);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + 11);
    for (size_t offset : format.scale_offsets) {
      bytes[offset] = 0x66;
      bytes[offset + 1] = 0x2e;
    }
    (void)blocks.AddTensor(traits.name, {traits.block_size}, format.type, std::move(bytes));
  }
  seeds.emplace_back("blocks.gguf", blocks.Finish());
  return seeds;
}

}  // namespace shadowkv::gguf::fuzz_seeds
