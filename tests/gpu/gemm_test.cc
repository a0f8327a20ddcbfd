// bf16 GEMMs on cuBLAS against the CPU op (DequantGemm of a BF16 weight), fp32 and bf16 outputs.
// With SKV_GPU_BENCH=1 a micro-benchmark times a Llama-3-8B decode step's GEMMs (32 layers and
// the head, 16 rows).
#include "ops/cuda/gemm/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "ops/cuda/elementwise/fill_random.cuh"

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
  EXPECT_LT(error, output == GemmOutput::kFloat32 ? 1e-4 : kBf16OutputTolerance)
      << rows << " x " << in << " -> " << out;
  ::testing::Test::RecordProperty("relative_error_" + std::to_string(rows) + "x" +
                                      std::to_string(in) + "x" + std::to_string(out),
                                  std::to_string(error));
}

TEST(CudaGemmTest, DecodeShapeFloatOutput) {
  SKV_SKIP_WITHOUT_GPU();
  CheckGemm(1, 4096, 384, GemmOutput::kFloat32, 0.0f);
  CheckGemm(7, 576, 1536, GemmOutput::kFloat32, 0.0f);
}

TEST(CudaGemmTest, DecodeRowCountsAndOddShapes) {
  SKV_SKIP_WITHOUT_GPU();
  // Decode-sized row counts, feature and input counts that are not multiples of cuBLAS's tiles.
  for (int64_t rows : {1, 2, 8, 9, 15, 16}) {
    CheckGemm(rows, 1056, 1000, GemmOutput::kFloat32, 0.0f);
  }
  CheckGemm(16, 4096, 96, GemmOutput::kBfloat16, 0.0f);
  CheckGemm(5, 96, 77, GemmOutput::kBfloat16, 0.0f);
  CheckGemm(12, 2048, 300, GemmOutput::kFloat32, 1.0f);
}

TEST(CudaGemmTest, PrefillShapeBf16Output) {
  SKV_SKIP_WITHOUT_GPU();
  CheckGemm(300, 1024, 2048, GemmOutput::kBfloat16, 0.0f);
}

TEST(CudaGemmTest, BetaAccumulatesIntoTheOutput) {
  SKV_SKIP_WITHOUT_GPU();
  CheckGemm(16, 512, 256, GemmOutput::kFloat32, 1.0f);
}

// One Llama-3-8B decode step's GEMMs at 16 rows: per layer QKV (4096 -> 6144), O (4096 -> 4096),
// gate|up (4096 -> 28672, bf16 out), down (14336 -> 4096), each layer its own weights (so
// nothing stays in L2), then the head (4096 -> 128256). Weight bytes over time against the
// device's read rate. Timing only; SKV_GPU_BENCH=1 enables it.
// y[rows, out] = x · weightᵀ as the benches below run it.
GemmParams BenchGemm(const __nv_bfloat16* x, const __nv_bfloat16* weight, void* y,
                     GemmOutput output, int64_t rows, int64_t in, int64_t out) {
  return GemmParams{.x = x, .weight = weight, .y = y, .output = output, .rows = rows, .in = in,
                    .out = out};
}

