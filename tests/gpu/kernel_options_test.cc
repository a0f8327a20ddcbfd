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
  for (const int variant : {2, -1}) {
    CudaKernelOptions kernels;
    kernels.shadowkv_kernels = variant;
    const Status status = CreateWith(kernels);
    EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("ShadowKV kernels variant " + std::to_string(variant)),
              std::string::npos)
        << status.ToString();
  }
}

}  // namespace
}  // namespace shadowkv::cuda
