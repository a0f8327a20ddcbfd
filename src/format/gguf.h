// GGUF reader: memory-maps a .gguf file and exposes its metadata and tensor table, all checked.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "core/status.h"

namespace shadowkv::gguf {

// Tensor element types, numbered as in the GGUF format.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};

// Metadata value types, numbered as in the GGUF format.
enum class ValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// Block geometry of a type: `block_size` elements are stored in `type_size` bytes.
struct TypeTraits {
  const char* name;
  int64_t block_size;
  int64_t type_size;
};

// Traits of a raw type id read from a file; an error names the id when it is unknown. A known
// type may still be one that quants.h cannot dequantise.
Result<TypeTraits> GetTypeTraits(uint32_t raw_type);
TypeTraits TraitsOf(GgmlType type);  // `type` must be a GgmlType enumerator
const char* TypeName(GgmlType type);
const char* ValueTypeName(ValueType type);

// One metadata value. Unsigned integers are held as uint64_t, signed ones as int64_t, float32 and
// float64 as double. Arrays hold their elements as a vector of Value (nested arrays allowed), all
// of `element_type`, which is kept so that an empty array still says what it would hold.
struct Value {
  ValueType type = ValueType::kUint8;
  std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<Value>> data;
  ValueType element_type = ValueType::kUint8;  // arrays only
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // GGUF order: shape[0] is the fastest-varying (row length)
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;      // from the start of the data section
  uint64_t size_bytes = 0;  // checked to lie inside the file
  int64_t num_elements = 0;
  const uint8_t* data = nullptr;  // points into the mapping; valid while the GgufFile lives

  int64_t rows() const;        // product of shape[1..]
  int64_t row_length() const;  // shape[0]
  size_t row_bytes() const;    // bytes of one row of shape[0] elements
};

// A parsed GGUF file. Immutable after Open; safe to read from several threads.
class GgufFile {
 public:
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  // Maps and parses `path`. Every count, length, offset and size is checked against the file;
  // errors name the key or tensor concerned and what is wrong.
  static Result<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses a copy of an in-memory image (tests, fuzzing).
  static Result<std::unique_ptr<GgufFile>> FromBytes(std::span<const uint8_t> bytes);

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::string& path() const { return path_; }  // empty for FromBytes
  size_t file_size() const { return size_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the data section in the file

  // Metadata in file order, and lookup by key.
  const std::vector<std::pair<std::string, Value>>& metadata() const { return metadata_; }
  const Value* Find(std::string_view key) const;

  // Typed getters. Integers of any width and sign convert when the value fits; errors name the
  // key (missing, or of another type).
  Result<std::string> GetString(std::string_view key) const;
  Result<int64_t> GetInt(std::string_view key) const;
  Result<double> GetFloat(std::string_view key) const;  // float32/float64 (and integers)
  Result<bool> GetBool(std::string_view key) const;
  Result<std::vector<std::string>> GetStringArray(std::string_view key) const;
  Result<std::vector<int64_t>> GetIntArray(std::string_view key) const;
  Result<std::vector<float>> GetFloatArray(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* FindTensor(std::string_view name) const;

 private:
  GgufFile() = default;
  Status Parse();

  std::string path_;
  const uint8_t* base_ = nullptr;  // the whole file
  size_t size_ = 0;
  void* mapping_ = nullptr;  // mmap'd region (null when owned_ holds the bytes)
  std::vector<uint8_t> owned_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::unordered_map<std::string, size_t> metadata_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace shadowkv::gguf