TEST(CudaGemmBench, DecodeStepGemms) {
  SKV_SKIP_WITHOUT_GPU();
  if (std::getenv("SKV_GPU_BENCH") == nullptr) GTEST_SKIP() << "set SKV_GPU_BENCH=1 to run";
  constexpr int kLayers = 32, kRows = 16;
  struct Shape {
    int64_t in, out;
    GemmOutput output;
  };
  const Shape layer_shapes[] = {{4096, 6144, GemmOutput::kFloat32},
                                {4096, 4096, GemmOutput::kFloat32},
                                {4096, 28672, GemmOutput::kBfloat16},
                                {14336, 4096, GemmOutput::kFloat32}};
  const Shape head{4096, 128256, GemmOutput::kFloat32};
  int64_t layer_elements = 0;
  for (const Shape& s : layer_shapes) layer_elements += s.in * s.out;
  DeviceBuffer<__nv_bfloat16> weights, head_weight, x;
  DeviceBuffer<float> y;
  ASSERT_TRUE(weights.Allocate(layer_elements * kLayers).ok());
  ASSERT_TRUE(head_weight.Allocate(head.in * head.out).ok());
  ASSERT_TRUE(x.Allocate(kRows * 14336).ok());
  ASSERT_TRUE(y.Allocate(kRows * 128256).ok());
  SKV_ASSERT_CUDA(LaunchFillRandom({weights.get(), weights.size(), 0.02f, 21}, nullptr));
  SKV_ASSERT_CUDA(LaunchFillRandom({head_weight.get(), head_weight.size(), 0.02f, 22}, nullptr));
  SKV_ASSERT_CUDA(LaunchFillRandom({x.get(), x.size(), 1.0f, 23}, nullptr));
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const double bytes = 2.0 * (layer_elements * kLayers + head.in * head.out);
  {
    double shape_ms[5] = {};
    auto run = [&](bool per_shape) {
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      cudaEventRecord(start);
      float total = 0;
      for (int s = 0; s < 5; ++s) {
        if (per_shape) cudaEventRecord(start);
        const Shape& shape = s < 4 ? layer_shapes[s] : head;
        int64_t offset = 0;
        for (int i = 0; i < s && s < 4; ++i) offset += layer_shapes[i].in * layer_shapes[i].out;
        for (int layer = 0; layer < (s < 4 ? kLayers : 1); ++layer) {
          const __nv_bfloat16* weight =
              s < 4 ? weights.get() + layer * layer_elements + offset : head_weight.get();
          EXPECT_TRUE(RunGemm(handle, BenchGemm(x.get(), weight, y.get(), shape.output, kRows,
                                                shape.in, shape.out))
                          .ok());
        }
        if (per_shape) {
          cudaEventRecord(stop);
          cudaEventSynchronize(stop);
          float ms = 0;
          cudaEventElapsedTime(&ms, start, stop);
          shape_ms[s] = ms;
          total += ms;
        }
      }
      if (!per_shape) {
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        cudaEventElapsedTime(&total, start, stop);
      }
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      return static_cast<double>(total);
    };
    run(false);  // warm-up (cuBLAS heuristics)
    std::vector<double> totals;
    for (int i = 0; i < 5; ++i) totals.push_back(run(false));
    std::sort(totals.begin(), totals.end());
    run(true);
    std::printf("[bench] gemm: %.3f ms = %.0f GB/s for a decode step's GEMMs (qkv %.3f, "
                "o %.3f, gate_up %.3f, down %.3f, head %.3f ms)\n",
                totals[2], bytes / totals[2] / 1e6, shape_ms[0], shape_ms[1], shape_ms[2],
                shape_ms[3], shape_ms[4]);
  }
  cublasDestroy(handle);
  SKV_ASSERT_CUDA(cudaDeviceSynchronize());
}

