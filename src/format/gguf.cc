// GGUF parsing: every count, length and offset is checked against the file before it is used.
#include "format/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace shadowkv::gguf {
namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;
// Deep enough for any real file; bounds recursion on hostile input.
constexpr int kMaxArrayDepth = 8;
// Metadata values cost ~60 bytes in memory against 1 byte in the file, so their total count is
// capped; real files hold well under a million (vocabularies, merges, scores). Same for tensors.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 24;
constexpr uint64_t kMaxTensors = uint64_t{1} << 20;
constexpr uint32_t kLastValueType = static_cast<uint32_t>(ValueType::kFloat64);
// Smallest possible encodings, used to reject hostile counts before anything is allocated:
// a metadata entry is a key length (8) + value type (4) + a 1-byte value; a tensor info is a
// name length (8) + 1 name byte + dimension count (4) + one dimension (8) + type (4) + offset (8).
constexpr uint64_t kMinMetadataEntryBytes = 13;
constexpr uint64_t kMinTensorInfoBytes = 33;

struct TypeEntry {
  GgmlType type;
  TypeTraits traits;
};

constexpr TypeEntry kTypes[] = {
    {GgmlType::kF32, {"F32", 1, 4}},
    {GgmlType::kF16, {"F16", 1, 2}},
    {GgmlType::kQ4_0, {"Q4_0", 32, 18}},
    {GgmlType::kQ4_1, {"Q4_1", 32, 20}},
    {GgmlType::kQ5_0, {"Q5_0", 32, 22}},
    {GgmlType::kQ5_1, {"Q5_1", 32, 24}},
    {GgmlType::kQ8_0, {"Q8_0", 32, 34}},
    {GgmlType::kQ8_1, {"Q8_1", 32, 36}},
    {GgmlType::kQ2_K, {"Q2_K", 256, 84}},
    {GgmlType::kQ3_K, {"Q3_K", 256, 110}},
    {GgmlType::kQ4_K, {"Q4_K", 256, 144}},
    {GgmlType::kQ5_K, {"Q5_K", 256, 176}},
    {GgmlType::kQ6_K, {"Q6_K", 256, 210}},
    {GgmlType::kQ8_K, {"Q8_K", 256, 292}},
    {GgmlType::kIQ2_XXS, {"IQ2_XXS", 256, 66}},
    {GgmlType::kIQ2_XS, {"IQ2_XS", 256, 74}},
    {GgmlType::kIQ3_XXS, {"IQ3_XXS", 256, 98}},
    {GgmlType::kIQ1_S, {"IQ1_S", 256, 50}},
    {GgmlType::kIQ4_NL, {"IQ4_NL", 32, 18}},
    {GgmlType::kIQ3_S, {"IQ3_S", 256, 110}},
    {GgmlType::kIQ2_S, {"IQ2_S", 256, 82}},
    {GgmlType::kIQ4_XS, {"IQ4_XS", 256, 136}},
    {GgmlType::kI8, {"I8", 1, 1}},
    {GgmlType::kI16, {"I16", 1, 2}},
    {GgmlType::kI32, {"I32", 1, 4}},
    {GgmlType::kI64, {"I64", 1, 8}},
    {GgmlType::kF64, {"F64", 1, 8}},
    {GgmlType::kIQ1_M, {"IQ1_M", 256, 56}},
    {GgmlType::kBF16, {"BF16", 1, 2}},
    {GgmlType::kTQ1_0, {"TQ1_0", 256, 54}},
    {GgmlType::kTQ2_0, {"TQ2_0", 256, 66}},
    {GgmlType::kMXFP4, {"MXFP4", 32, 17}},
};

const TypeEntry* FindType(uint32_t raw_type) {
  for (const TypeEntry& entry : kTypes) {
    if (static_cast<uint32_t>(entry.type) == raw_type) return &entry;
  }
  return nullptr;
}

uint64_t MinEncodedBytes(ValueType type) {
  switch (type) {
    case ValueType::kUint8:
    case ValueType::kInt8:
    case ValueType::kBool:
      return 1;
    case ValueType::kUint16:
    case ValueType::kInt16:
      return 2;
    case ValueType::kUint32:
    case ValueType::kInt32:
    case ValueType::kFloat32:
      return 4;
    case ValueType::kUint64:
    case ValueType::kInt64:
    case ValueType::kFloat64:
      return 8;
    case ValueType::kString:
      return 8;  // the length
    case ValueType::kArray:
      return 12;  // element type + count
  }
  return 1;
}

