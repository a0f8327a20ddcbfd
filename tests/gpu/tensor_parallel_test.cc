// Tensor parallelism on one GPU: the single-device communicator's all-reduce (eager and replayed
// from CUDA graphs, fp32 and bf16), and tiny random-weight models split over 2 and 4 ranks on one
// device against the same model unsplit (the llama and qwen2 shapes and the gemma3, phi3, glm4
// and chatglm tiny family models): logits after chunked prefill and over graph-replayed decode
// steps (full attention; ShadowKV is in tensor_parallel_shadowkv_test.cc). The NCCL test needs two
// GPUs and skips, saying so, on fewer.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "gpu/tp/communicator.h"
#include "gpu_test_util.h"
#include "model/model_path.h"
#include "sampling_test_util.h"
#include "tp_test_util.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;
using namespace tp_testing;

// At static initialisation, before this binary's first CUDA call: the environment that the
// commands set for split models (eager module loading, a hardware queue per stream), which the
// ranks' spinning all-reduces here need as well.
const bool kProcessPrepared = [] {
  PrepareProcessForTensorParallel(2);
  return true;
}();

// CUDA reads CUDA_MODULE_LOADING once, at the process's first CUDA call, and the split models'
// all-reduce kernels need every module loaded up front (PrepareProcessForTensorParallel): this
// binary asks for it before any test runs.
[[maybe_unused]] const bool kEagerModules = [] {
  PrepareProcessForTensorParallel(2);
  return true;
}();