// With SKV_GPU_BENCH=1: each decode GEMM of a Llama-3-8B step (32 layers' distinct weights, or
// the head) at several row counts, through cublasGemmEx as RunGemm calls it and through every
// algorithm cuBLASLt's heuristic offers for the same problem (32 MiB workspace), so the room an
// algorithm search would leave shows. Prints ms per step for the default and the fastest.
TEST(CudaGemmBench, LtAlgorithmsAtDecodeRows) {
  SKV_SKIP_WITHOUT_GPU();
  if (std::getenv("SKV_GPU_BENCH") == nullptr) GTEST_SKIP() << "set SKV_GPU_BENCH=1 to run";
  constexpr int kLayers = 32, kMaxRows = 48, kAlgorithms = 16;
  struct Shape {
    const char* name;
    int64_t in, out;
    GemmOutput output;
    int copies;
  };
  const Shape shapes[] = {{"qkv", 4096, 6144, GemmOutput::kFloat32, kLayers},
                          {"o", 4096, 4096, GemmOutput::kFloat32, kLayers},
                          {"gate_up", 4096, 28672, GemmOutput::kBfloat16, kLayers},
                          {"down", 14336, 4096, GemmOutput::kFloat32, kLayers},
                          {"head", 4096, 128256, GemmOutput::kFloat32, 1}};
  int64_t largest = 0;
  for (const Shape& s : shapes) largest = std::max(largest, s.in * s.out * s.copies);
  DeviceBuffer<__nv_bfloat16> weights, x;
  DeviceBuffer<float> y;
  DeviceBuffer<uint8_t> workspace;
  ASSERT_TRUE(weights.Allocate(largest).ok());
  ASSERT_TRUE(x.Allocate(int64_t{kMaxRows} * 14336).ok());
  ASSERT_TRUE(y.Allocate(int64_t{kMaxRows} * 128256).ok());
  ASSERT_TRUE(workspace.Allocate(32 << 20).ok());
  SKV_ASSERT_CUDA(LaunchFillRandom({weights.get(), weights.size(), 0.02f, 31}, nullptr));
  SKV_ASSERT_CUDA(LaunchFillRandom({x.get(), x.size(), 1.0f, 32}, nullptr));
  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  // Median of 5 timings of `pass` (one pass = every copy of a shape once), after one warm-up.
  auto time = [&](auto&& pass) {
    pass();
    std::vector<float> ms(5);
    for (float& m : ms) {
      cudaEventRecord(start);
      pass();
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      cudaEventElapsedTime(&m, start, stop);
    }
    std::sort(ms.begin(), ms.end());
    return static_cast<double>(ms[2]);
  };
  for (const int rows : {8, 16, 20, 24, 42}) {
    double step_default = 0.0, step_best = 0.0;
    std::string line;
    for (const Shape& s : shapes) {
      const double default_ms = time([&] {
        for (int copy = 0; copy < s.copies; ++copy) {
          EXPECT_TRUE(RunGemm(handle, BenchGemm(x.get(), weights.get() + copy * s.in * s.out,
                                                y.get(), s.output, rows, s.in, s.out))
                          .ok());
        }
      });
      // The same problem for cuBLASLt: column-major yᵀ[out, rows] = Wᵀ·xᵀ, W read as [in, out].
      const cudaDataType_t y_type = s.output == GemmOutput::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
      cublasLtMatmulDesc_t op = nullptr;
      cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
      cublasLtMatmulPreference_t preference = nullptr;
      ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
      const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose));
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep));
      cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, s.in, s.out, s.in);
      cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, s.in, rows, s.in);
      cublasLtMatrixLayoutCreate(&c, y_type, s.out, rows, s.out);
      cublasLtMatmulPreferenceCreate(&preference);
      const uint64_t workspace_bytes = workspace.bytes();
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes, sizeof(workspace_bytes));
      cublasLtMatmulHeuristicResult_t results[kAlgorithms];
      int returned = 0;
      cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, preference, kAlgorithms, results,
                                     &returned);
      double best_ms = default_ms;
      int best_index = -1;
      for (int i = 0; i < returned; ++i) {
        const float alpha = 1.0f, beta = 0.0f;
        bool ok = true;
        const double ms = time([&] {
          for (int copy = 0; copy < s.copies; ++copy) {
            ok = ok && cublasLtMatmul(lt, op, &alpha, weights.get() + copy * s.in * s.out, a,
                                      x.get(), b, &beta, y.get(), c, y.get(), c, &results[i].algo,
                                      workspace.get(), workspace_bytes,
                                      nullptr) == CUBLAS_STATUS_SUCCESS;
          }
        });
        if (ok && ms < best_ms) {
          best_ms = ms;
          best_index = i;
        }
      }
      cublasLtMatmulPreferenceDestroy(preference);
      cublasLtMatrixLayoutDestroy(a);
      cublasLtMatrixLayoutDestroy(b);
      cublasLtMatrixLayoutDestroy(c);
      cublasLtMatmulDescDestroy(op);
      step_default += default_ms;
      step_best += best_ms;
      line += fmt::format(" {} {:.3f}/{:.3f} (#{} of {})", s.name, default_ms, best_ms, best_index,
                          returned);
    }
    const double bytes = 2.0 * (32.0 * (4096.0 * 6144 + 4096.0 * 4096 + 4096.0 * 28672 +
                                        14336.0 * 4096) +
                                4096.0 * 128256);
    std::printf("[bench] gemm rows %d: cublasGemmEx %.3f ms (%.0f GB/s), best cuBLASLt %.3f ms "
                "(%.0f GB/s); per shape default/best ms:%s\n",
                rows, step_default, bytes / step_default / 1e6, step_best,
                bytes / step_best / 1e6, line.c_str());
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasLtDestroy(lt);
  cublasDestroy(handle);
  SKV_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace shadowkv::cuda