bool IsInteger(ValueType type) {
  switch (type) {
    case ValueType::kUint8:
    case ValueType::kInt8:
    case ValueType::kUint16:
    case ValueType::kInt16:
    case ValueType::kUint32:
    case ValueType::kInt32:
    case ValueType::kUint64:
    case ValueType::kInt64:
      return true;
    default:
      return false;
  }
}

// Reads little-endian fields from the file image; every read is bounds-checked first. `describe`
// callables build the error context only when an error is reported.
class Cursor {
 public:
  Cursor(const uint8_t* base, size_t size) : base_(base), size_(size) {}

  size_t position() const { return position_; }
  size_t remaining() const { return size_ - position_; }

  template <typename T, typename Describe>
  Status Read(T* out, const Describe& describe) {
    if (remaining() < sizeof(T)) {
      return Error(ErrorCode::kCorrupt, "{}: needs {} bytes at offset {} but the file ends at {}",
                   describe(), sizeof(T), position_, size_);
    }
    std::memcpy(out, base_ + position_, sizeof(T));
    position_ += sizeof(T);
    return Status::Ok();
  }

  template <typename Describe>
  Status ReadString(std::string* out, const Describe& describe) {
    uint64_t length = 0;
    SKV_RETURN_IF_ERROR(Read(&length, [&] { return describe() + " (string length)"; }));
    if (length > remaining()) {
      return Error(ErrorCode::kCorrupt,
                   "{}: string of {} bytes at offset {} runs past the end of the file (size {})",
                   describe(), length, position_, size_);
    }
    out->assign(reinterpret_cast<const char*>(base_ + position_), length);
    position_ += length;
    return Status::Ok();
  }

 private:
  const uint8_t* base_;
  size_t size_;
  size_t position_ = 0;
};

// Where a value sits, for error messages: the key and the element index at each array depth.
struct ValuePath {
  const std::string& key;
  std::vector<uint64_t> indices;
  uint64_t* values_left;  // of kMaxMetadataValues, shared by all keys

  std::string Describe() const {
    std::string text = fmt::format("metadata key '{}'", key);
    if (!indices.empty()) {
      text += " element ";
      for (uint64_t index : indices) text += fmt::format("[{}]", index);
    }
    return text;
  }
};

template <typename T, typename Stored>
Status ReadScalar(Cursor& cursor, const ValuePath& path, Value* out) {
  T raw{};
  SKV_RETURN_IF_ERROR(cursor.Read(&raw, [&] { return path.Describe(); }));
  out->data = static_cast<Stored>(raw);
  return Status::Ok();
}

