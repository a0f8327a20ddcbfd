// GgufWriter: serialises metadata, tensor infos and aligned tensor data in GGUF v3 layout.
#include "format/gguf_writer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/check.h"
#include "format/quants.h"

namespace shadowkv::gguf {
namespace {

class ByteSink {
 public:
  explicit ByteSink(std::vector<uint8_t>* out) : out_(out) {}

  template <typename T>
  void Put(T value) {
    const size_t old_size = out_->size();
    out_->resize(old_size + sizeof(T));
    std::memcpy(out_->data() + old_size, &value, sizeof(T));
  }
  void PutString(const std::string& text) {
    Put<uint64_t>(text.size());
    out_->insert(out_->end(), text.begin(), text.end());
  }
  void PadTo(uint64_t alignment) {
    while (out_->size() % alignment != 0) out_->push_back(0);
  }

 private:
  std::vector<uint8_t>* out_;
};

uint64_t AsUnsigned(const Value& value) { return std::get<uint64_t>(value.data); }
int64_t AsSigned(const Value& value) { return std::get<int64_t>(value.data); }

// Values are checked by AddValue (or built by the typed Add* calls), so the variant matches.
void PutValue(ByteSink& sink, const Value& value) {
  switch (value.type) {
    case ValueType::kUint8:
      sink.Put(static_cast<uint8_t>(AsUnsigned(value)));
      break;
    case ValueType::kInt8:
      sink.Put(static_cast<int8_t>(AsSigned(value)));
      break;
    case ValueType::kUint16:
      sink.Put(static_cast<uint16_t>(AsUnsigned(value)));
      break;
    case ValueType::kInt16:
      sink.Put(static_cast<int16_t>(AsSigned(value)));
      break;
    case ValueType::kUint32:
      sink.Put(static_cast<uint32_t>(AsUnsigned(value)));
      break;
    case ValueType::kInt32:
      sink.Put(static_cast<int32_t>(AsSigned(value)));
      break;
    case ValueType::kUint64:
      sink.Put(AsUnsigned(value));
      break;
    case ValueType::kInt64:
      sink.Put(AsSigned(value));
      break;
    case ValueType::kFloat32:
      sink.Put(static_cast<float>(std::get<double>(value.data)));
      break;
    case ValueType::kFloat64:
      sink.Put(std::get<double>(value.data));
      break;
    case ValueType::kBool:
      sink.Put(static_cast<uint8_t>(std::get<bool>(value.data)));
      break;
    case ValueType::kString:
      sink.PutString(std::get<std::string>(value.data));
      break;
    case ValueType::kArray: {
      const auto& elements = std::get<std::vector<Value>>(value.data);
      sink.Put(static_cast<uint32_t>(value.element_type));
      sink.Put<uint64_t>(elements.size());
      for (const Value& element : elements) PutValue(sink, element);
      break;
    }
  }
}

Status CheckValue(const Value& value) {
  bool holds = false;
  switch (value.type) {
    case ValueType::kUint8:
    case ValueType::kUint16:
    case ValueType::kUint32:
    case ValueType::kUint64:
      holds = std::holds_alternative<uint64_t>(value.data);
      break;
    case ValueType::kInt8:
    case ValueType::kInt16:
    case ValueType::kInt32:
    case ValueType::kInt64:
      holds = std::holds_alternative<int64_t>(value.data);
      break;
    case ValueType::kFloat32:
    case ValueType::kFloat64:
      holds = std::holds_alternative<double>(value.data);
      break;
    case ValueType::kBool:
      holds = std::holds_alternative<bool>(value.data);
      break;
    case ValueType::kString:
      holds = std::holds_alternative<std::string>(value.data);
      break;
    case ValueType::kArray: {
      const auto* elements = std::get_if<std::vector<Value>>(&value.data);
      if (elements == nullptr) break;
      for (const Value& element : *elements) {
        if (element.type != value.element_type) {
          return Error(ErrorCode::kInvalidArgument, "array of {} holds a {}",
                       ValueTypeName(value.element_type), ValueTypeName(element.type));
        }
        SKV_RETURN_IF_ERROR(CheckValue(element));
      }
      holds = true;
      break;
    }
  }
  if (!holds) {
    return Error(ErrorCode::kInvalidArgument, "value of type {} holds another kind of data",
                 ValueTypeName(value.type));
  }
  return Status::Ok();
}

Result<uint64_t> TensorBytes(const std::string& name, const std::vector<int64_t>& shape,
                             GgmlType type) {
  if (shape.empty() || shape.size() > 4) {
    return Error(ErrorCode::kInvalidArgument, "tensor '{}': {} dimensions (1 to 4 allowed)", name,
                 shape.size());
  }
  int64_t num_elements = 1;
  for (int64_t extent : shape) {
    if (extent <= 0) {
      return Error(ErrorCode::kInvalidArgument, "tensor '{}': dimension {} is not positive", name,
                   extent);
    }
    num_elements *= extent;
  }
  const TypeTraits traits = TraitsOf(type);
  if (shape[0] % traits.block_size != 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "tensor '{}': row length {} is not a multiple of the {} block size {}", name,
                 shape[0], traits.name, traits.block_size);
  }
  return static_cast<uint64_t>(num_elements / traits.block_size * traits.type_size);
}

}  // namespace

