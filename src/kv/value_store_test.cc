// Tests of the slow-tier value store in RAM and in a temporary file.
#include "kv/value_store.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "core/fp8.h"

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

// Normal(0, 1) runs with a spread of magnitudes per run (run i scaled by 2^(i % 9 - 4)); run 3 is
// all zeros.
std::vector<float> MakeRandomRuns(int64_t count, int64_t run_floats, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> runs(count * run_floats);
  for (int64_t i = 0; i < count; ++i) {
    const float scale = std::ldexp(1.0f, static_cast<int>(i % 9) - 4);
    for (int64_t j = 0; j < run_floats; ++j) {
      runs[i * run_floats + j] = i == 3 ? 0.0f : normal(rng) * scale;
    }
  }
  return runs;
}

void Fp8RoundTrip(const std::string& directory) {
  const int64_t run_floats = 8 * 64;
  auto store = ValueStore::Create(run_floats, directory, ValueFormat::kFp8E4m3);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->format(), ValueFormat::kFp8E4m3);
  EXPECT_EQ((*store)->run_bytes(), run_floats + 4);
  // 2,500 runs of 516 bytes cross the RAM blocks (2,032 runs each).
  const int64_t count = 2500;
  const auto runs = MakeRandomRuns(count, run_floats, 9);
  auto first = (*store)->Append(runs.data(), 700);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  first = (*store)->Append(runs.data() + 700 * run_floats, count - 700);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(*first, 700);
  EXPECT_EQ((*store)->num_runs(), count);
  EXPECT_EQ((*store)->bytes(), count * (run_floats + 4));  // a byte a value, 4 per scale

  std::vector<float> out(run_floats), expected(run_floats);
  std::vector<uint8_t> codes(run_floats);
  for (int64_t id : {0L, 1L, 3L, 8L, 699L, 700L, 2031L, 2032L, count - 1}) {
    ASSERT_TRUE((*store)->Read(id, out.data()).ok());
    const float* run = runs.data() + id * run_floats;
    // Bit for bit the codec's quantise-then-dequantise of the run.
    const float scale = QuantizeFp8Run(run, run_floats, codes.data());
    DequantizeFp8Run(codes.data(), run_floats, scale, expected.data());
    ASSERT_EQ(out, expected) << "run " << id;
    // And within e4m3's rounding of the original: half a step, 2^-4 of the value in the normal
    // range, 2^-10 of the scale below it.
    float amax = 0.0f;
    for (int64_t j = 0; j < run_floats; ++j) amax = std::max(amax, std::fabs(run[j]));
    int64_t changed = 0;
    for (int64_t j = 0; j < run_floats; ++j) {
      const float bound = 0.0625f * std::fabs(run[j]) + amax / 448.0f / 1024.0f + 1e-6f * amax;
      ASSERT_LE(std::fabs(out[j] - run[j]), bound) << "run " << id << " element " << j;
      changed += out[j] != run[j];
    }
    if (id == 3) {
      EXPECT_EQ(changed, 0);  // zeros stay zeros
    } else {
      EXPECT_GT(changed, run_floats / 2) << "run " << id;  // really quantised
    }
  }
  EXPECT_FALSE((*store)->Read(count, out.data()).ok());
}

TEST(ValueStoreTest, Fp8RamRunsAreTheDequantisedRuns) { Fp8RoundTrip(""); }

TEST(ValueStoreTest, Fp8FileRunsAreTheDequantisedRuns) {
  const auto directory = std::filesystem::temp_directory_path() /
                         ("skv_values_fp8_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(directory);
  Fp8RoundTrip(directory.string());
  EXPECT_TRUE(std::filesystem::is_empty(directory));
  std::filesystem::remove_all(directory);
}

TEST(ValueStoreTest, Fp32IsTheDefaultFormat) {
  auto store = ValueStore::Create(64, "");
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->format(), ValueFormat::kFp32);
  EXPECT_EQ((*store)->run_bytes(), 256);
  EXPECT_EQ(ValueStore::RunBytes(512, ValueFormat::kFp32), 2048);
  EXPECT_EQ(ValueStore::RunBytes(512, ValueFormat::kFp8E4m3), 516);
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
