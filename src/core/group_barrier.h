// GroupBarrier: `size` threads meet, round after round; an abort releases those waiting, and
// every later arrival, with an error (so a group whose member failed does not wait for it).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "core/status.h"

namespace shadowkv {

class GroupBarrier {
 public:
  explicit GroupBarrier(int size) : size_(size) {}

  // Returns once `size` threads have arrived in this round; kInternal once aborted.
  Status Arrive();
  // Any thread, any time; idempotent.
  void Abort();

 private:
  const int size_;
  std::mutex mutex_;
  std::condition_variable released_;
  int arrived_ = 0;
  uint64_t round_ = 0;
  bool aborted_ = false;
};

}  // namespace shadowkv
