#include "core/group_barrier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace shadowkv {
namespace {

TEST(GroupBarrierTest, NoThreadLeavesARoundBeforeAllHaveArrived) {
  constexpr int kThreads = 4, kRounds = 50;
  GroupBarrier barrier(kThreads);
  std::atomic<int> arrivals{0};
  std::atomic<bool> early{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < kRounds; ++round) {
        arrivals.fetch_add(1);
        EXPECT_TRUE(barrier.Arrive().ok());
        if (arrivals.load() < (round + 1) * kThreads) early = true;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_FALSE(early.load());
  EXPECT_EQ(arrivals.load(), kThreads * kRounds);
}

TEST(GroupBarrierTest, AbortReleasesTheWaitingAndRefusesLaterArrivals) {
  GroupBarrier barrier(3);
  std::vector<Status> results(2, Status::Ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] { results[t] = barrier.Arrive(); });  // the third never comes
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  barrier.Abort();
  // Refused; had the abort not been kept, this third arrival would complete the round and the
  // others would return Ok (the test fails rather than hangs).
  EXPECT_EQ(barrier.Arrive().code(), ErrorCode::kInternal);
  for (std::thread& thread : threads) thread.join();
  for (const Status& result : results) {
    EXPECT_EQ(result.code(), ErrorCode::kInternal);
    EXPECT_NE(result.message().find("aborted"), std::string::npos) << result.ToString();
  }
}

}  // namespace
}  // namespace shadowkv
