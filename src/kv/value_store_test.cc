// Tests of the slow-tier value store in RAM and in a temporary file.
#include "kv/value_store.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>

namespace shadowkv::kv {
namespace {

// Runs of 8 x 64 floats, each filled with values unique to its id.
std::vector<float> MakeRuns(int64_t first_id, int64_t count, int64_t run_floats) {
  std::vector<float> runs(count * run_floats);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j = 0; j < run_floats; ++j) {
      runs[i * run_floats + j] = static_cast<float>((first_id + i) * 1000 + j) * 0.5f;
    }
  }
  return runs;
}

void RoundTrip(const std::string& directory) {
  const int64_t run_floats = 8 * 64;  // 2 KiB runs: 512 per RAM block
  auto store = ValueStore::Create(run_floats, directory);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->file_backed(), !directory.empty());
  // Appends of several sizes, crossing RAM block boundaries.
  int64_t next = 0;
  for (int64_t count : {1, 300, 700, 5}) {
    auto runs = MakeRuns(next, count, run_floats);
    auto first = (*store)->Append(runs.data(), count);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    EXPECT_EQ(*first, next);
    next += count;
  }
  EXPECT_EQ((*store)->num_runs(), next);
  EXPECT_EQ((*store)->bytes(), next * run_floats * 4);
  std::vector<float> out(run_floats);
  for (int64_t id : {0L, 1L, 299L, 511L, 512L, 1000L, next - 1}) {
    ASSERT_TRUE((*store)->Read(id, out.data()).ok());
    EXPECT_EQ(out, MakeRuns(id, 1, run_floats)) << "run " << id;
  }
  EXPECT_FALSE((*store)->Read(next, out.data()).ok());
  EXPECT_FALSE((*store)->Read(-1, out.data()).ok());
}

TEST(ValueStoreTest, RamRoundTrip) { RoundTrip(""); }

TEST(ValueStoreTest, FileRoundTripLeavesNoFileBehind) {
  const auto directory =
      std::filesystem::temp_directory_path() / ("skv_values_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(directory);
  RoundTrip(directory.string());
  EXPECT_TRUE(std::filesystem::is_empty(directory));  // unlinked at creation
  std::filesystem::remove_all(directory);
}

TEST(ValueStoreTest, MissingDirectoryIsAnError) {
  auto store = ValueStore::Create(16, "/nonexistent/shadowkv/dir");
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), ErrorCode::kIo);
  EXPECT_NE(store.status().message().find("/nonexistent/shadowkv/dir"), std::string::npos);
}

TEST(ValueStoreTest, WriteFailureIsAStatus) {
  // A file-size limit makes pwrite fail (EFBIG) the way a full disk would.
  auto store = ValueStore::Create(256, std::filesystem::temp_directory_path().string());
  ASSERT_TRUE(store.ok());
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  auto runs = MakeRuns(0, 8, 256);  // 8 KiB
  auto first = (*store)->Append(runs.data(), 8);
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  ASSERT_FALSE(first.ok());
  EXPECT_EQ((*store)->num_runs(), 0);
}

TEST(ValueStoreTest, RejectsEmptyRuns) { EXPECT_FALSE(ValueStore::Create(0, "").ok()); }

}  // namespace
}  // namespace shadowkv::kv
