// Lab for ShadowKV's basis fit on the GPU: every layer's Gram matrix of pre-RoPE keys solved at
// once (cuSOLVER's batched symmetric eigensolver, fp32) against one layer at a time (syevdx, top
// `rank` only), at the key widths of the models we run (kv_heads x head_dim: Qwen2.5-0.5B 128,
// Qwen2.5-7B 512, Llama-3-8B 1024). The fp32 results are checked against the same batched solver
// in fp64: the distance between the two top-`rank` subspaces, sqrt((rank - |V32ᵀ V64|²_F) / rank).
// Gram matrices come from random keys whose columns fall off in scale (a decaying spectrum, as real
// keys have). On the H200, 2026-12-02 (docs/results/h200_eigen_batched_lab_fe8f917.log), batched
// against a layer at a time: 24 x 128 wide 0.75 against 32.3 ms; 28 x 512 18.7 against 134; 32 x
// 1024 76.7 against 368 (with 558 MB of workspace); fp32's subspace within 4e-4, 3e-4 and 9e-3
// of fp64's. The library solves batched up to width 512 (CudaKernelOptions::basis_gpu_max_width)
// and on the host past it. Not built by CMake:
//   nvcc -O3 -std=c++20 -arch=sm_90a dev/cuda/eigen_batched_lab.cu -lcublas -lcusolver -o eigen_lab
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                              \
  do {                                                                        \
    auto e = (x);                                                             \
    if (static_cast<int>(e) != 0) {                                           \
      std::printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, static_cast<int>(e)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

namespace {

struct Shape {
  const char* name;
  int width;
  int layers;
  int rank;
};

// G[l] = X[l]ᵀ X[l] for random X [rows, width] with column j scaled by 1/(1 + j/8), fp32 and fp64.
void MakeGrams(cublasHandle_t blas, const Shape& s, int rows, float* g32, double* g64) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows) * s.width);
  float* dx = nullptr;
  CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
  std::vector<float> g(static_cast<size_t>(s.width) * s.width);
  for (int l = 0; l < s.layers; ++l) {
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < s.width; ++j) {
        x[static_cast<size_t>(r) * s.width + j] = normal(rng) / (1.0f + j / 8.0f);
      }
    }
    CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    const float one = 1.0f, zero = 0.0f;
    float* out = g32 + static_cast<size_t>(l) * s.width * s.width;
    CHECK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, s.width, s.width, rows, &one, dx, s.width,
                      dx, s.width, &zero, out, s.width));
    CHECK(cudaMemcpy(g.data(), out, g.size() * sizeof(float), cudaMemcpyDeviceToHost));
    std::vector<double> gd(g.begin(), g.end());
    CHECK(cudaMemcpy(g64 + static_cast<size_t>(l) * s.width * s.width, gd.data(),
                     gd.size() * sizeof(double), cudaMemcpyHostToDevice));
  }
  CHECK(cudaFree(dx));
}

}  // namespace

