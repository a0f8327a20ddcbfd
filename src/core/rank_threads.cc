#include "core/rank_threads.h"

#include <utility>

namespace shadowkv {

RankThreads::RankThreads(int ranks, const std::function<Status(int rank)>& bind) : results_(ranks) {
  for (int r = 0; r < ranks; ++r) threads_.emplace_back([this, r, bind] { Loop(r, bind); });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

Status RankThreads::Run(const Task& task, const std::function<void()>& on_failure,
                        std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  task_ = &task;
  on_failure_ = &on_failure;
  failure_reported_ = false;
  first_failure_ = -1;
  pending_ = size();
  ++generation_;
  wake_.notify_all();
  const auto finished = [&] { return pending_ == 0; };
  Status overdue = Status::Ok();
  if (timeout.count() > 0 && !done_.wait_for(lock, timeout, finished) && first_failure_ < 0) {
    overdue = Error(ErrorCode::kInternal,
                    "{} of {} ranks had not returned after {} ms (taken for "
                    "a hang: the others wait for them)",
                    pending_, size(), timeout.count());
    if (on_failure && !failure_reported_) {
      failure_reported_ = true;
      lock.unlock();
      on_failure();
      lock.lock();
    }
  }
  done_.wait(lock, finished);
  task_ = nullptr;
  on_failure_ = nullptr;
  Status first = !overdue.ok()         ? overdue
                 : first_failure_ >= 0 ? results_[first_failure_]
                                       : Status::Ok();
  for (Status& status : results_) status = Status::Ok();
  return first;
}

void RankThreads::Loop(int rank, const std::function<Status(int)>& bind) {
  const Status bound = bind ? bind(rank) : Status::Ok();
  uint64_t seen = 0;
  for (;;) {
    const Task* task = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      task = task_;
    }
    Status status = bound.ok() ? (*task)(rank) : bound;
    std::unique_lock<std::mutex> lock(mutex_);
    if (!status.ok() && first_failure_ < 0) first_failure_ = rank;
    results_[rank] = std::move(status);
    if (first_failure_ == rank && !failure_reported_ && *on_failure_) {
      failure_reported_ = true;
      const std::function<void()>& notify = *on_failure_;
      lock.unlock();  // the other ranks may need the lock to return
      notify();
      lock.lock();
    }
    if (--pending_ == 0) done_.notify_all();
  }
}

}  // namespace shadowkv
