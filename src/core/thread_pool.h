// ThreadPool: a fixed set of workers that run ParallelFor loops; the caller's thread takes part.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shadowkv {

// Workers spin briefly between loops (decode issues hundreds of small loops per token), then
// sleep on a condition variable so an idle engine uses no CPU.
class ThreadPool {
 public:
  // num_threads counts the calling thread; 0 means the number of hardware threads.
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs body(begin, end, thread_index) over [0, count) split into contiguous ranges of at least
  // `grain` items; returns when all are done. One caller at a time; body must not call back in.
  void ParallelFor(int64_t count, int64_t grain,
                   const std::function<void(int64_t, int64_t, int)>& body);

 private:
  void WorkerLoop(int thread_index);
  void RunShare(int thread_index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_cv_;
  const std::function<void(int64_t, int64_t, int)>* body_ = nullptr;
  int64_t count_ = 0;
  int64_t block_ = 0;
  std::atomic<int64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace shadowkv
