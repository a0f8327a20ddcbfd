// ValueStore: ShadowKV's slow tier on the CPU, fixed-size runs of values in RAM or in a file.
//
// A run is one chunk of one KV head (chunk_size * head_dim floats), so a selected chunk is one
// contiguous read. Runs are only appended, never changed; ids are consecutive from 0. The file
// form (an unlinked temporary file, pwrite/pread) lets the values of long contexts live on disk
// and in the page cache rather than in process memory. Used by one thread at a time.
//
// Runs are stored as fp32 (4 bytes a value) or as FP8 e4m3 (core/fp8.h): one byte a value and the
// run's fp32 scale after its codes, quantised by QuantizeFp8Run (the rule the CUDA kernels use
// per chunk and KV head) and read back dequantised, so Read returns what a GPU reader of the same
// run would get.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace shadowkv::kv {

enum class ValueFormat { kFp32, kFp8E4m3 };

class ValueStore {
 public:
  // run_floats: floats per run. directory empty: RAM; else a file created in `directory`.
  static Result<std::unique_ptr<ValueStore>> Create(int64_t run_floats,
                                                    const std::string& directory,
                                                    ValueFormat format = ValueFormat::kFp32);
  ~ValueStore();
  ValueStore(const ValueStore&) = delete;
  ValueStore& operator=(const ValueStore&) = delete;

  // Appends `count` runs stored back to back at `runs`; returns the id of the first.
  Result<int64_t> Append(const float* runs, int64_t count);
  // Copies run `id` into out [run_floats] (dequantised in the FP8 format).
  Status Read(int64_t id, float* out) const;

  int64_t run_floats() const { return run_floats_; }
  ValueFormat format() const { return format_; }
  // Bytes one stored run takes: run_floats * 4, or run_floats + 4 (codes and scale) in FP8.
  int64_t run_bytes() const { return run_bytes_; }
  static int64_t RunBytes(int64_t run_floats, ValueFormat format) {
    return format == ValueFormat::kFp8E4m3 ? run_floats + static_cast<int64_t>(sizeof(float))
                                           : run_floats * static_cast<int64_t>(sizeof(float));
  }
  int64_t num_runs() const { return num_runs_; }
  int64_t bytes() const { return num_runs_ * run_bytes_; }
  bool file_backed() const { return fd_ >= 0; }

 private:
  ValueStore(int64_t run_floats, ValueFormat format, int fd);
  // Stored form of one run of floats into `bytes` [run_bytes].
  void Encode(const float* run, uint8_t* bytes) const;
  void Decode(const uint8_t* bytes, float* out) const;

  int64_t run_floats_;
  ValueFormat format_;
  int64_t run_bytes_;
  int64_t num_runs_ = 0;
  int fd_ = -1;  // the unlinked backing file, or -1 for RAM
  // RAM form: fixed-size blocks, so growing never copies what is stored.
  int64_t runs_per_block_ = 0;
  std::vector<std::unique_ptr<uint8_t[]>> blocks_;
  // Encoded runs on their way to or from the file (FP8 only).
  std::vector<uint8_t> encoded_;
  mutable std::vector<uint8_t> read_buffer_;
};

}  // namespace shadowkv::kv