// Runs fn(rank) on one thread per rank, as the model group does.
template <typename Fn>
void OnRanks(int size, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

// Rank r's buffer holds (r + 1) * (i % 7 + call) at element i: the sum over ranks is exact in
// bf16 as well for these small integers.
void CheckAllReduce(Result<tp::Communicators> comms, tp::ReduceType type, bool graphs) {
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  const int size = static_cast<int>(comms->size()), count = 70001, calls = 5;
  const int64_t element = type == tp::ReduceType::kFloat32 ? 4 : 2;
  std::vector<std::string> failures(size);
  std::atomic<bool> setup_failed{false};
  OnRanks(size, [&](int r) {
    tp::Communicator& comm = *(*comms)[r];
    ASSERT_EQ(cudaSetDevice(comm.device()), cudaSuccess);
    auto fail = [&](const std::string& what) {
      if (failures[r].empty()) failures[r] = what;
    };
    // Everything that allocates comes first: an allocation may wait for the device to go idle,
    // which it does not while another rank's all-reduce waits for this one.
    cudaStream_t stream = nullptr;
    DeviceBuffer<uint8_t> buffer;
    uint8_t* pinned = nullptr;
    cudaGraphExec_t exec = nullptr;
    bool ready =
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
        buffer.Allocate(count * element).ok() && comm.Reserve(count * element).ok() &&
        cudaMallocHost(reinterpret_cast<void**>(&pinned), count * element) == cudaSuccess;
    if (ready && graphs) {
      cudaGraph_t graph = nullptr;
      cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      const Status captured = comm.AllReduceSum(buffer.get(), count, type, stream);
      const bool ended = cudaStreamEndCapture(stream, &graph) == cudaSuccess;
      ready = captured.ok() && ended && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
      if (graph) cudaGraphDestroy(graph);
    }
    if (!ready) {
      fail("setup");
      setup_failed = true;
    }
    // Every rank passes the barrier, and all skip the all-reduces if any could not set up.
    EXPECT_TRUE(comm.HostBarrier().ok());
    for (int call = 0; call < calls && !setup_failed; ++call) {
      for (int i = 0; i < count; ++i) {
        const float v = static_cast<float>((r + 1) * (i % 7 + call));
        if (type == tp::ReduceType::kFloat32) {
          reinterpret_cast<float*>(pinned)[i] = v;
        } else {
          reinterpret_cast<uint16_t*>(pinned)[i] = Fp32ToBf16(v);
        }
      }
      cudaMemcpyAsync(buffer.get(), pinned, count * element, cudaMemcpyHostToDevice, stream);
      const Status reduced = graphs ? CudaStatus(cudaGraphLaunch(exec, stream), "launch", "", 0)
                                    : comm.AllReduceSum(buffer.get(), count, type, stream);
      cudaMemcpyAsync(pinned, buffer.get(), count * element, cudaMemcpyDeviceToHost, stream);
      const cudaError_t synced = cudaStreamSynchronize(stream);
      if (!reduced.ok() || synced != cudaSuccess) {
        fail("all-reduce: " + reduced.ToString() + ", " + cudaGetErrorString(synced));
        continue;  // the other ranks go on: leaving would strand them in the next all-reduce
      }
      for (int i = 0; i < count; ++i) {
        const float want = static_cast<float>(size * (size + 1) / 2 * (i % 7 + call));
        const float got = type == tp::ReduceType::kFloat32
                              ? reinterpret_cast<float*>(pinned)[i]
                              : Bf16ToFp32(reinterpret_cast<uint16_t*>(pinned)[i]);
        if (got != want) {
          fail("call " + std::to_string(call) + ", element " + std::to_string(i) + ": " +
               std::to_string(got) + " != " + std::to_string(want));
          break;
        }
      }
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (pinned) cudaFreeHost(pinned);
    if (stream) cudaStreamDestroy(stream);
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(CudaTensorParallelTest, LocalAllReduceSumsEveryRank) {
  SKV_SKIP_WITHOUT_GPU();
  CheckAllReduce(tp::CreateLocalCommunicators(3, 0), tp::ReduceType::kFloat32, false);
  CheckAllReduce(tp::CreateLocalCommunicators(3, 0), tp::ReduceType::kBfloat16, false);
}

TEST(CudaTensorParallelTest, LocalAllReduceReplaysFromGraphs) {
  SKV_SKIP_WITHOUT_GPU();
  CheckAllReduce(tp::CreateLocalCommunicators(3, 0), tp::ReduceType::kFloat32, true);
}

// Rank 0 fails before its all-reduce and aborts the group: the others, already waiting in
// theirs, come back (no hang, no trap), and every later all-reduce is refused. Those waiting on
// the device (NCCL; the local kernel in a graph) were enqueued and end without their result;
// the local communicator's eager all-reduce waits for the others' stages on the host, so there
// the call itself returns the abort.
void CheckAbortEndsWaitingRanks(Result<tp::Communicators> comms) {
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  const int size = static_cast<int>(comms->size()), count = 4096;
  std::vector<std::string> failures(size);
  OnRanks(size, [&](int r) {
    tp::Communicator& comm = *(*comms)[r];
    ASSERT_EQ(cudaSetDevice(comm.device()), cudaSuccess);
    cudaStream_t stream = nullptr;
    DeviceBuffer<float> buffer;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
        !buffer.Allocate(count).ok() || !comm.Reserve(count * 4).ok()) {
      failures[r] = "setup";
      comm.Abort();  // the others must not wait for this rank
      return;
    }
    EXPECT_TRUE(comm.HostBarrier().ok());
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others are waiting
      comm.Abort();
    } else {
      const Status reduced = comm.AllReduceSum(buffer.get(), count, tp::ReduceType::kFloat32, stream);
      const cudaError_t synced = cudaStreamSynchronize(stream);
      const bool refused_by_abort =
          !reduced.ok() && reduced.ToString().find("was aborted") != std::string::npos;
      if (!reduced.ok() && !refused_by_abort) failures[r] = "enqueue: " + reduced.ToString();
      if (synced != cudaSuccess) failures[r] = std::string("sync: ") + cudaGetErrorString(synced);
    }
    if (comm.AllReduceSum(buffer.get(), count, tp::ReduceType::kFloat32, stream).ok()) {
      failures[r] = "an all-reduce after the abort was accepted";
    }
    cudaStreamDestroy(stream);
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(CudaTensorParallelTest, LocalAbortEndsWaitingRanks) {
  SKV_SKIP_WITHOUT_GPU();
  CheckAbortEndsWaitingRanks(tp::CreateLocalCommunicators(3, 0));
}

// Ranks waiting in a host barrier for a rank that never comes are released, with an error, by
// an abort. (Were they not, rank 0 meets them after 3 s and they return Ok: the test fails
// instead of hanging.)
void CheckAbortReleasesHostBarrier(Result<tp::Communicators> comms) {
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  const int size = static_cast<int>(comms->size());
  std::vector<std::string> results(size);
  OnRanks(size, [&](int r) {
    tp::Communicator& comm = *(*comms)[r];
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm.Abort();
      std::this_thread::sleep_for(std::chrono::seconds(3));
      (void)comm.HostBarrier();  // releases the others only if the abort did not
      return;
    }
    const Status met = comm.HostBarrier();
    results[r] = met.ok() ? "released by rank 0's arrival, not by the abort" : met.ToString();
  });
  for (int r = 1; r < size; ++r) {
    EXPECT_NE(results[r].find("aborted"), std::string::npos) << "rank " << r << ": " << results[r];
  }
}

TEST(CudaTensorParallelTest, LocalAbortReleasesHostBarrier) {
  SKV_SKIP_WITHOUT_GPU();
  CheckAbortReleasesHostBarrier(tp::CreateLocalCommunicators(3, 0));
}

// What one model produced over the parity script: logits of every checkpoint.
struct Transcript {
  std::vector<std::string> names;
  std::vector<std::vector<float>> logits;
  StepBreakdown profile;
};

// Two prompts (one in two chunks, the other beside the second chunk), then `steps` decode
// steps of both replayed from graphs, fed `forced` tokens (the reference's greedy choices) so
// that a near-tie cannot send the models apart; then one profiled step.
Transcript RunScript(CudaModelGroup& model, int steps, std::vector<std::vector<int32_t>>* forced) {
  Transcript t;
  const int vocab = static_cast<int>(model.config().vocab_size);
  auto record = [&](std::string name, std::vector<float> logits) {
    t.names.push_back(std::move(name));
    t.logits.push_back(std::move(logits));
  };
  EXPECT_TRUE(model.AllocateKvCache(2, 512).ok());
  const std::vector<int32_t> first = SomeTokens(300, 21), second = SomeTokens(137, 22);
  std::vector<float> a(vocab), b(vocab);
  CudaStepInput in{0, std::span<const int32_t>(first.data(), 200), nullptr};
  Status status = model.Forward(std::span<const CudaStepInput>(&in, 1));
  EXPECT_TRUE(status.ok()) << status.ToString();
  const std::vector<CudaStepInput> both = {
      {0, std::span<const int32_t>(first.data() + 200, 100), a.data()}, {1, second, b.data()}};
  status = model.Forward(both);
  EXPECT_TRUE(status.ok()) << status.ToString();
  record("prefill of 300 tokens in two chunks", a);
  record("prefill of 137 tokens beside a chunk", b);
  std::vector<int32_t> next = {Argmax(a), Argmax(b)};
  const bool reference = forced->empty();
  const std::vector<int> slots = {0, 1};
  for (int step = 0; step < steps; ++step) {
    if (!reference) next = (*forced)[step];
    std::vector<float> got(2 * static_cast<size_t>(vocab));
    std::vector<int32_t> tokens = next;
    status = model.DecodeStep(slots, tokens, CudaSampling{}, got.data());
    EXPECT_TRUE(status.ok()) << status.ToString();
    for (int s = 0; s < 2; ++s) {
      record("decode step " + std::to_string(step) + ", sequence " + std::to_string(s),
             std::vector<float>(got.begin() + s * vocab, got.begin() + (s + 1) * vocab));
      EXPECT_EQ(tokens[s], Argmax(t.logits.back())) << "the sampler's greedy choice";
    }
    if (reference) forced->push_back(next);
    next = tokens;
  }
  std::vector<int32_t> tokens = next;
  auto profiled = model.ProfileDecodeStep(slots, tokens);
  EXPECT_TRUE(profiled.ok()) << profiled.status().ToString();
  if (profiled.ok()) t.profile = *profiled;
  EXPECT_EQ(model.slot_length(0), 300 + steps + 1);
  return t;
}

// make(tp) builds the model split as `tp` says; every split is compared with the unsplit one.
template <typename Make>
void CheckSplitMatches(Make make, const std::string& tag, std::vector<int> sizes, bool local) {
  std::vector<std::vector<int32_t>> forced;
  Transcript want;
  {
    Result<std::unique_ptr<CudaModelGroup>> one = make(TensorParallelOptions{1, false});
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    EXPECT_EQ((*one)->communicator(), "none");
    want = RunScript(**one, 8, &forced);
  }
  for (int size : sizes) {
    Result<std::unique_ptr<CudaModelGroup>> split = make(TensorParallelOptions{size, local});
    ASSERT_TRUE(split.ok()) << split.status().ToString();
    CudaModelGroup& group = **split;
    EXPECT_EQ(group.size(), size);
    EXPECT_EQ(group.rank(size - 1).config().num_kv_heads, group.config().num_kv_heads / size);
    EXPECT_EQ(group.KvBytesPerToken(), group.rank(0).KvBytesPerToken() * size);
    const Transcript got = RunScript(group, 8, &forced);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    double worst = 0;
    for (size_t i = 0; i < want.logits.size(); ++i) {
      const double error = RelativeError(got.logits[i], want.logits[i]);
      worst = std::max(worst, error);
      // Only the order of fp32 additions differs (partial products summed by the all-reduce);
      // a bf16 rounding of an activation may flip by one unit as a result.
      EXPECT_LT(error, 1e-2) << tag << " split " << size << ": " << want.names[i];
    }
    EXPECT_GT(got.profile.allreduce_ms, 0.0);
    std::printf("[ parity   ] %s, %d ranks (%s): %zu logit vectors, worst relative error %.2e\n",
                tag.c_str(), size, group.communicator().c_str(), want.logits.size(), worst);
  }
}

TEST(CudaTensorParallelTest, LlamaSplitOverTwoAndFourRanksMatchesOneGpu) {
  SKV_SKIP_WITHOUT_GPU();
  CheckSplitMatches(FromFile(TpSpec("llama", 512, 8, 4, true, 31), "gpu_tp_llama"),
                    "gpu_tp_llama", {2, 4}, true);
}

TEST(CudaTensorParallelTest, Qwen2BiasUntiedSplitMatchesOneGpu) {
  SKV_SKIP_WITHOUT_GPU();
  CheckSplitMatches(FromFile(TpSpec("qwen2", 256, 4, 2, false, 32), "gpu_tp_qwen2"),
                    "gpu_tp_qwen2", {2}, true);
}

TEST(CudaTensorParallelTest, SplitsThatCutAKvHeadAreRefused) {
  SKV_SKIP_WITHOUT_GPU();
  const std::string path = WriteTinyModel(TpSpec("llama", 256, 4, 2, true, 33), "gpu_tp_refused");
  auto three = CudaModelGroup::Load(path, SmallOptions(), {3, true});
  EXPECT_EQ(three.status().code(), ErrorCode::kInvalidArgument) << three.status().ToString();
  auto zero = CudaModelGroup::Load(path, SmallOptions(), {0, true});
  EXPECT_EQ(zero.status().code(), ErrorCode::kInvalidArgument);
  int gpus = 0;
  SKV_ASSERT_CUDA(cudaGetDeviceCount(&gpus));
  if (gpus < 2) {
    auto nccl = CudaModelGroup::Load(path, SmallOptions(), {2, false});
    EXPECT_EQ(nccl.status().code(), ErrorCode::kUnsupported) << nccl.status().ToString();
  }
}

// Synthetic weights: a rank draws its slice of each matrix with the whole model's values, so
// the split synthetic model is the same model. 1002 FFN units split unevenly over 4 ranks
// (251, 251, 250, 250); untied LM head.
TEST(CudaTensorParallelTest, SyntheticSplitMatchesOneGpu) {
  SKV_SKIP_WITHOUT_GPU();
  ModelConfig c;
  c.architecture = "llama";
  c.num_layers = 2;
  c.hidden_size = 512;
  c.num_query_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 64;
  c.ffn_size = 1002;
  c.vocab_size = 1000;
  c.context_length = 4096;
  c.tied_embeddings = false;
  c.rope.rotary_dim = 64;
  c.rope.theta_base = 10000.0f;
  CheckSplitMatches(
      [&](const TensorParallelOptions& tp) {
        return CudaModelGroup::CreateSynthetic(c, 3, SmallOptions(), tp);
      },
      "gpu_tp_synthetic", {2, 4}, true);
}

// The tiny family models (tests/data/goldens/, 2 KV heads, head dims 16 and 32) split over 2 ranks
// on one GPU against the same model unsplit: post norms applied after the all-reduce, fused QKV and
// gate|up tensors (and phi3's LongRoPE, glm4's biases, chatglm's fused QKV bias) split per rank,
// sliding windows per head. Their context of 256 is below RunScript's, so a shorter script: a
// 40-token prompt in chunks of 13, then 12 graph-replayed decode steps fed the unsplit model's
// tokens.
TEST(CudaTensorParallelTest, FamilyModelsSplitOverTwoRanksMatchOneGpu) {
  SKV_SKIP_WITHOUT_GPU();
  for (const std::string family : {"gemma3", "phi3", "glm4", "chatglm"}) {
    SCOPED_TRACE(family);
    const std::string path = shadowkv::testing::DataPath("goldens/tiny_" + family + ".gguf");
    const std::vector<int32_t> prompt = SomeTokens(40, 41);
    std::vector<int32_t> forced;
    std::vector<std::vector<float>> want;
    for (int size : {1, 2}) {
      auto group = CudaModelGroup::Load(path, SmallOptions(), TensorParallelOptions{size, true});
      ASSERT_TRUE(group.ok()) << group.status().ToString();
      ASSERT_TRUE((*group)->AllocateKvCache(1, 128).ok());
      const int vocab = static_cast<int>((*group)->config().vocab_size);
      std::vector<std::vector<float>> got;
      std::vector<float> logits(vocab);
      for (size_t done = 0; done < prompt.size(); done += 13) {
        const size_t count = std::min<size_t>(13, prompt.size() - done);
        const std::vector<int32_t> chunk(prompt.begin() + done, prompt.begin() + done + count);
        const CudaStepInput in{0, chunk, logits.data()};
        const Status status = (*group)->Forward(std::span<const CudaStepInput>(&in, 1));
        ASSERT_TRUE(status.ok()) << status.ToString();
        got.push_back(logits);
      }
      int32_t next = Argmax(logits);
      const std::vector<int> slots = {0};
      for (int step = 0; step < 12; ++step) {
        if (size == 1) forced.push_back(next);
        std::vector<int32_t> tokens = {forced[step]};
        const Status status = (*group)->DecodeStep(slots, tokens, CudaSampling{}, logits.data());
        ASSERT_TRUE(status.ok()) << status.ToString();
        got.push_back(logits);
        next = tokens[0];
      }
      if (size == 1) {
        want = std::move(got);
        continue;
      }
      ASSERT_EQ(got.size(), want.size());
      double worst = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        const double error = RelativeError(got[i], want[i]);
        worst = std::max(worst, error);
        EXPECT_LT(error, 1e-2) << family << " split over 2, logit vector " << i;
      }
      std::printf("[ parity   ] tiny %s, 2 ranks: %zu logit vectors, worst relative error %.2e\n",
                  family.c_str(), want.size(), worst);
    }
  }
}

TEST(CudaTensorParallelTest, SplitCopiesSlots) {
  SKV_SKIP_WITHOUT_GPU();
  auto group = FromFile(TpSpec("llama", 256, 4, 2, true, 36), "gpu_tp_copy")({2, true});
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  ASSERT_TRUE((*group)->AllocateKvCache(2, 600).ok());
  const std::vector<int32_t> prompt = SomeTokens(500, 4);
  CudaStepInput in{0, prompt, nullptr};
  ASSERT_TRUE((*group)->Forward(std::span<const CudaStepInput>(&in, 1)).ok());
  ASSERT_TRUE((*group)->CopySlot(0, 1).ok());
  EXPECT_EQ((*group)->slot_length(1), 500);
  std::vector<int32_t> tokens = {1, 1};
  const std::vector<int> slots = {0, 1};
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE((*group)->DecodeStep(slots, tokens, CudaSampling{}).ok());
    EXPECT_EQ(tokens[0], tokens[1]) << "copied slots decode the same";
  }
}

// Per-row sampling on a split model: every rank samples alike from the same logits and rank 0's
// ids come back, through Forward (sampled inputs with and without logits) and graph-replayed
// DecodeStep rows that trade settings from step to step.
TEST(CudaTensorParallelTest, SplitSamplesPerRow) {
  SKV_SKIP_WITHOUT_GPU();
  auto group = FromFile(TpSpec("llama", 256, 4, 2, true, 37), "gpu_tp_sampling")({2, true});
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  ASSERT_TRUE((*group)->AllocateKvCache(2, 600).ok());
  const int vocab = static_cast<int>((*group)->config().vocab_size);
  const CudaSampling hot{1.5f, 0, 1.0f, 4}, cut{1.0f, 10, 0.9f, 5};
  const std::vector<int32_t> a = SomeTokens(40, 5), b = SomeTokens(60, 6);
  std::vector<float> logits(vocab);
  int32_t first_a = -1, first_b = -1;
  const std::vector<CudaStepInput> inputs = {{0, a, logits.data(), &hot, &first_a},
                                             {1, b, nullptr, &cut, &first_b}};
  const Status prefilled = (*group)->Forward(inputs);
  ASSERT_TRUE(prefilled.ok()) << prefilled.ToString();
  DrawChecker checker;
  checker.Check(first_a, logits, hot, "prefill");
  ASSERT_GE(first_b, 0);
  ASSERT_LT(first_b, vocab);
  std::vector<int32_t> tokens = {first_a, first_b};
  const std::vector<int> slots = {0, 1};
  for (int step = 0; step < 4; ++step) {
    std::vector<CudaSampling> rows = {step % 2 ? cut : hot, step % 2 ? hot : cut};
    for (CudaSampling& row : rows) row.draw = step + 1;
    std::vector<float> got(2 * static_cast<size_t>(vocab));
    const Status stepped = (*group)->DecodeStep(slots, tokens, rows, got.data());
    ASSERT_TRUE(stepped.ok()) << stepped.ToString();
    for (int r = 0; r < 2; ++r) {
      const std::vector<float> row(got.begin() + r * vocab, got.begin() + (r + 1) * vocab);
      checker.Check(tokens[r], row, rows[r], "step " + std::to_string(step));
    }
  }
  EXPECT_EQ((*group)->slot_length(1), 64);
}

// NCCL: two GPUs or more.
#define SKV_SKIP_WITHOUT_NCCL_GPUS(gpus)                                             \
  SKV_SKIP_WITHOUT_GPU();                                                          \
  int gpus = 0;                                                                    \
  SKV_ASSERT_CUDA(cudaGetDeviceCount(&gpus));                                      \
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs; this machine has " << gpus;         \
  if (std::string why; !tp::NcclAvailable(&why)) GTEST_SKIP() << "NCCL unavailable: " << why

TEST(CudaTensorParallelTest, NcclAllReduceSumsAcrossGpus) {
  SKV_SKIP_WITHOUT_NCCL_GPUS(gpus);
  std::vector<int> devices(gpus);
  for (int d = 0; d < gpus; ++d) devices[d] = d;
  CheckAllReduce(tp::CreateNcclCommunicators(devices), tp::ReduceType::kFloat32, false);
  CheckAllReduce(tp::CreateNcclCommunicators(devices), tp::ReduceType::kBfloat16, true);
}

TEST(CudaTensorParallelTest, NcclAbortEndsWaitingRanks) {
  SKV_SKIP_WITHOUT_NCCL_GPUS(gpus);
  std::vector<int> devices(gpus);
  for (int d = 0; d < gpus; ++d) devices[d] = d;
  CheckAbortEndsWaitingRanks(tp::CreateNcclCommunicators(devices));
}

TEST(CudaTensorParallelTest, NcclAbortReleasesHostBarrier) {
  SKV_SKIP_WITHOUT_NCCL_GPUS(gpus);
  std::vector<int> devices(gpus);
  for (int d = 0; d < gpus; ++d) devices[d] = d;
  CheckAbortReleasesHostBarrier(tp::CreateNcclCommunicators(devices));
}

TEST(CudaTensorParallelTest, NcclSplitOverTwoGpusMatchesOneGpu) {
  SKV_SKIP_WITHOUT_NCCL_GPUS(gpus);
  CheckSplitMatches(FromFile(TpSpec("llama", 512, 8, 4, true, 35), "gpu_tp_nccl"), "gpu_tp_nccl",
                    gpus >= 4 ? std::vector<int>{2, 4} : std::vector<int>{2}, false);
}

}  // namespace
}  // namespace shadowkv::cuda
