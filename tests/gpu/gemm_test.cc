// cuBLAS bf16 GEMMs against the CPU op (DequantGemm of a BF16 weight), fp32 and bf16 outputs.
#include "ops/cuda/gemm.h"

#include "core/thread_pool.h"
#include "gpu_test_util.h"
#include "ops/cpu/gemm.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

void CheckGemm(int64_t rows, int64_t in, int64_t out, GemmOutput output, float beta) {
  std::mt19937 rng(static_cast<uint32_t>(rows * 131 + in + out));
  const std::vector<float> x = RandomBf16Values(rows * in, rng);
  const std::vector<float> w = RandomBf16Values(out * in, rng, 1.0f / std::sqrt(float(in)));
  const std::vector<float> initial = RandomFloats(rows * out, rng);
  const std::vector<uint16_t> w_bf16 = ToBf16(w);
  auto device_x = ToDevice(ToBf16(x));
  auto device_w = ToDevice(w_bf16);
  auto y32 = beta != 0.0f ? ToDevice(initial) : Poisoned<float>(rows * out);
  auto y16 = Poisoned<uint16_t>(rows * out);

  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  GemmParams p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(device_x.get());
  p.weight = reinterpret_cast<const __nv_bfloat16*>(device_w.get());
  p.y = output == GemmOutput::kFloat32 ? static_cast<void*>(y32.get()) : y16.get();
  p.output = output;
  p.rows = rows;
  p.in = in;
  p.out = out;
  p.beta = beta;
  const Status status = RunGemm(handle, p);
  ASSERT_TRUE(status.ok()) << status.ToString();
  const std::vector<float> got = output == GemmOutput::kFloat32 ? ToHost(y32) : ToHostBf16(y16);
  cublasDestroy(handle);

  QuantMatrix matrix{gguf::GgmlType::kBF16, reinterpret_cast<const uint8_t*>(w_bf16.data()), out,
                     in, static_cast<size_t>(in) * 2};
  std::vector<float> want(rows * out);
  ThreadPool pool(2);
  DequantGemm(matrix, x.data(), rows, want.data(), pool);
  if (beta != 0.0f) {
    for (size_t i = 0; i < want.size(); ++i) want[i] += beta * initial[i];
  }
  const double error = RelativeError(got, want);
  // Same bf16 operands on both sides: an fp32 output differs only by summation order (and the
  // tensor cores' accumulation), far below bf16 rounding.
  EXPECT_LT(error, output == GemmOutput::kFloat32 ? 1e-4 : kBf16OutputTolerance);
  ::testing::Test::RecordProperty("relative_error", std::to_string(error));
}

TEST(CudaGemmTest, DecodeShapeFloatOutput) {
  SKV_SKIP_WITHOUT_GPU();
  CheckGemm(1, 4096, 384, GemmOutput::kFloat32, 0.0f);
  CheckGemm(7, 576, 1536, GemmOutput::kFloat32, 0.0f);
}

TEST(CudaGemmTest, PrefillShapeBf16Output) {
  SKV_SKIP_WITHOUT_GPU();
  CheckGemm(300, 1024, 2048, GemmOutput::kBfloat16, 0.0f);
}

TEST(CudaGemmTest, BetaAccumulatesIntoTheOutput) {
  SKV_SKIP_WITHOUT_GPU();
  CheckGemm(16, 512, 256, GemmOutput::kFloat32, 1.0f);
}

}  // namespace
}  // namespace shadowkv::cuda
