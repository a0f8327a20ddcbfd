// ThreadPool implementation: static partition of the range, one share per thread.
#include "core/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#define SKV_PAUSE() _mm_pause()
#else
#define SKV_PAUSE() std::this_thread::yield()
#endif

namespace shadowkv {
namespace {
constexpr int kPauseIterations = 1 << 10;
constexpr int kSpinIterations = 1 << 14;
}

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::RunShare(int thread_index) {
  const int64_t begin = thread_index * block_;
  const int64_t end = std::min(count_, begin + block_);
  if (begin < end) (*body_)(begin, end, thread_index);
}

void ThreadPool::ParallelFor(int64_t count, int64_t grain,
                             const std::function<void(int64_t, int64_t, int)>& body) {
  if (count <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_parts = std::max<int64_t>(1, count / grain);
  const int parts = static_cast<int>(std::min<int64_t>(num_threads(), max_parts));
  if (parts <= 1) {
    body(0, count, 0);
    return;
  }
  body_ = &body;
  count_ = count;
  block_ = (count + parts - 1) / parts;
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);  // pairs with a worker about to sleep
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  RunShare(0);
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kPauseIterations) SKV_PAUSE(); else std::this_thread::yield();
  }
  body_ = nullptr;
}

void ThreadPool::WorkerLoop(int thread_index) {
  int64_t seen = 0;
  while (true) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      if (++spins < kSpinIterations) {
        // Yield once the short pause phase is over, so an oversubscribed machine still progresses.
        if (spins < kPauseIterations) SKV_PAUSE(); else std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(mutex_);
      wake_cv_.wait(lock, [&] { return generation_.load() != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    RunShare(thread_index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace shadowkv
