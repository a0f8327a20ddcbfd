// libFuzzer entry point: parse arbitrary bytes as GGUF, then read every value, dequantise the
// first rows of every tensor the parse accepted and scan it for non-finite values, and validate
// the model hyper-parameters.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "format/gguf.h"
#include "format/quants.h"
#include "model/config.h"

namespace {

using shadowkv::gguf::GgufFile;

void ReadAllMetadata(const GgufFile& file) {
  for (const auto& [key, value] : file.metadata()) {
    (void)file.GetString(key);
    (void)file.GetInt(key);
    (void)file.GetFloat(key);
    (void)file.GetBool(key);
    (void)file.GetStringArray(key);
    (void)file.GetIntArray(key);
    (void)file.GetFloatArray(key);
  }
}

void DecodeTensors(const GgufFile& file) {
  constexpr int64_t kMaxRows = 2;
  std::vector<float> rows;
  for (const shadowkv::gguf::TensorInfo& tensor : file.tensors()) {
    if (!shadowkv::gguf::CanDequantize(tensor.type)) continue;
    const int64_t num_rows = tensor.rows() < kMaxRows ? tensor.rows() : kMaxRows;
    // The parse checked the tensor lies inside the input, so this is bounded by its size.
    rows.resize(static_cast<size_t>(num_rows * tensor.row_length()));
    (void)shadowkv::gguf::DequantizeRows(tensor, 0, num_rows, rows.data());
    // The load-time scan of weights used as stored reads every unit of the tensor.
    (void)shadowkv::gguf::CheckTensorFinite(tensor);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = GgufFile::FromBytes({data, size});
  if (!file.ok()) return 0;
  ReadAllMetadata(**file);
  DecodeTensors(**file);
  // Every range check of the config, on whatever the fuzzer makes of the seeds' metadata.
  (void)shadowkv::ModelConfig::FromGguf(**file);
  return 0;
}