Value MakeUint(ValueType type, uint64_t value) { return Value{type, value, ValueType::kUint8}; }
Value MakeInt(ValueType type, int64_t value) { return Value{type, value, ValueType::kUint8}; }
Value MakeFloat(ValueType type, double value) { return Value{type, value, ValueType::kUint8}; }
Value MakeBool(bool value) { return Value{ValueType::kBool, value, ValueType::kUint8}; }
Value MakeString(std::string value) {
  return Value{ValueType::kString, std::move(value), ValueType::kUint8};
}
Value MakeArray(ValueType element_type, std::vector<Value> elements) {
  return Value{ValueType::kArray, std::move(elements), element_type};
}

GgufWriter::GgufWriter(uint64_t alignment) : alignment_(alignment) {
  SKV_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0);
  if (alignment != 32) AddUint32("general.alignment", static_cast<uint32_t>(alignment));
}

void GgufWriter::AddUint8(std::string key, uint8_t value) {
  metadata_.emplace_back(std::move(key), MakeUint(ValueType::kUint8, value));
}
void GgufWriter::AddInt8(std::string key, int8_t value) {
  metadata_.emplace_back(std::move(key), MakeInt(ValueType::kInt8, value));
}
void GgufWriter::AddUint16(std::string key, uint16_t value) {
  metadata_.emplace_back(std::move(key), MakeUint(ValueType::kUint16, value));
}
void GgufWriter::AddInt16(std::string key, int16_t value) {
  metadata_.emplace_back(std::move(key), MakeInt(ValueType::kInt16, value));
}
void GgufWriter::AddUint32(std::string key, uint32_t value) {
  metadata_.emplace_back(std::move(key), MakeUint(ValueType::kUint32, value));
}
void GgufWriter::AddInt32(std::string key, int32_t value) {
  metadata_.emplace_back(std::move(key), MakeInt(ValueType::kInt32, value));
}
void GgufWriter::AddUint64(std::string key, uint64_t value) {
  metadata_.emplace_back(std::move(key), MakeUint(ValueType::kUint64, value));
}
void GgufWriter::AddInt64(std::string key, int64_t value) {
  metadata_.emplace_back(std::move(key), MakeInt(ValueType::kInt64, value));
}
void GgufWriter::AddFloat32(std::string key, float value) {
  metadata_.emplace_back(std::move(key), MakeFloat(ValueType::kFloat32, value));
}
void GgufWriter::AddFloat64(std::string key, double value) {
  metadata_.emplace_back(std::move(key), MakeFloat(ValueType::kFloat64, value));
}
void GgufWriter::AddBool(std::string key, bool value) {
  metadata_.emplace_back(std::move(key), MakeBool(value));
}
void GgufWriter::AddString(std::string key, std::string value) {
  metadata_.emplace_back(std::move(key), MakeString(std::move(value)));
}

void GgufWriter::AddStringArray(std::string key, const std::vector<std::string>& values) {
  std::vector<Value> elements;
  elements.reserve(values.size());
  for (const std::string& value : values) elements.push_back(MakeString(value));
  metadata_.emplace_back(std::move(key), MakeArray(ValueType::kString, std::move(elements)));
}

