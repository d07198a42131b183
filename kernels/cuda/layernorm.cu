// LayerNorm kernels (see layernorm.cuh). Forward and backward-input use one block per row;
// backward-weight uses one block per 32 columns looping over all rows (column reduction).
#include <cuda_runtime.h>

#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/kernel_util.cuh"
#include "kernels/cuda/layernorm.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kColTile = 32;
constexpr int kRowLanes = 16;

__global__ void __launch_bounds__(kRowThreads)
    LayerNormForwardKernel(const float* x, const float* gamma, const float* beta, float* y,
                           float* mean, float* rstd, int cols, float eps) {
  __shared__ double scratch[32];
  const size_t r = blockIdx.x;
  const float* xr = x + r * cols;
  float* yr = y + r * cols;
  const double inv_n = 1.0 / cols;
  double sum = 0.0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += xr[c];
  sum = internal::BlockSum(sum, scratch);
  const float mu = static_cast<float>(sum * inv_n);
  double sq = 0.0;  // two-pass variance, as on the CPU
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const double d = static_cast<double>(xr[c]) - mu;
    sq += d * d;
  }
  sq = internal::BlockSum(sq, scratch);
  const float rs = static_cast<float>(1.0 / sqrt(sq * inv_n + eps));
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    yr[c] = (xr[c] - mu) * rs * gamma[c] + beta[c];
  }
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

__global__ void __launch_bounds__(kRowThreads)
    LayerNormBackwardInputKernel(const float* x, const float* gamma, const float* mean,
                                 const float* rstd, const float* dy, float* dx, int cols) {
  __shared__ float scratch[32];
  const size_t r = blockIdx.x;
  const float* xr = x + r * cols;
  const float* dyr = dy + r * cols;
  float* dxr = dx + r * cols;
  const float mu = mean[r], rs = rstd[r];
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma
  float sum_g = 0.0f, sum_gx = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = dyr[c] * gamma[c];
    const float xhat = (xr[c] - mu) * rs;
    sum_g += g;
    sum_gx += g * xhat;
  }
  sum_g = internal::BlockSum(sum_g, scratch);
  sum_gx = internal::BlockSum(sum_gx, scratch);
  const float inv_n = 1.0f / static_cast<float>(cols);
  const float mean_g = sum_g * inv_n, mean_gx = sum_gx * inv_n;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = dyr[c] * gamma[c];
    const float xhat = (xr[c] - mu) * rs;
    dxr[c] = rs * (g - mean_g - xhat * mean_gx);
  }
}

// kColTile x kRowLanes threads own kColTile columns; lane ty walks rows ty, ty + kRowLanes, ...
// and lane 0 adds the partials in lane order, so the result depends only on the inputs.
__global__ void LayerNormBackwardWeightKernel(const float* x, const float* mean, const float* rstd,
                                              const float* dy, float* dgamma, float* dbeta,
                                              int rows, int cols) {
  __shared__ float part_g[kRowLanes][kColTile + 1];
  __shared__ float part_b[kRowLanes][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * kColTile + tx;
  float sg = 0.0f, sb = 0.0f;
  if (col < cols) {
    for (int r = ty; r < rows; r += kRowLanes) {
      const size_t idx = static_cast<size_t>(r) * cols + col;
      const float d = dy[idx];
      sg += d * (x[idx] - mean[r]) * rstd[r];
      sb += d;
    }
  }
  part_g[ty][tx] = sg;
  part_b[ty][tx] = sb;
  __syncthreads();
  if (ty == 0 && col < cols) {
    float tg = 0.0f, tb = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowLanes; ++i) {
      tg += part_g[i][tx];
      tb += part_b[i][tx];
    }
    dgamma[col] += tg;
    dbeta[col] += tb;
  }
}

absl::Status CheckShape(const char* op, int rows, int cols) {
  if (rows < 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: bad shape rows=%d cols=%d", op, rows, cols));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LayerNormForward(cudaStream_t stream, const float* x, const float* gamma,
                              const float* beta, float* y, float* mean, float* rstd, int rows,
                              int cols, float eps) {
  PW_RETURN_IF_ERROR(CheckShape("LayerNormForward", rows, cols));
  if (rows == 0) return absl::OkStatus();
  LayerNormForwardKernel<<<rows, kRowThreads, 0, stream>>>(x, gamma, beta, y, mean, rstd, cols,
                                                           eps);
  PW_CUDA_LAUNCH_CHECK("LayerNormForwardKernel");
  return absl::OkStatus();
}

absl::Status LayerNormBackwardInput(cudaStream_t stream, const float* x, const float* gamma,
                                    const float* mean, const float* rstd, const float* dy,
                                    float* dx, int rows, int cols) {
  PW_RETURN_IF_ERROR(CheckShape("LayerNormBackwardInput", rows, cols));
  if (rows == 0) return absl::OkStatus();
  LayerNormBackwardInputKernel<<<rows, kRowThreads, 0, stream>>>(x, gamma, mean, rstd, dy, dx,
                                                                 cols);
  PW_CUDA_LAUNCH_CHECK("LayerNormBackwardInputKernel");
  return absl::OkStatus();
}

absl::Status LayerNormBackwardWeight(cudaStream_t stream, const float* x, const float* mean,
                                     const float* rstd, const float* dy, float* dgamma,
                                     float* dbeta, int rows, int cols) {
  PW_RETURN_IF_ERROR(CheckShape("LayerNormBackwardWeight", rows, cols));
  if (rows == 0) return absl::OkStatus();
  const dim3 block(kColTile, kRowLanes);
  LayerNormBackwardWeightKernel<<<internal::CeilDiv(cols, kColTile), block, 0, stream>>>(
      x, mean, rstd, dy, dgamma, dbeta, rows, cols);
  PW_CUDA_LAUNCH_CHECK("LayerNormBackwardWeightKernel");
  return absl::OkStatus();
}

}  // namespace pipewright::cuda