int main() {
  const Shape shapes[] = {{"Qwen2.5-0.5B", 128, 24, 48},
                          {"Qwen2.5-7B", 512, 28, 96},
                          {"Llama-3-8B", 1024, 32, 160}};
  cublasHandle_t blas;
  cusolverDnHandle_t solver;
  cusolverDnParams_t params;
  CHECK(cublasCreate(&blas));
  CHECK(cusolverDnCreate(&solver));
  CHECK(cusolverDnCreateParams(&params));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  for (const Shape& s : shapes) {
    const size_t entries = static_cast<size_t>(s.layers) * s.width * s.width;
    float *g32, *a32, *w32;
    double *g64, *a64, *w64;
    int* info;
    CHECK(cudaMalloc(&g32, entries * 4));
    CHECK(cudaMalloc(&a32, entries * 4));
    CHECK(cudaMalloc(&g64, entries * 8));
    CHECK(cudaMalloc(&a64, entries * 8));
    CHECK(cudaMalloc(&w32, static_cast<size_t>(s.layers) * s.width * 4));
    CHECK(cudaMalloc(&w64, static_cast<size_t>(s.layers) * s.width * 8));
    CHECK(cudaMalloc(&info, s.layers * 4));
    MakeGrams(blas, s, 4096, g32, g64);

    // Batched, fp32 and fp64.
    auto batched = [&](bool fp64, int reps) {
      const cudaDataType type = fp64 ? CUDA_R_64F : CUDA_R_32F;
      void* a = fp64 ? static_cast<void*>(a64) : static_cast<void*>(a32);
      void* w = fp64 ? static_cast<void*>(w64) : static_cast<void*>(w32);
      size_t device_bytes = 0, host_bytes = 0;
      CHECK(cusolverDnXsyevBatched_bufferSize(solver, params, CUSOLVER_EIG_MODE_VECTOR,
                                              CUBLAS_FILL_MODE_LOWER, s.width, type, a, s.width,
                                              type, w, type, &device_bytes, &host_bytes,
                                              s.layers));
      void* work = nullptr;
      CHECK(cudaMalloc(&work, device_bytes + 16));
      std::vector<char> host_work(host_bytes + 16);
      float best = 1e30f;
      for (int rep = 0; rep < reps; ++rep) {
        CHECK(cudaMemcpy(a, fp64 ? static_cast<void*>(g64) : static_cast<void*>(g32),
                         entries * (fp64 ? 8 : 4), cudaMemcpyDeviceToDevice));
        CHECK(cudaEventRecord(t0));
        CHECK(cusolverDnXsyevBatched(solver, params, CUSOLVER_EIG_MODE_VECTOR,
                                     CUBLAS_FILL_MODE_LOWER, s.width, type, a, s.width, type, w,
                                     type, work, device_bytes, host_work.data(), host_bytes, info,
                                     s.layers));
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (ms < best) best = ms;
      }
      std::vector<int> infos(s.layers);
      CHECK(cudaMemcpy(infos.data(), info, s.layers * 4, cudaMemcpyDeviceToHost));
      int bad = 0;
      for (int v : infos) bad += v != 0;
      std::printf("%-13s width %4d x %2d layers: batched %s %8.3f ms (best of %d), workspace %zu B "
                  "device %zu B host, %d failed\n",
                  s.name, s.width, s.layers, fp64 ? "fp64" : "fp32", best, reps, device_bytes,
                  host_bytes, bad);
      CHECK(cudaFree(work));
    };
    batched(false, 5);
    batched(true, 2);

    // One layer at a time, top `rank` only (syevdx), fp32.
    {
      size_t device_bytes = 0, host_bytes = 0;
      int64_t found = 0;
      float vl = 0, vu = 0;
      CHECK(cusolverDnXsyevdx_bufferSize(
          solver, params, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER,
          s.width, CUDA_R_32F, a32, s.width, &vl, &vu, s.width - s.rank + 1, s.width, &found,
          CUDA_R_32F, w32, CUDA_R_32F, &device_bytes, &host_bytes));
      void* work = nullptr;
      CHECK(cudaMalloc(&work, device_bytes + 16));
      std::vector<char> host_work(host_bytes + 16);
      std::vector<float> a_copy(entries);
      float best = 1e30f;
      for (int rep = 0; rep < 3; ++rep) {
        CHECK(cudaMemcpy(a32 + 0, g32, entries * 4, cudaMemcpyDeviceToDevice));
        CHECK(cudaEventRecord(t0));
        for (int l = 0; l < s.layers; ++l) {
          const size_t off = static_cast<size_t>(l) * s.width * s.width;
          CHECK(cusolverDnXsyevdx(solver, params, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I,
                                  CUBLAS_FILL_MODE_LOWER, s.width, CUDA_R_32F, a32 + off, s.width,
                                  &vl, &vu, s.width - s.rank + 1, s.width, &found, CUDA_R_32F,
                                  w32 + static_cast<size_t>(l) * s.width, CUDA_R_32F, work,
                                  device_bytes, host_work.data(), host_bytes, info + l));
        }
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (ms < best) best = ms;
      }
      std::printf("%-13s width %4d x %2d layers: syevdx top %d, a layer at a time %8.3f ms\n",
                  s.name, s.width, s.layers, s.rank, best);
      CHECK(cudaFree(work));
    }

    // Accuracy of the batched fp32 solve: its top-rank subspace against fp64's.
    batched(false, 1);
    batched(true, 1);
    std::vector<float> v32(entries);
    std::vector<double> v64(entries);
    CHECK(cudaMemcpy(v32.data(), a32, entries * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(v64.data(), a64, entries * 8, cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (int l = 0; l < s.layers; ++l) {
      const size_t off = static_cast<size_t>(l) * s.width * s.width;
      double overlap = 0.0;  // |V32ᵀ V64|²_F over the top `rank` columns (ascending: the last)
      for (int i = s.width - s.rank; i < s.width; ++i) {
        for (int j = s.width - s.rank; j < s.width; ++j) {
          double dot = 0.0;
          for (int k = 0; k < s.width; ++k) {
            dot += v32[off + static_cast<size_t>(i) * s.width + k] *
                   v64[off + static_cast<size_t>(j) * s.width + k];
          }
          overlap += dot * dot;
        }
      }
      worst = std::fmax(worst, std::sqrt(std::fmax(0.0, s.rank - overlap) / s.rank));
    }
    std::printf("%-13s top-%d subspace, fp32 against fp64: worst layer distance %.2e\n", s.name,
                s.rank, worst);
    cudaFree(g32), cudaFree(a32), cudaFree(g64), cudaFree(a64), cudaFree(w32), cudaFree(w64);
    cudaFree(info);
  }
  return 0;
}
