// ValueStore in RAM blocks or an unlinked temporary file (pwrite/pread).
#include "kv/value_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace shadowkv::kv {
namespace {

constexpr int64_t kBlockBytes = 1 << 20;  // RAM block size

Status IoError(const char* what, int error) {
  const ErrorCode code =
      (error == ENOSPC || error == EDQUOT) ? ErrorCode::kResourceExhausted : ErrorCode::kIo;
  return Error(code, "value store: {} failed: {}", what, std::strerror(error));
}

}  // namespace

ValueStore::ValueStore(int64_t run_floats, int fd) : run_floats_(run_floats), fd_(fd) {
  const int64_t run_bytes = run_floats_ * static_cast<int64_t>(sizeof(float));
  runs_per_block_ = std::max<int64_t>(1, kBlockBytes / run_bytes);
}

ValueStore::~ValueStore() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<ValueStore>> ValueStore::Create(int64_t run_floats,
                                                       const std::string& directory) {
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
  return std::unique_ptr<ValueStore>(new ValueStore(run_floats, fd));
}

Result<int64_t> ValueStore::Append(const float* runs, int64_t count) {
  const int64_t first = num_runs_;
  if (count <= 0) return first;
  if (fd_ >= 0) {
    const auto* bytes = reinterpret_cast<const char*>(runs);
    const int64_t run_bytes = run_floats_ * static_cast<int64_t>(sizeof(float));
    int64_t remaining = count * run_bytes;
    off_t offset = static_cast<off_t>(first * run_bytes);
    while (remaining > 0) {
      const ssize_t written = ::pwrite(fd_, bytes, static_cast<size_t>(remaining), offset);
      if (written < 0) {
        if (errno == EINTR) continue;
        return IoError("write", errno);
      }
      if (written == 0) return IoError("write", ENOSPC);
      bytes += written;
      offset += written;
      remaining -= written;
    }
  } else {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = first + i;
      const auto block = static_cast<size_t>(id / runs_per_block_);
      if (block == blocks_.size()) {
        blocks_.push_back(std::make_unique_for_overwrite<float[]>(runs_per_block_ * run_floats_));
      }
      std::memcpy(blocks_[block].get() + (id % runs_per_block_) * run_floats_,
                  runs + i * run_floats_, run_floats_ * sizeof(float));
    }
  }
  num_runs_ += count;
  return first;
}

Status ValueStore::Read(int64_t id, float* out) const {
  if (id < 0 || id >= num_runs_) {
    return Error(ErrorCode::kInternal, "value run {} of {} does not exist", id, num_runs_);
  }
  const int64_t run_bytes = run_floats_ * static_cast<int64_t>(sizeof(float));
  if (fd_ < 0) {
    std::memcpy(out, blocks_[id / runs_per_block_].get() + (id % runs_per_block_) * run_floats_,
                run_bytes);
    return Status::Ok();
  }
  auto* bytes = reinterpret_cast<char*>(out);
  int64_t remaining = run_bytes;
  off_t offset = static_cast<off_t>(id * run_bytes);
  while (remaining > 0) {
    const ssize_t got = ::pread(fd_, bytes, static_cast<size_t>(remaining), offset);
    if (got < 0) {
      if (errno == EINTR) continue;
      return IoError("read", errno);
    }
    if (got == 0) return Error(ErrorCode::kIo, "value store: file ended inside run {}", id);
    bytes += got;
    offset += got;
    remaining -= got;
  }
  return Status::Ok();
}

}  // namespace shadowkv::kv
