// Tests of RankThreads: every rank runs each task on its own thread; the first failure in time
// is returned; a failure or an overrun calls on_failure once, which must release ranks that wait
// for the others (here a host-side stand-in for an all-reduce).
#include "core/rank_threads.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace shadowkv {
namespace {

using namespace std::chrono_literals;

// What a collective looks like from the host: Arrive() returns once every rank arrived, or
// with an error once Abort() was called.
class FakeCollective {
 public:
  explicit FakeCollective(int ranks) : ranks_(ranks) {}
  Status Arrive() {
    std::unique_lock<std::mutex> lock(mutex_);
    ++arrived_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return arrived_ == ranks_ || aborted_; });
    return arrived_ == ranks_ ? Status::Ok() : Error(ErrorCode::kInternal, "aborted");
  }
  void Abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    ++aborts_;
    cv_.notify_all();
  }
  int aborts() {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborts_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int ranks_, arrived_ = 0, aborts_ = 0;
  bool aborted_ = false;
};

TEST(RankThreadsTest, EveryRankRunsOnItsOwnThreadAfterItsBind) {
  std::mutex mutex;
  std::set<int> bound;
  RankThreads threads(4, [&](int rank) {
    std::lock_guard<std::mutex> lock(mutex);
    bound.insert(rank);
    return Status::Ok();
  });
  for (int round = 0; round < 50; ++round) {
    std::set<std::thread::id> ids;
    std::set<int> ran;
    ASSERT_TRUE(threads
                    .Run([&](int rank) {
                      std::lock_guard<std::mutex> lock(mutex);
                      ids.insert(std::this_thread::get_id());
                      ran.insert(rank);
                      return Status::Ok();
                    })
                    .ok());
    EXPECT_EQ(ran, (std::set<int>{0, 1, 2, 3}));
    EXPECT_EQ(ids.size(), 4u);
    EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u);
  }
  EXPECT_EQ(bound, (std::set<int>{0, 1, 2, 3}));
}

TEST(RankThreadsTest, AFailedBindFailsThatRanksTasks) {
  RankThreads threads(3, [](int rank) {
    return rank == 1 ? Error(ErrorCode::kUnsupported, "no device {}", rank) : Status::Ok();
  });
  const Status status = threads.Run([](int) { return Status::Ok(); });
  EXPECT_EQ(status.code(), ErrorCode::kUnsupported);
  EXPECT_NE(status.message().find("no device 1"), std::string::npos);
}

TEST(RankThreadsTest, ReturnsTheFirstFailureInTime) {
  RankThreads threads(3, nullptr);
  std::atomic<int> notified{0};
  const Status status = threads.Run(
      [](int rank) {
        if (rank == 0) {
          std::this_thread::sleep_for(50ms);
          return Error(ErrorCode::kInternal, "late failure");
        }
        if (rank == 2) return Error(ErrorCode::kOutOfRange, "early failure");
        return Status::Ok();
      },
      [&] { ++notified; });
  EXPECT_EQ(status.code(), ErrorCode::kOutOfRange) << status.ToString();
  EXPECT_EQ(notified.load(), 1);
  // The group is reusable, and a clean run reports nothing.
  EXPECT_TRUE(threads.Run([](int) { return Status::Ok(); }, [&] { ++notified; }).ok());
  EXPECT_EQ(notified.load(), 1);
}

TEST(RankThreadsTest, AFailingRankReleasesTheRanksWaitingForIt) {
  RankThreads threads(4, nullptr);
  FakeCollective collective(4);
  const Status status = threads.Run(
      [&](int rank) {
        if (rank == 3) return Error(ErrorCode::kResourceExhausted, "rank 3 ran out of memory");
        return collective.Arrive();
      },
      [&] { collective.Abort(); });
  EXPECT_EQ(status.code(), ErrorCode::kResourceExhausted) << status.ToString();
  EXPECT_EQ(collective.aborts(), 1);
}

TEST(RankThreadsTest, AStepThatOverrunsItsTimeIsAborted) {
  RankThreads threads(3, nullptr);
  FakeCollective collective(4);  // one arrival too many: nobody ever gets through
  // How soon after the limit Run returns is bench/rank_threads_bench.cc's to measure.
  const Status status =
      threads.Run([&](int) { return collective.Arrive(); }, [&] { collective.Abort(); }, 100ms);
  EXPECT_EQ(status.code(), ErrorCode::kInternal);
  EXPECT_NE(status.message().find("3 of 3 ranks had not returned after 100 ms"), std::string::npos)
      << status.ToString();
  EXPECT_EQ(collective.aborts(), 1);
}

TEST(RankThreadsTest, AStepWithinItsTimeIsNotAborted) {
  RankThreads threads(2, nullptr);
  FakeCollective collective(2);
  std::atomic<int> notified{0};
  const Status status = threads.Run(
      [&](int rank) {
        if (rank == 0) std::this_thread::sleep_for(20ms);
        return collective.Arrive();
      },
      [&] { ++notified; }, 5000ms);
  EXPECT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(notified.load(), 0);
}

