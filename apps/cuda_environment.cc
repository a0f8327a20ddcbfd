// Reads the CUDA subcommands' environment variables into the library's options.
#include "cuda_environment.h"

#ifdef SHADOWKV_HAVE_CUDA

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "gpu/tp/communicator.h"

namespace shadowkv::app {
namespace {

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

Result<cuda::CudaKernelOptions> KernelOptionsFromEnvironment() {
  cuda::CudaKernelOptions k;
  SKV_RETURN_IF_ERROR(Read("SKV_DECODE_VARIANT", &k.decode_attention_variant));
  SKV_RETURN_IF_ERROR(Read("SKV_PREFILL_VARIANT", &k.prefill_attention_variant));
  SKV_RETURN_IF_ERROR(Read("SKV_GEMM_VARIANT", &k.gemm_variant));
  SKV_RETURN_IF_ERROR(Read("SKV_SHADOWKV_KERNELS", &k.shadowkv_kernels));
  SKV_RETURN_IF_ERROR(Read("SKV_SELECT_COARSE", &k.coarse_select));
  SKV_RETURN_IF_ERROR(Read("SKV_SELECT_REGISTERS", &k.select_registers));
  SKV_RETURN_IF_ERROR(ReadFlag("SKV_SPLIT_ROWS", /*only_one=*/false, &k.split_rows));
  SKV_RETURN_IF_ERROR(Read("SKV_SPLIT_SHARE", &k.split_share));
  SKV_RETURN_IF_ERROR(Read("SKV_REBUILD_SLOTS", &k.rebuild_slots));
  SKV_RETURN_IF_ERROR(Read("SKV_ATTN_SPLITS", &k.attention_splits));
  return k;
}

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
