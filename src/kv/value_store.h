// ValueStore: ShadowKV's slow tier on the CPU, fixed-size runs of values in RAM or in a file.
//
// A run is one chunk of one KV head (chunk_size * head_dim floats), so a selected chunk is one
// contiguous read. Runs are only appended, never changed; ids are consecutive from 0. The file
// form (an unlinked temporary file, pwrite/pread) lets the values of long contexts live on disk
// and in the page cache rather than in process memory. Used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace shadowkv::kv {

class ValueStore {
 public:
  // run_floats: floats per run. directory empty: RAM; else a file created in `directory`.
  static Result<std::unique_ptr<ValueStore>> Create(int64_t run_floats,
                                                    const std::string& directory);
  ~ValueStore();
  ValueStore(const ValueStore&) = delete;
  ValueStore& operator=(const ValueStore&) = delete;

  // Appends `count` runs stored back to back at `runs`; returns the id of the first.
  Result<int64_t> Append(const float* runs, int64_t count);
  // Copies run `id` into out [run_floats].
  Status Read(int64_t id, float* out) const;

  int64_t run_floats() const { return run_floats_; }
  int64_t num_runs() const { return num_runs_; }
  int64_t bytes() const { return num_runs_ * run_floats_ * static_cast<int64_t>(sizeof(float)); }
  bool file_backed() const { return fd_ >= 0; }

 private:
  ValueStore(int64_t run_floats, int fd);

  int64_t run_floats_;
  int64_t num_runs_ = 0;
  int fd_ = -1;  // the unlinked backing file, or -1 for RAM
  // RAM form: fixed-size blocks, so growing never copies what is stored.
  int64_t runs_per_block_ = 0;
  std::vector<std::unique_ptr<float[]>> blocks_;
};

}  // namespace shadowkv::kv
