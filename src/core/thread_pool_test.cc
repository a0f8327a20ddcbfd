// Tests of ThreadPool: every index visited once, across many consecutive loops.
#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace shadowkv {
namespace {

TEST(ThreadPoolTest, VisitsEveryIndexOnce) {
  ThreadPool pool(4);
  for (int64_t count : {0, 1, 3, 4, 5, 17, 1000}) {
    std::vector<std::atomic<int>> hits(count);
    pool.ParallelFor(count, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(hits[i].load(), 1) << count << " " << i;
  }
}

TEST(ThreadPoolTest, ManySmallLoops) {
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  for (int round = 0; round < 2000; ++round) {
    pool.ParallelFor(8, 1, [&](int64_t b, int64_t e, int) { total += e - b; });
  }
  EXPECT_EQ(total.load(), 2000 * 8);
}

}  // namespace
}  // namespace shadowkv
