// ValueStore in RAM blocks or an unlinked temporary file (pwrite/pread), fp32 or FP8 runs.
#include "kv/value_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/fp8.h"

namespace shadowkv::kv {
namespace {

constexpr int64_t kBlockBytes = 1 << 20;  // RAM block size

Status IoError(const char* what, int error) {
  const ErrorCode code =
      (error == ENOSPC || error == EDQUOT) ? ErrorCode::kResourceExhausted : ErrorCode::kIo;
  return Error(code, "value store: {} failed: {}", what, std::strerror(error));
}

Status WriteAll(int fd, const uint8_t* bytes, int64_t size, off_t offset) {
  while (size > 0) {
    const ssize_t written = ::pwrite(fd, bytes, static_cast<size_t>(size), offset);
    if (written < 0) {
      if (errno == EINTR) continue;
      return IoError("write", errno);
    }
    if (written == 0) return IoError("write", ENOSPC);
    bytes += written;
    offset += written;
    size -= written;
  }
  return Status::Ok();
}

Status ReadAll(int fd, uint8_t* bytes, int64_t size, off_t offset, int64_t id) {
  while (size > 0) {
    const ssize_t got = ::pread(fd, bytes, static_cast<size_t>(size), offset);
    if (got < 0) {
      if (errno == EINTR) continue;
      return IoError("read", errno);
    }
    if (got == 0) return Error(ErrorCode::kIo, "value store: file ended inside run {}", id);
    bytes += got;
    offset += got;
    size -= got;
  }
  return Status::Ok();
}

}  // namespace

ValueStore::ValueStore(int64_t run_floats, ValueFormat format, int fd)
    : run_floats_(run_floats), format_(format), run_bytes_(RunBytes(run_floats, format)), fd_(fd) {
  runs_per_block_ = std::max<int64_t>(1, kBlockBytes / run_bytes_);
}

ValueStore::~ValueStore() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<ValueStore>> ValueStore::Create(int64_t run_floats,
                                                       const std::string& directory,
                                                       ValueFormat format) {
  if (run_floats <= 0) {
    return Error(ErrorCode::kInvalidArgument, "value store runs of {} floats", run_floats);
  }
  int fd = -1;
  if (!directory.empty()) {
    std::string path = directory + "/shadowkv-values-XXXXXX";
    fd = ::mkstemp(path.data());
    if (fd < 0) {
      const int error = errno;
      return Error(ErrorCode::kIo, "cannot create a value file in '{}': {}", directory,
                   std::strerror(error));
    }
    // Unlinked at once: the space goes back to the system when the sequence ends or we crash.
    ::unlink(path.c_str());
  }
  return std::unique_ptr<ValueStore>(new ValueStore(run_floats, format, fd));
}

// FP8 run: run_floats codes, then the fp32 scale.
void ValueStore::Encode(const float* run, uint8_t* bytes) const {
  if (format_ == ValueFormat::kFp32) {
    std::memcpy(bytes, run, run_bytes_);
    return;
  }
  const float scale = QuantizeFp8Run(run, run_floats_, bytes);
  std::memcpy(bytes + run_floats_, &scale, sizeof(scale));
}

void ValueStore::Decode(const uint8_t* bytes, float* out) const {
  if (format_ == ValueFormat::kFp32) {
    std::memcpy(out, bytes, run_bytes_);
    return;
  }
  float scale;
  std::memcpy(&scale, bytes + run_floats_, sizeof(scale));
  DequantizeFp8Run(bytes, run_floats_, scale, out);
}

Result<int64_t> ValueStore::Append(const float* runs, int64_t count) {
  const int64_t first = num_runs_;
  if (count <= 0) return first;
  if (fd_ >= 0) {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(runs);
    if (format_ != ValueFormat::kFp32) {
      encoded_.resize(static_cast<size_t>(count * run_bytes_));
      for (int64_t i = 0; i < count; ++i) {
        Encode(runs + i * run_floats_, encoded_.data() + i * run_bytes_);
      }
      bytes = encoded_.data();
    }
    SKV_RETURN_IF_ERROR(
        WriteAll(fd_, bytes, count * run_bytes_, static_cast<off_t>(first * run_bytes_)));
  } else {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = first + i;
      const auto block = static_cast<size_t>(id / runs_per_block_);
      if (block == blocks_.size()) {
        blocks_.push_back(std::make_unique_for_overwrite<uint8_t[]>(runs_per_block_ * run_bytes_));
      }
      Encode(runs + i * run_floats_, blocks_[block].get() + (id % runs_per_block_) * run_bytes_);
    }
  }
  num_runs_ += count;
  return first;
}

Status ValueStore::Read(int64_t id, float* out) const {
  if (id < 0 || id >= num_runs_) {
    return Error(ErrorCode::kInternal, "value run {} of {} does not exist", id, num_runs_);
  }
  if (fd_ < 0) {
    Decode(blocks_[id / runs_per_block_].get() + (id % runs_per_block_) * run_bytes_, out);
    return Status::Ok();
  }
  const off_t offset = static_cast<off_t>(id * run_bytes_);
  if (format_ == ValueFormat::kFp32) {
    return ReadAll(fd_, reinterpret_cast<uint8_t*>(out), run_bytes_, offset, id);
  }
  read_buffer_.resize(static_cast<size_t>(run_bytes_));
  SKV_RETURN_IF_ERROR(ReadAll(fd_, read_buffer_.data(), run_bytes_, offset, id));
  Decode(read_buffer_.data(), out);
  return Status::Ok();
}

}  // namespace shadowkv::kv
