#include "core/group_barrier.h"

namespace shadowkv {

Status GroupBarrier::Arrive() {
  auto aborted = [] { return Error(ErrorCode::kInternal, "the tensor-parallel group was aborted"); };
  std::unique_lock<std::mutex> lock(mutex_);
  if (aborted_) return aborted();
  const uint64_t entered = round_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++round_;
    released_.notify_all();
    return Status::Ok();
  }
  released_.wait(lock, [&] { return round_ != entered || aborted_; });
  return round_ != entered ? Status::Ok() : aborted();
}

void GroupBarrier::Abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_ = true;
  released_.notify_all();
}

}  // namespace shadowkv