Status ReadValue(Cursor& cursor, ValueType type, int depth, ValuePath& path, Value* out) {
  out->type = type;
  switch (type) {
    case ValueType::kUint8:
      return ReadScalar<uint8_t, uint64_t>(cursor, path, out);
    case ValueType::kInt8:
      return ReadScalar<int8_t, int64_t>(cursor, path, out);
    case ValueType::kUint16:
      return ReadScalar<uint16_t, uint64_t>(cursor, path, out);
    case ValueType::kInt16:
      return ReadScalar<int16_t, int64_t>(cursor, path, out);
    case ValueType::kUint32:
      return ReadScalar<uint32_t, uint64_t>(cursor, path, out);
    case ValueType::kInt32:
      return ReadScalar<int32_t, int64_t>(cursor, path, out);
    case ValueType::kUint64:
      return ReadScalar<uint64_t, uint64_t>(cursor, path, out);
    case ValueType::kInt64:
      return ReadScalar<int64_t, int64_t>(cursor, path, out);
    case ValueType::kFloat32:
      return ReadScalar<float, double>(cursor, path, out);
    case ValueType::kFloat64:
      return ReadScalar<double, double>(cursor, path, out);
    case ValueType::kBool: {
      uint8_t raw = 0;
      SKV_RETURN_IF_ERROR(cursor.Read(&raw, [&] { return path.Describe(); }));
      if (raw > 1) {
        return Error(ErrorCode::kCorrupt, "{}: bool value is {} (must be 0 or 1)", path.Describe(),
                     raw);
      }
      out->data = raw == 1;
      return Status::Ok();
    }
    case ValueType::kString: {
      std::string text;
      SKV_RETURN_IF_ERROR(cursor.ReadString(&text, [&] { return path.Describe(); }));
      out->data = std::move(text);
      return Status::Ok();
    }
    case ValueType::kArray:
      break;
  }

  if (depth >= kMaxArrayDepth) {
    return Error(ErrorCode::kCorrupt, "{}: arrays nested more than {} deep", path.Describe(),
                 kMaxArrayDepth);
  }
  uint32_t raw_element_type = 0;
  SKV_RETURN_IF_ERROR(
      cursor.Read(&raw_element_type, [&] { return path.Describe() + " (array element type)"; }));
  if (raw_element_type > kLastValueType) {
    return Error(ErrorCode::kCorrupt, "{}: unknown array element type {}", path.Describe(),
                 raw_element_type);
  }
  const auto element_type = static_cast<ValueType>(raw_element_type);
  uint64_t count = 0;
  SKV_RETURN_IF_ERROR(
      cursor.Read(&count, [&] { return path.Describe() + " (array element count)"; }));
  const uint64_t min_bytes = MinEncodedBytes(element_type);
  if (count > cursor.remaining() / min_bytes) {
    return Error(ErrorCode::kCorrupt,
                 "{}: array of {} {} elements needs at least {} bytes each but only {} bytes "
                 "remain in the file",
                 path.Describe(), count, ValueTypeName(element_type), min_bytes,
                 cursor.remaining());
  }
  if (count > *path.values_left) {
    return Error(ErrorCode::kResourceExhausted,
                 "{}: array of {} elements takes the metadata past {} values in total; refusing "
                 "to load it",
                 path.Describe(), count, kMaxMetadataValues);
  }
  *path.values_left -= count;
  std::vector<Value> elements(count);
  path.indices.push_back(0);
  for (uint64_t i = 0; i < count; ++i) {
    path.indices.back() = i;
    SKV_RETURN_IF_ERROR(ReadValue(cursor, element_type, depth + 1, path, &elements[i]));
  }
  path.indices.pop_back();
  out->element_type = element_type;
  out->data = std::move(elements);
  return Status::Ok();
}

// Integer value as int64 when it fits.
bool IntegerToInt64(const Value& value, int64_t* out) {
  if (!IsInteger(value.type)) return false;
  if (const auto* unsigned_value = std::get_if<uint64_t>(&value.data)) {
    if (*unsigned_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(*unsigned_value);
    return true;
  }
  *out = std::get<int64_t>(value.data);
  return true;
}

std::string ValueText(const Value& value) {
  if (const auto* unsigned_value = std::get_if<uint64_t>(&value.data)) {
    return fmt::format("{}", *unsigned_value);
  }
  if (const auto* signed_value = std::get_if<int64_t>(&value.data)) {
    return fmt::format("{}", *signed_value);
  }
  return ValueTypeName(value.type);
}

std::string DescribeType(const Value& value) {
  if (value.type != ValueType::kArray) return ValueTypeName(value.type);
  return fmt::format("array of {}", ValueTypeName(value.element_type));
}

// x rounded up to a multiple of the power of two `alignment`, or false on overflow.
bool AlignUp(uint64_t x, uint64_t alignment, uint64_t* out) {
  const uint64_t mask = alignment - 1;
  if (x > std::numeric_limits<uint64_t>::max() - mask) return false;
  *out = (x + mask) & ~mask;
  return true;
}

}  // namespace

Result<TypeTraits> GetTypeTraits(uint32_t raw_type) {
  const TypeEntry* entry = FindType(raw_type);
  if (entry == nullptr) {
    return Error(ErrorCode::kUnsupported, "unknown tensor type id {}", raw_type);
  }
  return entry->traits;
}

TypeTraits TraitsOf(GgmlType type) {
  const TypeEntry* entry = FindType(static_cast<uint32_t>(type));
  if (entry == nullptr) return TypeTraits{"unknown", 1, 1};
  return entry->traits;
}

