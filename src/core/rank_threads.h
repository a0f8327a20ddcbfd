// RankThreads: one thread per rank of a tensor-parallel group, running one task at a time on all
// ranks together. The ranks of a step wait for each other (in all-reduces), so a rank that fails,
// or a step that never ends, must be able to stop the others: Run takes a callback for that.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/status.h"

namespace shadowkv {

class RankThreads {
 public:
  using Task = std::function<Status(int rank)>;

  // `bind(rank)` runs first on each rank's thread (e.g. to make the rank's GPU current); if it
  // fails, every task of that rank fails with its error.
  RankThreads(int ranks, const std::function<Status(int rank)>& bind);
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }

  // The real-time signal that asks a rank's thread for its stack (SIGRTMIN + 5).
  static int StackSignal();

  // task(rank) on every rank's thread at once; returns when all have returned, with the first
  // failure in time (Ok if none). `on_failure`, if set, runs once: on the failing rank's thread
  // as soon as a rank fails, or on this thread when the ranks have not all returned after
  // `timeout` (0: no limit), in which case the error returned says so. Either way Run still
  // waits for every rank: on_failure must make the stragglers return.
  // When `timeout` passes, before on_failure, the call stack of each rank that has not returned
  // is written to stderr, each under a line "rank R stack (step timed out after N ms):" (one
  // frame a line, as backtrace_symbols_fd writes them, after a line giving the executable and its
  // load base). It interrupts that rank's thread with a signal (StackSignal(), its handler
  // installed at the first such dump) and waits up to 2 s for each rank's stack.
  Status Run(const Task& task, const std::function<void()>& on_failure = nullptr,
             std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

 private:
  void Loop(int rank, const std::function<Status(int)>& bind);

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const Task* task_ = nullptr;
  const std::function<void()>* on_failure_ = nullptr;
  bool failure_reported_ = false;  // on_failure ran in this Run
  int first_failure_ = -1;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<Status> results_;
  std::vector<char> running_;  // per rank: has not returned from the current task
  std::vector<std::thread> threads_;
};

}  // namespace shadowkv
