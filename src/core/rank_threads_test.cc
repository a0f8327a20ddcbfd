// Tests of RankThreads: every rank runs each task on its own thread; the first failure in time
// is returned; a failure or an overrun calls on_failure once, which must release ranks that wait
// for the others (here a host-side stand-in for an all-reduce).
#include "core/rank_threads.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
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
  const auto start = std::chrono::steady_clock::now();
  const Status status =
      threads.Run([&](int) { return collective.Arrive(); }, [&] { collective.Abort(); }, 100ms);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(status.code(), ErrorCode::kInternal);
  EXPECT_NE(status.message().find("3 of 3 ranks had not returned after 100 ms"), std::string::npos)
      << status.ToString();
  EXPECT_EQ(collective.aborts(), 1);
  EXPECT_GE(waited, 100ms);
  EXPECT_LT(waited, 10s);
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

}  // namespace
}  // namespace shadowkv