const char* TypeName(GgmlType type) { return TraitsOf(type).name; }

const char* ValueTypeName(ValueType type) {
  switch (type) {
    case ValueType::kUint8:
      return "uint8";
    case ValueType::kInt8:
      return "int8";
    case ValueType::kUint16:
      return "uint16";
    case ValueType::kInt16:
      return "int16";
    case ValueType::kUint32:
      return "uint32";
    case ValueType::kInt32:
      return "int32";
    case ValueType::kFloat32:
      return "float32";
    case ValueType::kBool:
      return "bool";
    case ValueType::kString:
      return "string";
    case ValueType::kArray:
      return "array";
    case ValueType::kUint64:
      return "uint64";
    case ValueType::kInt64:
      return "int64";
    case ValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

int64_t TensorInfo::rows() const {
  int64_t count = 1;
  for (size_t i = 1; i < shape.size(); ++i) count *= shape[i];
  return count;
}

int64_t TensorInfo::row_length() const { return shape.empty() ? 0 : shape[0]; }

size_t TensorInfo::row_bytes() const {
  const TypeTraits traits = TraitsOf(type);
  return static_cast<size_t>(row_length() / traits.block_size * traits.type_size);
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) munmap(mapping_, size_);
}

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    return Error(error == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo, "cannot open '{}': {}",
                 path, std::strerror(error));
  }
  struct stat info {};
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    return Error(ErrorCode::kIo, "cannot stat '{}': {}", path, std::strerror(error));
  }
  if (!S_ISREG(info.st_mode)) {
    close(fd);
    return Error(ErrorCode::kInvalidArgument, "'{}' is not a regular file", path);
  }
  if (info.st_size == 0) {
    close(fd);
    return Error(ErrorCode::kCorrupt, "'{}' is empty, not a GGUF file", path);
  }
  const size_t size = static_cast<size_t>(info.st_size);
  void* mapping = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_error = errno;
  close(fd);
  if (mapping == MAP_FAILED) {
    return Error(ErrorCode::kIo, "cannot map '{}' ({} bytes): {}", path, size,
                 std::strerror(mmap_error));
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->mapping_ = mapping;
  file->base_ = static_cast<const uint8_t*>(mapping);
  file->size_ = size;
  Status status = file->Parse();
  if (!status.ok()) return Status(status.code(), fmt::format("{}: {}", path, status.message()));
  return file;
}

Result<std::unique_ptr<GgufFile>> GgufFile::FromBytes(std::span<const uint8_t> bytes) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->owned_.assign(bytes.begin(), bytes.end());
  file->base_ = file->owned_.data();
  file->size_ = file->owned_.size();
  SKV_RETURN_IF_ERROR(file->Parse());
  return file;
}

