// CudaKernelOptions as CudaModel takes them: a kernel variant that does not exist is refused at
// load, naming the op and the value (checked before the GPU is looked for, so it runs anywhere).
#include <gtest/gtest.h>

#include "gpu/model/cuda_model.h"
#include "model/synthetic.h"

namespace shadowkv::cuda {
namespace {

Status CreateWith(const CudaKernelOptions& kernels) {
  auto config = SyntheticModelConfig("llama3-8b");
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  CudaModelOptions options;
  options.kernels = kernels;
  return CudaModel::CreateSynthetic(*config, 1, options).status();
}

TEST(CudaKernelOptionsTest, UnknownVariantsAreRefusedByName) {
  struct Case {
    CudaKernelOptions kernels;
    const char* names;
  };
  CudaKernelOptions decode, prefill, gemm, negative;
  decode.decode_attention_variant = 6;
  prefill.prefill_attention_variant = 99;
  gemm.gemm_variant = 3;
  negative.decode_attention_variant = -2;
  for (const Case& c :
       {Case{decode, "decode attention variant 6"}, Case{prefill, "prefill attention variant 99"},
        Case{gemm, "GEMM variant 3"}, Case{negative, "decode attention variant -2"}}) {
    const Status status = CreateWith(c.kernels);
    EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find(c.names), std::string::npos) << status.ToString();
  }
}

}  // namespace
}  // namespace shadowkv::cuda