void GgufWriter::AddInt32Array(std::string key, const std::vector<int32_t>& values) {
  std::vector<Value> elements;
  elements.reserve(values.size());
  for (int32_t value : values) elements.push_back(MakeInt(ValueType::kInt32, value));
  metadata_.emplace_back(std::move(key), MakeArray(ValueType::kInt32, std::move(elements)));
}

void GgufWriter::AddFloat32Array(std::string key, const std::vector<float>& values) {
  std::vector<Value> elements;
  elements.reserve(values.size());
  for (float value : values) elements.push_back(MakeFloat(ValueType::kFloat32, value));
  metadata_.emplace_back(std::move(key), MakeArray(ValueType::kFloat32, std::move(elements)));
}

Status GgufWriter::AddValue(std::string key, Value value) {
  const Status status = CheckValue(value);
  if (!status.ok()) {
    return Status(status.code(), fmt::format("metadata key '{}': {}", key, status.message()));
  }
  metadata_.emplace_back(std::move(key), std::move(value));
  return Status::Ok();
}

Status GgufWriter::AddTensor(std::string name, std::vector<int64_t> shape, GgmlType type,
                             std::vector<uint8_t> data) {
  SKV_ASSIGN_OR_RETURN(const uint64_t size_bytes, TensorBytes(name, shape, type));
  if (data.size() != size_bytes) {
    return Error(ErrorCode::kInvalidArgument, "tensor '{}': {} bytes given, {} needed", name,
                 data.size(), size_bytes);
  }
  tensors_.push_back(PendingTensor{std::move(name), std::move(shape), type, std::move(data)});
  return Status::Ok();
}

Status GgufWriter::AddTensorFromFloats(std::string name, std::vector<int64_t> shape, GgmlType type,
                                       std::span<const float> values) {
  SKV_ASSIGN_OR_RETURN(const uint64_t size_bytes, TensorBytes(name, shape, type));
  int64_t num_elements = 1;
  for (int64_t extent : shape) num_elements *= extent;
  if (static_cast<int64_t>(values.size()) != num_elements) {
    return Error(ErrorCode::kInvalidArgument, "tensor '{}': {} values given, {} needed", name,
                 values.size(), num_elements);
  }
  std::vector<uint8_t> data(size_bytes);
  const Status status = QuantizeRow(type, values.data(), data.data(), num_elements);
  if (!status.ok()) {
    return Status(status.code(), fmt::format("tensor '{}': {}", name, status.message()));
  }
  tensors_.push_back(PendingTensor{std::move(name), std::move(shape), type, std::move(data)});
  return Status::Ok();
}

std::vector<uint8_t> GgufWriter::Finish() const {
  std::vector<uint8_t> image;
  ByteSink sink(&image);
  sink.Put<uint32_t>(0x46554747);  // "GGUF" as little-endian bytes
  sink.Put<uint32_t>(version_);
  sink.Put<uint64_t>(tensors_.size());
  sink.Put<uint64_t>(metadata_.size());
  for (const auto& [key, value] : metadata_) {
    sink.PutString(key);
    sink.Put(static_cast<uint32_t>(value.type));
    PutValue(sink, value);
  }
  uint64_t offset = 0;
  for (const PendingTensor& tensor : tensors_) {
    sink.PutString(tensor.name);
    sink.Put<uint32_t>(static_cast<uint32_t>(tensor.shape.size()));
    for (int64_t extent : tensor.shape) sink.Put<uint64_t>(static_cast<uint64_t>(extent));
    sink.Put(static_cast<uint32_t>(tensor.type));
    sink.Put<uint64_t>(offset);
    offset += (tensor.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  sink.PadTo(alignment_);
  for (const PendingTensor& tensor : tensors_) {
    image.insert(image.end(), tensor.data.begin(), tensor.data.end());
    sink.PadTo(alignment_);
  }
  return image;
}

Status GgufWriter::WriteFile(const std::string& path) const {
  const std::vector<uint8_t> image = Finish();
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) {
    return Error(ErrorCode::kIo, "cannot create '{}': {}", path, std::strerror(errno));
  }
  const size_t written = std::fwrite(image.data(), 1, image.size(), file);
  const bool closed = std::fclose(file) == 0;
  if (written != image.size() || !closed) {
    return Error(ErrorCode::kIo, "cannot write {} bytes to '{}'", image.size(), path);
  }
  return Status::Ok();
}

}  // namespace shadowkv::gguf