Status GgufFile::Parse() {
  if (size_ < 8) {
    return Error(ErrorCode::kCorrupt, "file is {} bytes, too small for a GGUF header", size_);
  }
  if (std::memcmp(base_, "GGUF", 4) != 0) {
    return Error(ErrorCode::kCorrupt,
                 "not a GGUF file: starts with bytes {:02x} {:02x} {:02x} {:02x} (expected "
                 "47 47 55 46, 'GGUF')",
                 base_[0], base_[1], base_[2], base_[3]);
  }
  Cursor cursor(base_, size_);
  uint32_t magic = 0;
  SKV_RETURN_IF_ERROR(cursor.Read(&magic, [] { return std::string("magic"); }));
  SKV_RETURN_IF_ERROR(cursor.Read(&version_, [] { return std::string("version"); }));
  if (version_ == 1) {
    return Error(ErrorCode::kUnsupported,
                 "GGUF version 1 is not supported (only versions 2 and 3 are)");
  }
  if (version_ != 0 && (version_ & 0xffffu) == 0) {
    return Error(ErrorCode::kUnsupported,
                 "GGUF file looks big-endian (version field reads 0x{:08x}); only little-endian "
                 "files are supported",
                 version_);
  }
  if (version_ != 2 && version_ != 3) {
    return Error(ErrorCode::kUnsupported,
                 "GGUF version {} is not supported (only versions 2 and 3 are)", version_);
  }
  uint64_t tensor_count = 0;
  uint64_t metadata_count = 0;
  SKV_RETURN_IF_ERROR(cursor.Read(&tensor_count, [] { return std::string("tensor count"); }));
  SKV_RETURN_IF_ERROR(
      cursor.Read(&metadata_count, [] { return std::string("metadata entry count"); }));
  if (metadata_count > cursor.remaining() / kMinMetadataEntryBytes) {
    return Error(ErrorCode::kCorrupt,
                 "header claims {} metadata entries but only {} bytes follow (each entry needs "
                 "at least {})",
                 metadata_count, cursor.remaining(), kMinMetadataEntryBytes);
  }

  if (metadata_count > kMaxMetadataValues) {
    return Error(ErrorCode::kResourceExhausted,
                 "header claims {} metadata entries; refusing to load more than {}", metadata_count,
                 kMaxMetadataValues);
  }
  uint64_t values_left = kMaxMetadataValues - metadata_count;
  metadata_.reserve(metadata_count);
  metadata_index_.reserve(metadata_count);
  for (uint64_t i = 0; i < metadata_count; ++i) {
    std::string key;
    SKV_RETURN_IF_ERROR(
        cursor.ReadString(&key, [&] { return fmt::format("metadata entry #{} key", i); }));
    if (key.empty()) return Error(ErrorCode::kCorrupt, "metadata entry #{} has an empty key", i);
    uint32_t raw_type = 0;
    SKV_RETURN_IF_ERROR(
        cursor.Read(&raw_type, [&] { return fmt::format("metadata key '{}' (value type)", key); }));
    if (raw_type > kLastValueType) {
      return Error(ErrorCode::kCorrupt, "metadata key '{}': unknown value type {}", key, raw_type);
    }
    Value value;
    ValuePath path{key, {}, &values_left};
    SKV_RETURN_IF_ERROR(ReadValue(cursor, static_cast<ValueType>(raw_type), 0, path, &value));
    const auto [it, inserted] = metadata_index_.emplace(key, metadata_.size());
    if (!inserted) {
      return Error(ErrorCode::kCorrupt, "metadata key '{}' appears twice (entries #{} and #{})",
                   key, it->second, i);
    }
    metadata_.emplace_back(std::move(key), std::move(value));
  }

  alignment_ = kDefaultAlignment;
  if (const Value* alignment = Find("general.alignment")) {
    if (!IsInteger(alignment->type)) {
      return Error(ErrorCode::kCorrupt, "general.alignment has type {}; it must be an integer",
                   DescribeType(*alignment));
    }
    int64_t requested = 0;
    if (!IntegerToInt64(*alignment, &requested) || requested <= 0 ||
        (requested & (requested - 1)) != 0) {
      return Error(ErrorCode::kCorrupt,
                   "general.alignment is {}; it must be a nonzero power of two",
                   ValueText(*alignment));
    }
    alignment_ = static_cast<uint64_t>(requested);
  }

  if (tensor_count > cursor.remaining() / kMinTensorInfoBytes) {
    return Error(ErrorCode::kCorrupt,
                 "header claims {} tensors but only {} bytes follow the metadata (each tensor "
                 "info needs at least {})",
                 tensor_count, cursor.remaining(), kMinTensorInfoBytes);
  }
  if (tensor_count > kMaxTensors) {
    return Error(ErrorCode::kResourceExhausted,
                 "header claims {} tensors; refusing to load more than {}", tensor_count,
                 kMaxTensors);
  }
  tensors_.reserve(tensor_count);
  tensor_index_.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    TensorInfo tensor;
    SKV_RETURN_IF_ERROR(
        cursor.ReadString(&tensor.name, [&] { return fmt::format("tensor #{} name", i); }));
    if (tensor.name.empty()) return Error(ErrorCode::kCorrupt, "tensor #{} has an empty name", i);
    const std::string& name = tensor.name;
    uint32_t num_dims = 0;
    SKV_RETURN_IF_ERROR(
        cursor.Read(&num_dims, [&] { return fmt::format("tensor '{}' dimension count", name); }));
    if (num_dims == 0 || num_dims > kMaxDims) {
      return Error(ErrorCode::kCorrupt, "tensor '{}' has {} dimensions (1 to {} are allowed)", name,
                   num_dims, kMaxDims);
    }
    int64_t num_elements = 1;
    for (uint32_t d = 0; d < num_dims; ++d) {
      uint64_t dim = 0;
      SKV_RETURN_IF_ERROR(
          cursor.Read(&dim, [&] { return fmt::format("tensor '{}' dimension {}", name, d); }));
      if (dim == 0 || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(ErrorCode::kCorrupt,
                     "tensor '{}': dimension {} is {} (must be positive and at most 2^63 - 1)",
                     name, d, dim);
      }
      const auto extent = static_cast<int64_t>(dim);
      if (num_elements > std::numeric_limits<int64_t>::max() / extent) {
        return Error(ErrorCode::kCorrupt, "tensor '{}': element count overflows at dimension {}",
                     name, d);
      }
      num_elements *= extent;
      tensor.shape.push_back(extent);
    }
    tensor.num_elements = num_elements;
    uint32_t raw_type = 0;
    SKV_RETURN_IF_ERROR(
        cursor.Read(&raw_type, [&] { return fmt::format("tensor '{}' type", name); }));
    Result<TypeTraits> traits = GetTypeTraits(raw_type);
    if (!traits.ok()) {
      return Status(traits.status().code(),
                    fmt::format("tensor '{}': {}", name, traits.status().message()));
    }
    tensor.type = static_cast<GgmlType>(raw_type);
    SKV_RETURN_IF_ERROR(
        cursor.Read(&tensor.offset, [&] { return fmt::format("tensor '{}' offset", name); }));
    if (tensor.shape[0] % traits->block_size != 0) {
      return Error(ErrorCode::kCorrupt,
                   "tensor '{}': row length {} is not a multiple of the {} block size {}", name,
                   tensor.shape[0], traits->name, traits->block_size);
    }
    const uint64_t num_blocks = static_cast<uint64_t>(num_elements / traits->block_size);
    const auto type_size = static_cast<uint64_t>(traits->type_size);
    if (num_blocks > std::numeric_limits<uint64_t>::max() / type_size) {
      return Error(ErrorCode::kCorrupt, "tensor '{}': byte size overflows", name);
    }
    tensor.size_bytes = num_blocks * type_size;
    if (tensor.offset % alignment_ != 0) {
      return Error(ErrorCode::kCorrupt,
                   "tensor '{}': offset {} is not a multiple of the alignment {}", name,
                   tensor.offset, alignment_);
    }
    const auto [it, inserted] = tensor_index_.emplace(tensor.name, tensors_.size());
    if (!inserted) {
      return Error(ErrorCode::kCorrupt, "tensor '{}' appears twice (tensors #{} and #{})", name,
                   it->second, i);
    }
    tensors_.push_back(std::move(tensor));
  }

  if (!AlignUp(cursor.position(), alignment_, &data_offset_)) {
    return Error(ErrorCode::kCorrupt, "data section offset overflows with alignment {}",
                 alignment_);
  }
  for (TensorInfo& tensor : tensors_) {
    const uint64_t start = data_offset_ + tensor.offset;
    if (start < data_offset_ || start > size_ || tensor.size_bytes > size_ - start) {
      return Error(ErrorCode::kCorrupt,
                   "tensor '{}': data [offset {}, size {}) runs past the end of the file (size "
                   "{})",
                   tensor.name, start < data_offset_ ? tensor.offset : start, tensor.size_bytes,
                   size_);
    }
    tensor.data = base_ + start;
  }

  // Tensors may come in any order but must not share bytes.
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors_.size());
  for (const TensorInfo& tensor : tensors_) by_offset.push_back(&tensor);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& previous = *by_offset[i - 1];
    const TensorInfo& current = *by_offset[i];
    if (previous.offset + previous.size_bytes > current.offset) {
      return Error(ErrorCode::kCorrupt,
                   "tensor '{}': data [offset {}, size {}) overlaps tensor '{}' [offset {}, size "
                   "{})",
                   current.name, data_offset_ + current.offset, current.size_bytes, previous.name,
                   data_offset_ + previous.offset, previous.size_bytes);
    }
  }
  return Status::Ok();
}

