// GPU RMSNorm (with the fused residual add, the normalised delta of the post norms, and the row
// gather) against the CPU ops.
#include "ops/cuda/norm/rmsnorm.cuh"

#include "gpu_test_util.h"
#include "ops/cpu/elementwise.h"

namespace shadowkv::cuda {
namespace {

using namespace testing;

void CheckRmsNorm(int rows, int width, bool with_delta, std::vector<int32_t> row_index,
                  bool norm_delta = false) {
  std::mt19937 rng(rows * 31 + width + (with_delta ? 7 : 0) + (norm_delta ? 3 : 0));
  std::vector<float> x = RandomFloats(static_cast<int64_t>(rows) * width, rng, 3.0f, 0.5f);
  const std::vector<float> delta = RandomFloats(static_cast<int64_t>(rows) * width, rng);
  const std::vector<float> weight = RandomFloats(width, rng, 0.2f, 1.0f);
  const std::vector<float> delta_weight = RandomFloats(width, rng, 0.3f, 0.8f);
  const float eps = 1e-5f;
  const int out_rows = row_index.empty() ? rows : static_cast<int>(row_index.size());

  auto device_x = ToDevice(x);
  auto device_delta = ToDevice(delta);
  auto device_weight = ToDevice(weight);
  auto device_delta_weight = ToDevice(delta_weight);
  auto device_index = ToDevice(row_index);
  auto out = Poisoned<uint16_t>(static_cast<int64_t>(out_rows) * width);
  RmsNormParams p;
  p.x = device_x.get();
  p.delta = with_delta ? device_delta.get() : nullptr;
  p.delta_weight = norm_delta ? device_delta_weight.get() : nullptr;
  p.weight = device_weight.get();
  p.out = reinterpret_cast<__nv_bfloat16*>(out.get());
  p.row_index = row_index.empty() ? nullptr : device_index.get();
  p.rows = out_rows;
  p.width = width;
  p.eps = eps;
  SKV_ASSERT_CUDA(LaunchRmsNorm(p, nullptr));
  const std::vector<float> got = ToHostBf16(out);
  const std::vector<float> got_x = ToHost(device_x);

  // CPU: the residual add (only on the rows normalised; with the delta normalised first, as the
  // CPU model's post norms do), then the norm of each output row.
  std::vector<float> want_x = x;
  std::vector<float> want(got.size());
  for (int i = 0; i < out_rows; ++i) {
    const int row = row_index.empty() ? i : row_index[i];
    float* x_row = want_x.data() + static_cast<int64_t>(row) * width;
    if (with_delta) {
      std::vector<float> add(delta.begin() + static_cast<int64_t>(row) * width,
                             delta.begin() + static_cast<int64_t>(row + 1) * width);
      if (norm_delta) RmsNorm(add.data(), delta_weight.data(), 1, width, eps, add.data());
      AddInPlace(x_row, add.data(), width);
    }
    RmsNorm(x_row, weight.data(), 1, width, eps, want.data() + static_cast<int64_t>(i) * width);
  }
  if (norm_delta) {  // the delta's scale comes from rsqrtf on the GPU, fp64 on the CPU
    EXPECT_LT(RelativeError(got_x, want_x), 1e-6);
  } else {
    for (size_t i = 0; i < got_x.size(); ++i) ASSERT_EQ(got_x[i], want_x[i]) << "x element " << i;
  }
  const double error = RelativeError(got, want);
  EXPECT_LT(error, kBf16OutputTolerance);
  ::testing::Test::RecordProperty("relative_error", std::to_string(error));
}

TEST(CudaRmsNormTest, NormOnly) {
  SKV_SKIP_WITHOUT_GPU();
  CheckRmsNorm(5, 4096, false, {});
}

TEST(CudaRmsNormTest, FusedResidualAdd) {
  SKV_SKIP_WITHOUT_GPU();
  CheckRmsNorm(9, 576, true, {});
}

TEST(CudaRmsNormTest, GatheredRowsGetTheAddAndTheNorm) {
  SKV_SKIP_WITHOUT_GPU();
  CheckRmsNorm(12, 1000, true, {11, 0, 5});
}

// x += norm(delta)·w_post; out = norm(x)·w (Gemma 3's and GLM-4's post norms), on every row and
// on gathered rows, at a width of one partial batch and of several.
TEST(CudaRmsNormTest, NormalisedDeltaJoinsTheResidual) {
  SKV_SKIP_WITHOUT_GPU();
  CheckRmsNorm(6, 64, true, {}, true);
  CheckRmsNorm(7, 3000, true, {}, true);
  CheckRmsNorm(12, 1000, true, {11, 0, 5}, true);
}

}  // namespace
}  // namespace shadowkv::cuda
