// GgufWriter: builds GGUF v3 images in memory, for tests and tiny synthetic models.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/gguf.h"

namespace shadowkv::gguf {

// Value builders for GgufWriter::AddValue (nested arrays are arrays of MakeArray values).
Value MakeUint(ValueType type, uint64_t value);  // type: kUint8 .. kUint64
Value MakeInt(ValueType type, int64_t value);    // type: kInt8 .. kInt64
Value MakeFloat(ValueType type, double value);   // type: kFloat32 or kFloat64
Value MakeBool(bool value);
Value MakeString(std::string value);
Value MakeArray(ValueType element_type, std::vector<Value> elements);

// Metadata and tensors are written in the order they are added. The writer does not reject
// duplicate keys or names, so tests can also build files the reader must refuse. One thread only.
class GgufWriter {
 public:
  // An alignment other than the default 32 is also recorded as general.alignment (uint32).
  explicit GgufWriter(uint64_t alignment = 32);

  // The version written in the header; 2 and 3 share one layout.
  void set_version(uint32_t version) { version_ = version; }

  void AddUint8(std::string key, uint8_t value);
  void AddInt8(std::string key, int8_t value);
  void AddUint16(std::string key, uint16_t value);
  void AddInt16(std::string key, int16_t value);
  void AddUint32(std::string key, uint32_t value);
  void AddInt32(std::string key, int32_t value);
  void AddUint64(std::string key, uint64_t value);
  void AddInt64(std::string key, int64_t value);
  void AddFloat32(std::string key, float value);
  void AddFloat64(std::string key, double value);
  void AddBool(std::string key, bool value);
  void AddString(std::string key, std::string value);
  void AddStringArray(std::string key, const std::vector<std::string>& values);
  void AddInt32Array(std::string key, const std::vector<int32_t>& values);
  void AddFloat32Array(std::string key, const std::vector<float>& values);
  // Any value; an error when its variant does not hold what its type says (arrays recursively).
  Status AddValue(std::string key, Value value);

  // A tensor of `shape` (GGUF order: shape[0] is the row length) from bytes already in `type`'s
  // format; `data` must be exactly the tensor's size.
  Status AddTensor(std::string name, std::vector<int64_t> shape, GgmlType type,
                   std::vector<uint8_t> data);
  // A tensor from fp32 values, stored as F32, F16, BF16, Q8_0, Q4_0 or Q4_1 (quants.h).
  Status AddTensorFromFloats(std::string name, std::vector<int64_t> shape, GgmlType type,
                             std::span<const float> values);

  // The whole file image.
  std::vector<uint8_t> Finish() const;
  Status WriteFile(const std::string& path) const;

 private:
  struct PendingTensor {
    std::string name;
    std::vector<int64_t> shape;
    GgmlType type;
    std::vector<uint8_t> data;
  };

  uint64_t alignment_;
  uint32_t version_ = 3;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::vector<PendingTensor> tensors_;
};

}  // namespace shadowkv::gguf