const Value* GgufFile::Find(std::string_view key) const {
  const auto it = metadata_index_.find(std::string(key));
  return it == metadata_index_.end() ? nullptr : &metadata_[it->second].second;
}

const TensorInfo* GgufFile::FindTensor(std::string_view name) const {
  const auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

Result<const Value*> Require(const GgufFile& file, std::string_view key) {
  const Value* value = file.Find(key);
  if (value == nullptr) return Error(ErrorCode::kNotFound, "metadata key '{}' not found", key);
  return value;
}

Status WrongType(std::string_view key, const Value& value, std::string_view expected) {
  return Error(ErrorCode::kCorrupt, "metadata key '{}' has type {}, expected {}", key,
               DescribeType(value), expected);
}

bool IsFloat(ValueType type) { return type == ValueType::kFloat32 || type == ValueType::kFloat64; }

double NumberToDouble(const Value& value) {
  if (const auto* unsigned_value = std::get_if<uint64_t>(&value.data)) {
    return static_cast<double>(*unsigned_value);
  }
  if (const auto* signed_value = std::get_if<int64_t>(&value.data)) {
    return static_cast<double>(*signed_value);
  }
  return std::get<double>(value.data);
}

}  // namespace

Result<std::string> GgufFile::GetString(std::string_view key) const {
  SKV_ASSIGN_OR_RETURN(const Value* value, Require(*this, key));
  if (value->type != ValueType::kString) return WrongType(key, *value, "a string");
  return std::get<std::string>(value->data);
}