// A rank that waits here until on_failure opens the gate: the frame a stack dump must show. Kept a
// function of its own (not inlined, not cloned) so that its address is where it runs.
struct Gate {
  std::mutex mutex;
  std::condition_variable cv;
  bool open = false;
  uintptr_t return_address = 0;  // WaitAtTheGate's, into its caller
  void Open() {
    std::lock_guard<std::mutex> lock(mutex);
    open = true;
    cv.notify_all();
  }
};

#if defined(__clang__)
__attribute__((noinline))
#else
__attribute__((noipa))
#endif
Status WaitAtTheGate(Gate& gate) {
  std::unique_lock<std::mutex> lock(gate.mutex);
  gate.return_address = reinterpret_cast<uintptr_t>(__builtin_return_address(0));
  while (!gate.open) gate.cv.wait(lock);
  return Status::Ok();
}

// The absolute addresses ("[0x...]") of the frames in `dump` under the line that starts with
// `header`, up to the next "rank " line.
std::vector<uintptr_t> FramesUnder(const std::string& dump, const std::string& header) {
  std::vector<uintptr_t> frames;
  size_t at = dump.find(header);
  if (at == std::string::npos) return frames;
  at = dump.find('\n', at);
  while (at != std::string::npos && at + 1 < dump.size()) {
    const size_t end = dump.find('\n', at + 1);
    const std::string line = dump.substr(at + 1, end == std::string::npos ? end : end - at - 1);
    if (line.rfind("rank ", 0) == 0) break;
    const size_t open = line.rfind("[0x");
    if (open != std::string::npos) {
      frames.push_back(static_cast<uintptr_t>(std::stoull(line.substr(open + 3), nullptr, 16)));
    }
    at = end;
  }
  return frames;
}

TEST(RankThreadsTest, ATimedOutStepWritesTheStackOfEachRankThatHadNotReturned) {
  RankThreads threads(3, nullptr);
  Gate gate;
  std::atomic<int> notified{0};
  testing::internal::CaptureStderr();
  const Status status = threads.Run(
      [&](int rank) { return rank == 1 ? WaitAtTheGate(gate) : Status::Ok(); },
      [&] {
        ++notified;
        gate.Open();
      },
      100ms);
  const std::string dump = testing::internal::GetCapturedStderr();
  EXPECT_EQ(status.code(), ErrorCode::kInternal);
  EXPECT_NE(status.message().find("1 of 3 ranks had not returned after 100 ms"), std::string::npos)
      << status.ToString();
  EXPECT_EQ(notified.load(), 1);
  // Only the rank that had not returned, with a stack that passes through WaitAtTheGate: the
  // frame of its caller (its return address, as it saw it itself), and under it a return address
  // a little past WaitAtTheGate's start (the call of its wait).
  EXPECT_NE(dump.find("rank 1 stack (step timed out after 100 ms):\n"), std::string::npos) << dump;
  EXPECT_EQ(dump.find("rank 0 stack"), std::string::npos) << dump;
  EXPECT_EQ(dump.find("rank 2 stack"), std::string::npos) << dump;
  EXPECT_EQ(dump.find("no stack within"), std::string::npos) << dump;
  EXPECT_NE(dump.find(" loaded at 0x"), std::string::npos) << dump;
  const std::vector<uintptr_t> frames = FramesUnder(dump, "rank 1 stack");
  ASSERT_NE(gate.return_address, 0u);
  const uintptr_t start = reinterpret_cast<uintptr_t>(&WaitAtTheGate);
  const size_t caller =
      std::find(frames.begin(), frames.end(), gate.return_address) - frames.begin();
  ASSERT_LT(caller, frames.size()) << "no frame of WaitAtTheGate's caller\n" << dump;
  ASSERT_GE(caller, 1u) << dump;
  EXPECT_GT(frames[caller - 1], start) << std::hex << "WaitAtTheGate at 0x" << start << "\n" << dump;
  EXPECT_LT(frames[caller - 1], start + 4096)
      << std::hex << "WaitAtTheGate at 0x" << start << "\n" << dump;
  // The rank thread went on after its dump, and the group is reusable.
  EXPECT_TRUE(threads.Run([](int) { return Status::Ok(); }).ok());
}

TEST(RankThreadsTest, AFailureOrAStepWithinItsTimeWritesNoStacks) {
  RankThreads threads(2, nullptr);
  FakeCollective collective(2);
  testing::internal::CaptureStderr();
  const Status failed = threads.Run(
      [&](int rank) {
        if (rank == 0) return Error(ErrorCode::kInternal, "rank 0 failed");
        return collective.Arrive();
      },
      [&] { collective.Abort(); }, 5000ms);
  const Status in_time = threads.Run([](int) { return Status::Ok(); }, nullptr, 5000ms);
  const std::string written = testing::internal::GetCapturedStderr();
  EXPECT_EQ(failed.code(), ErrorCode::kInternal);
  EXPECT_TRUE(in_time.ok()) << in_time.ToString();
  EXPECT_EQ(written.find("stack"), std::string::npos) << written;
}

}  // namespace
}  // namespace shadowkv
