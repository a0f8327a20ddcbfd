// The CUDA subcommands' kernel tuning flags and tensor-parallel environment variables, turned
// into the library's options.
#include "cuda_environment.h"

#include "options.h"

namespace shadowkv::app {
namespace {

// Splits per (row, KV head) at most: kDecodeMaxSplits of ops/cuda/attention/decode_attention.cuh,
// which only CUDA builds can include (checked against it below).
constexpr int kMaxAttentionSplits = 64;

// What the tuning flags set; defaults are the library's. Flags are parsed once per process.
cuda::CudaKernelOptions& TuningFlags() {
  static cuda::CudaKernelOptions tuning;
  return tuning;
}

}  // namespace

void AddKernelTuningOptions(CLI::App& app) {
  cuda::CudaKernelOptions& k = TuningFlags();
  app.add_option("--shadowkv-kernels", k.shadowkv_kernels,
                 "cuda shadowkv: 1 the decode kernels of the library, 0 the first generation "
                 "(which models without full-width rotary run)")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 1}));
  app.add_option("--coarse-select", k.coarse_select,
                 "cuda shadowkv: 1 the top-k select narrows on coarse digits first, 0 the "
                 "four-digit select over every key")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 1}));
  app.add_option("--select-registers", k.select_registers,
                 "cuda shadowkv: registers per thread of the coarse select, 32 or 0 (64)")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 32}));
  app.add_flag("--split-rows,!--no-split-rows", k.split_rows,
               "cuda shadowkv: a step of 4 rows or more runs its selection and attention in two "
               "parts on their own streams")
      ->capture_default_str();
  app.add_option("--split-share", k.split_share,
                 "cuda shadowkv: percent of a split step's rows in its first part")
      ->capture_default_str()
      ->check(CLI::Range(10, 90));
  app.add_option("--rebuild-slots", k.rebuild_slots,
                 "cuda shadowkv: gather slots per key-rebuild block (0: 32)")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 32, 64, 128}));
  app.add_option("--stored-key-prefetch", k.stored_key_prefetch,
                 "cuda shadowkv exact_keys: 1 the re-rank reads the stored keys ahead of the "
                 "tile it scores; 0 a tile at a time")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 1}));
  app.add_option("--attention-splits", k.attention_splits,
                 "cuda shadowkv: split count of the sparse attention (0: the full attention's "
                 "rule for the step's rows)")
      ->capture_default_str()
      ->check(CLI::Range(0, kMaxAttentionSplits));
  app.add_option("--basis-gpu-width", k.basis_gpu_max_width,
                 "cuda shadowkv: key widths (KV heads x head dim) up to this fit the compression's "
                 "key basis on the GPU, wider ones on the host (0: always on the host)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 16));
}

}  // namespace shadowkv::app

#ifdef SHADOWKV_HAVE_CUDA

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "gpu/tp/communicator.h"
#include "ops/cuda/attention/decode_attention.cuh"

namespace shadowkv::app {
namespace {

static_assert(kMaxAttentionSplits == cuda::kDecodeMaxSplits);

// The integer in variable `name`: nullopt when unset or empty, an error when not an integer.
Result<std::optional<int>> ReadInt(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::optional<int>();
  const std::string_view value(text);
  int parsed = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  if (error != std::errc() || end != value.data() + value.size()) {
    return Error(ErrorCode::kInvalidArgument, "{}='{}' is not an integer", name, value);
  }
  return std::optional<int>(parsed);
}

// `*field` = the variable's value where it is set.
Status Read(const char* name, int* field) {
  SKV_ASSIGN_OR_RETURN(const std::optional<int> value, ReadInt(name));
  if (value) *field = *value;
  return Status::Ok();
}

// `*field` = whether the variable is 1 (to = 1) or not 0 (to != 0), where it is set.
Status ReadFlag(const char* name, bool only_one, bool* field) {
  SKV_ASSIGN_OR_RETURN(const std::optional<int> value, ReadInt(name));
  if (value) *field = only_one ? *value == 1 : *value != 0;
  return Status::Ok();
}

}  // namespace

cuda::CudaKernelOptions KernelOptionsFromFlags() { return TuningFlags(); }

Status ApplyTensorParallelEnvironment(TensorParallelOptions* tp) {
  bool local = false;
  SKV_RETURN_IF_ERROR(ReadFlag("SHADOWKV_TP_LOCAL", /*only_one=*/true, &local));
  tp->local = tp->local || local;
  cuda::tp::ProcessSettings& settings = cuda::tp::MutableProcessSettings();
  SKV_RETURN_IF_ERROR(ReadFlag("SHADOWKV_TP_TRACE", /*only_one=*/true, &settings.trace));
  SKV_RETURN_IF_ERROR(Read("SHADOWKV_TP_STEP_TIMEOUT_S", &settings.step_timeout_s));
  if (settings.step_timeout_s < 0) {
    return Error(ErrorCode::kInvalidArgument, "SHADOWKV_TP_STEP_TIMEOUT_S={} is negative",
                 settings.step_timeout_s);
  }
  if (const char* path = std::getenv("SHADOWKV_NCCL_LIBRARY"); path != nullptr) {
    settings.nccl_library = path;
  }
  return Status::Ok();
}

}  // namespace shadowkv::app

#endif  // SHADOWKV_HAVE_CUDA