Result<int64_t> GgufFile::GetInt(std::string_view key) const {
  SKV_ASSIGN_OR_RETURN(const Value* value, Require(*this, key));
  if (!IsInteger(value->type)) return WrongType(key, *value, "an integer");
  int64_t result = 0;
  if (!IntegerToInt64(*value, &result)) {
    return Error(ErrorCode::kOutOfRange, "metadata key '{}' is {}, which does not fit in int64",
                 key, ValueText(*value));
  }
  return result;
}

Result<double> GgufFile::GetFloat(std::string_view key) const {
  SKV_ASSIGN_OR_RETURN(const Value* value, Require(*this, key));
  if (!IsFloat(value->type) && !IsInteger(value->type)) return WrongType(key, *value, "a number");
  return NumberToDouble(*value);
}

Result<bool> GgufFile::GetBool(std::string_view key) const {
  SKV_ASSIGN_OR_RETURN(const Value* value, Require(*this, key));
  if (value->type != ValueType::kBool) return WrongType(key, *value, "a bool");
  return std::get<bool>(value->data);
}

Result<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
  SKV_ASSIGN_OR_RETURN(const Value* value, Require(*this, key));
  if (value->type != ValueType::kArray || value->element_type != ValueType::kString) {
    return WrongType(key, *value, "an array of string");
  }
  std::vector<std::string> result;
  const auto& elements = std::get<std::vector<Value>>(value->data);
  result.reserve(elements.size());
  for (const Value& element : elements) result.push_back(std::get<std::string>(element.data));
  return result;
}

Result<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  SKV_ASSIGN_OR_RETURN(const Value* value, Require(*this, key));
  if (value->type != ValueType::kArray || !IsInteger(value->element_type)) {
    return WrongType(key, *value, "an array of integers");
  }
  const auto& elements = std::get<std::vector<Value>>(value->data);
  std::vector<int64_t> result(elements.size());
  for (size_t i = 0; i < elements.size(); ++i) {
    if (!IntegerToInt64(elements[i], &result[i])) {
      return Error(ErrorCode::kOutOfRange,
                   "metadata key '{}' element [{}] is {}, which does not fit in int64", key, i,
                   ValueText(elements[i]));
    }
  }
  return result;
}

Result<std::vector<float>> GgufFile::GetFloatArray(std::string_view key) const {
  SKV_ASSIGN_OR_RETURN(const Value* value, Require(*this, key));
  if (value->type != ValueType::kArray ||
      (!IsFloat(value->element_type) && !IsInteger(value->element_type))) {
    return WrongType(key, *value, "an array of numbers");
  }
  const auto& elements = std::get<std::vector<Value>>(value->data);
  std::vector<float> result(elements.size());
  for (size_t i = 0; i < elements.size(); ++i) {
    result[i] = static_cast<float>(NumberToDouble(elements[i]));
  }
  return result;
}

}  // namespace shadowkv::gguf
