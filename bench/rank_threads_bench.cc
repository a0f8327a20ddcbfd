// How long RankThreads::Run takes to give up on a step that overruns its time limit.
#include <benchmark/benchmark.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "core/rank_threads.h"

namespace shadowkv {
namespace {

// A step whose ranks wait for one another forever, until on_failure opens the gate: the wall
// time per iteration is the limit plus what the abort, the stack dumps that every overrun writes
// to stderr, and the join cost (tests only check that the overrun is reported, not how late).
void BM_OverrunStepIsAborted(benchmark::State& state) {
  const auto limit = std::chrono::milliseconds(state.range(0));
  RankThreads threads(3, nullptr);
  for (auto _ : state) {
    std::mutex mutex;
    std::condition_variable opened;
    bool open = false;
    const Status status = threads.Run(
        [&](int) {
          std::unique_lock<std::mutex> lock(mutex);
          opened.wait(lock, [&] { return open; });
          return Status::Ok();
        },
        [&] {
          std::lock_guard<std::mutex> lock(mutex);
          open = true;
          opened.notify_all();
        },
        limit);
    if (status.ok()) state.SkipWithError("the overrunning step was not aborted");
  }
  state.counters["limit_ms"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_OverrunStepIsAborted)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace shadowkv
