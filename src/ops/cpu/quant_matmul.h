// Matrix-vector products on GGML-block weights (Q4_0, Q4_1, Q8_0, F16, F32) for CPU decode.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "format/gguf.h"

namespace shadowkv {

// A weight matrix W [rows, cols] in a GGML type, row-major. Row r starts at data + r * row_bytes;
// the bytes usually point into the memory-mapped model file and are only read.
struct QuantMatrix {
  gguf::GgmlType type = gguf::GgmlType::kF32;
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;
};

// Instruction sets the kernels are written for. kBest picks AVX2 where the CPU has it (checked
// once at run time), else scalar; the others force a path (tests compare them).
enum class CpuIsa { kBest, kScalar, kAvx2 };
bool CpuIsaAvailable(CpuIsa isa);

// True for the types QuantMatVec handles: kQ4_0, kQ4_1, kQ8_0, kF16, kF32.
bool QuantMatVecSupports(gguf::GgmlType type);

// Bytes of one packed row of `cols` elements of `type` (cols must be a whole number of blocks).
size_t QuantRowBytes(gguf::GgmlType type, int64_t cols);

// y [batch, rows] = x [batch, cols] * W^T, i.e. y[b * rows + r] = sum_c W[r][c] * x[b * cols + c].
// For the block types the activations are first rounded to 8 bits per 32-element block (one
// fp32 scale each), so results differ from the exact product by at most
// sum_c |W[r][c]| * scale_of_block(c) / 2; F16 and F32 weights use the fp32 activations as given.
// Rows are split over the pool's threads; every weight byte is read once per call whatever the
// batch. The result does not depend on the number of threads. Block types need cols % 32 == 0.
// The pool must not be running another loop (ParallelFor takes one caller at a time).
void QuantMatVec(const QuantMatrix& w, const float* x, int64_t batch, float* y, ThreadPool& pool,
                 CpuIsa isa = CpuIsa::kBest);

// Quantises w [rows, cols] (cols % 32 == 0) to Q8_0 blocks: per 32 values one fp16 scale
// d = max|w| / 127 and int8 q = round(w / d). Returns rows * QuantRowBytes(kQ8_0, cols) bytes.
// Used to serve weight types the kernels lack (K-quants, BF16) after dequantising them.
std::vector<uint8_t> QuantizeRowsQ8_0(const float* w, int64_t rows, int64_t cols);

}  // namespace shadowkv
