#include "core/rank_threads.h"

#include <execinfo.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <utility>

namespace shadowkv {
namespace {

// Stacks of the ranks that have not returned when a step times out. The thread that times out
// sends each such rank's thread StackSignal() with a request number (pthread_sigqueue); the
// handler, on that thread, writes its stack to stderr and answers with the number. A signal
// whose number is not the request in progress (a stray one, or one answered too late) writes
// nothing. The handler is installed at the first dump only, so a run that never times out is
// not touched. It takes SA_RESTART, so an interrupted system call goes on after it (a futex wait
// or a read resumes; those that end with EINTR whatever the flag, such as poll or nanosleep, do
// so as for any other signal).
std::atomic<int> stack_request{0};   // the request in progress, 0: none
std::atomic<int> stack_answered{0};  // the last request answered
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic");

void WriteStackOnSignal(int, siginfo_t* info, void*) {
  const int saved_errno = errno;
  const int request = info != nullptr && info->si_code == SI_QUEUE ? info->si_value.sival_int : 0;
  if (request != 0 && request == stack_request.load()) {
    void* frames[64];
    const int depth = backtrace(frames, 64);
    // frames[0] is this handler; next comes the signal's return trampoline, then where the
    // thread was when the signal came.
    if (depth > 1) backtrace_symbols_fd(frames + 1, depth - 1, STDERR_FILENO);
    stack_answered.store(request);
  }
  errno = saved_errno;
}

// Installs the handler at its first call; false if the signal already has another one (it is
// then left alone, and no stack is asked for).
bool InstallStackHandler() {
  static const bool installed = [] {
    struct sigaction old = {};
    if (sigaction(RankThreads::StackSignal(), nullptr, &old) != 0) return false;
    const bool ours = (old.sa_flags & SA_SIGINFO) != 0 && old.sa_sigaction == WriteStackOnSignal;
    if (!ours && ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL)) return false;
    struct sigaction action = {};
    action.sa_sigaction = WriteStackOnSignal;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&action.sa_mask);
    return sigaction(RankThreads::StackSignal(), &action, nullptr) == 0;
  }();
  return installed;
}

// The main executable's load base: what a frame's absolute address [0x...] is reduced by to give
// the address in the file (for a position-independent executable; 0 otherwise).
uintptr_t ExecutableLoadBase() {
  uintptr_t base = 0;
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) {
        *static_cast<uintptr_t*>(data) = info->dlpi_addr;
        return 1;  // the first object is the executable
      },
      &base);
  return base;
}

// Writes the stack of each (rank, thread) to stderr, one rank after the other.
void WriteStacks(const std::vector<std::pair<int, pthread_t>>& ranks, long long timeout_ms) {
  static std::mutex one_dump_at_a_time;
  static int last_request = 0;  // under one_dump_at_a_time
  std::lock_guard<std::mutex> lock(one_dump_at_a_time);
  if (!InstallStackHandler()) {
    std::fprintf(stderr, "rank stacks not written: signal %d has another handler\n",
                 RankThreads::StackSignal());
    return;
  }
  char executable[4096] = {};
  const ssize_t length = readlink("/proc/self/exe", executable, sizeof(executable) - 1);
  if (length <= 0) std::strcpy(executable, "?");
  std::fprintf(stderr,
               "stacks of the %zu rank(s) that had not returned; executable %s loaded at 0x%lx "
               "(a frame \"file(+0xOFFSET)[0xADDRESS]\" resolves with addr2line -f -C -e file "
               "0xOFFSET; an ADDRESS in the executable, less its load base, likewise)\n",
               ranks.size(), executable, static_cast<unsigned long>(ExecutableLoadBase()));
  for (const auto& [rank, thread] : ranks) {
    std::fprintf(stderr, "rank %d stack (step timed out after %lld ms):\n", rank, timeout_ms);
    std::fflush(stderr);
    const int request = last_request = last_request == INT_MAX ? 1 : last_request + 1;
    stack_request.store(request);
    union sigval value = {};
    value.sival_int = request;
    const int sent = pthread_sigqueue(thread, RankThreads::StackSignal(), value);
    if (sent != 0) {
      std::fprintf(stderr, "rank %d: not signalled (%s)\n", rank, std::strerror(sent));
    } else {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (stack_answered.load() != request && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (stack_answered.load() != request) {
        std::fprintf(stderr, "rank %d: no stack within 2 s (the signal blocked on its thread?)\n",
                     rank);
      }
    }
    stack_request.store(0);
  }
  std::fflush(stderr);
}

}  // namespace

int RankThreads::StackSignal() { return SIGRTMIN + 5; }

RankThreads::RankThreads(int ranks, const std::function<Status(int rank)>& bind)
    : results_(ranks), running_(ranks, 0) {
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
  std::fill(running_.begin(), running_.end(), 1);
  ++generation_;
  wake_.notify_all();
  const auto finished = [&] { return pending_ == 0; };
  Status overdue = Status::Ok();
  if (timeout.count() > 0 && !done_.wait_for(lock, timeout, finished) && first_failure_ < 0) {
    overdue = Error(ErrorCode::kInternal,
                    "{} of {} ranks had not returned after {} ms (taken for "
                    "a hang: the others wait for them)",
                    pending_, size(), timeout.count());
    std::vector<std::pair<int, pthread_t>> stuck;
    for (int rank = 0; rank < size(); ++rank) {
      if (running_[rank]) stuck.emplace_back(rank, threads_[rank].native_handle());
    }
    lock.unlock();  // the ranks may return meanwhile
    WriteStacks(stuck, static_cast<long long>(timeout.count()));
    lock.lock();
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
  {
    // backtrace loads the unwinder at its first call: here, rather than in the signal handler
    // that writes this thread's stack.
    void* frame[1];
    (void)backtrace(frame, 1);
  }
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
    running_[rank] = 0;
    if (--pending_ == 0) done_.notify_all();
  }
}

}  // namespace shadowkv
