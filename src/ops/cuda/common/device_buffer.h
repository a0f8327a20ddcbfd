// DeviceBuffer<T>: one owned device allocation; running out of memory is a Status, not an abort.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "ops/cuda/common/cuda_check.h"

namespace shadowkv::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }

  // Frees what the buffer held, then allocates `count` elements (uninitialised).
  Status Allocate(int64_t count) {
    Reset();
    if (count <= 0) return Status::Ok();
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, static_cast<size_t>(count) * sizeof(T));
    if (error != cudaSuccess) {
      Status status = CudaStatus(error, "cudaMalloc", __FILE__, __LINE__);
      if (status.code() != ErrorCode::kResourceExhausted) return status;
      return Error(ErrorCode::kResourceExhausted, "out of GPU memory allocating {:.3f} GiB",
                   static_cast<double>(count) * sizeof(T) / (1 << 30));
    }
    data_ = static_cast<T*>(data);
    count_ = count;
    return Status::Ok();
  }
  void Reset() {
    if (data_) (void)cudaFree(data_);
    data_ = nullptr;
    count_ = 0;
  }

  T* get() const { return data_; }
  int64_t size() const { return count_; }
  int64_t bytes() const { return count_ * static_cast<int64_t>(sizeof(T)); }

 private:
  T* data_ = nullptr;
  int64_t count_ = 0;
};

}  // namespace shadowkv::cuda
