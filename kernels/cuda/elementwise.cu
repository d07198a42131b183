// Elementwise kernels (see elementwise.cuh). Grid-stride loops over size_t indices, so any n
// works with the capped grid of internal::GridFor.
#include <cuda_runtime.h>

#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/kernel_util.cuh"

namespace pipewright::cuda {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// Same formula and evaluation order as cpu::GeluForward (tanhf instead of the CPU's FastTanh;
// both are within ~1e-7 of tanh).
__device__ __forceinline__ float Gelu(float v) {
  const float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
  return 0.5f * v * (1.0f + tanhf(u));
}

__device__ __forceinline__ float GeluGrad(float v) {
  const float u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
  const float t = tanhf(u);
  const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v * v);
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
}

#define PW_GRID_STRIDE(i, n)                                                           \
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<size_t>(gridDim.x) * blockDim.x)

__global__ void BiasAddKernel(float* y, const float* bias, size_t total, int cols) {
  PW_GRID_STRIDE(i, total) { y[i] += bias[i % cols]; }
}

// Column reduction layout shared with LayerNormBackwardWeight: a block of kColTile x kRowLanes
// threads owns kColTile adjacent columns; lane ty sums rows ty, ty + kRowLanes, ... in order,
// then lane 0 adds the kRowLanes partials in order. Coalesced (a warp reads 32 adjacent floats
// of one row) and the summation order depends only on rows.
constexpr int kColTile = 32;
constexpr int kRowLanes = 16;

__global__ void BiasBackwardKernel(const float* dy, float* dbias, int rows, int cols) {
  __shared__ float partial[kRowLanes][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * kColTile + tx;
  float sum = 0.0f;
  if (col < cols) {
    for (int r = ty; r < rows; r += kRowLanes) sum += dy[static_cast<size_t>(r) * cols + col];
  }
  partial[ty][tx] = sum;
  __syncthreads();
  if (ty == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowLanes; ++i) total += partial[i][tx];
    dbias[col] += total;
  }
}

__global__ void AddKernel(const float* a, const float* b, float* out, size_t n) {
  PW_GRID_STRIDE(i, n) { out[i] = a[i] + b[i]; }
}

__global__ void AddInPlaceKernel(float* y, const float* x, size_t n) {
  PW_GRID_STRIDE(i, n) { y[i] += x[i]; }
}

__global__ void ScaleKernel(float* x, size_t n, float s) {
  PW_GRID_STRIDE(i, n) { x[i] *= s; }
}

__global__ void GeluForwardKernel(const float* x, float* y, size_t n) {
  PW_GRID_STRIDE(i, n) { y[i] = Gelu(x[i]); }
}

__global__ void GeluBackwardKernel(const float* x, const float* dy, float* dx, size_t n) {
  PW_GRID_STRIDE(i, n) { dx[i] = dy[i] * GeluGrad(x[i]); }
}

__global__ void BiasGeluForwardKernel(const float* x, const float* bias, float* pre, float* y,
                                      size_t total, int cols) {
  PW_GRID_STRIDE(i, total) {
    const float v = x[i] + bias[i % cols];
    if (pre != nullptr) pre[i] = v;
    y[i] = Gelu(v);
  }
}

#undef PW_GRID_STRIDE

absl::Status CheckRowsCols(const char* op, int rows, int cols) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: negative shape rows=%d cols=%d", op, rows, cols));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status BiasAdd(cudaStream_t stream, float* y, const float* bias, int rows, int cols) {
  PW_RETURN_IF_ERROR(CheckRowsCols("BiasAdd", rows, cols));
  const size_t total = static_cast<size_t>(rows) * cols;
  if (total == 0) return absl::OkStatus();
  BiasAddKernel<<<internal::GridFor(total), internal::kElementwiseThreads, 0, stream>>>(
      y, bias, total, cols);
  PW_CUDA_LAUNCH_CHECK("BiasAddKernel");
  return absl::OkStatus();
}

absl::Status BiasBackward(cudaStream_t stream, const float* dy, float* dbias, int rows, int cols) {
  PW_RETURN_IF_ERROR(CheckRowsCols("BiasBackward", rows, cols));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const dim3 block(kColTile, kRowLanes);
  BiasBackwardKernel<<<internal::CeilDiv(cols, kColTile), block, 0, stream>>>(dy, dbias, rows,
                                                                              cols);
  PW_CUDA_LAUNCH_CHECK("BiasBackwardKernel");
  return absl::OkStatus();
}

absl::Status Add(cudaStream_t stream, const float* a, const float* b, float* out, size_t n) {
  if (n == 0) return absl::OkStatus();
  AddKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(a, b, out, n);
  PW_CUDA_LAUNCH_CHECK("AddKernel");
  return absl::OkStatus();
}

absl::Status AddInPlace(cudaStream_t stream, float* y, const float* x, size_t n) {
  if (n == 0) return absl::OkStatus();
  AddInPlaceKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(y, x, n);
  PW_CUDA_LAUNCH_CHECK("AddInPlaceKernel");
  return absl::OkStatus();
}

absl::Status Scale(cudaStream_t stream, float* x, size_t n, float s) {
  if (n == 0) return absl::OkStatus();
  ScaleKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(x, n, s);
  PW_CUDA_LAUNCH_CHECK("ScaleKernel");
  return absl::OkStatus();
}

absl::Status GeluForward(cudaStream_t stream, const float* x, float* y, size_t n) {
  if (n == 0) return absl::OkStatus();
  GeluForwardKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(x, y, n);
  PW_CUDA_LAUNCH_CHECK("GeluForwardKernel");
  return absl::OkStatus();
}

absl::Status GeluBackward(cudaStream_t stream, const float* x, const float* dy, float* dx,
                          size_t n) {
  if (n == 0) return absl::OkStatus();
  GeluBackwardKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(x, dy, dx,
                                                                                         n);
  PW_CUDA_LAUNCH_CHECK("GeluBackwardKernel");
  return absl::OkStatus();
}

absl::Status BiasGeluForward(cudaStream_t stream, const float* x, const float* bias, float* pre,
                             float* y, int rows, int cols) {
  PW_RETURN_IF_ERROR(CheckRowsCols("BiasGeluForward", rows, cols));
  const size_t total = static_cast<size_t>(rows) * cols;
  if (total == 0) return absl::OkStatus();
  BiasGeluForwardKernel<<<internal::GridFor(total), internal::kElementwiseThreads, 0, stream>>>(
      x, bias, pre, y, total, cols);
  PW_CUDA_LAUNCH_CHECK("BiasGeluForwardKernel");
  return absl::OkStatus();
}

}  // namespace pipewright::cuda
