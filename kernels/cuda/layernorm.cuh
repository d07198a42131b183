// LayerNorm over the last dimension on the GPU, mirroring cpu::LayerNorm*:
//   forward:  y = (x - mean) * rstd * gamma + beta, mean/rstd (length rows) saved for backward;
//             mean and the two-pass variance are accumulated in double, as on the CPU.
//   backward: dx overwritten; dgamma += sum_r dy * xhat and dbeta += sum_r dy (accumulate).
// Deterministic: every reduction is a fixed-order tree or loop, no atomics. Asynchronous on
// `stream`; rows == 0 is a no-op.
#ifndef PIPEWRIGHT_KERNELS_CUDA_LAYERNORM_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_LAYERNORM_CUH_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace pipewright::cuda {

absl::Status LayerNormForward(cudaStream_t stream, const float* x, const float* gamma,
                              const float* beta, float* y, float* mean, float* rstd, int rows,
                              int cols, float eps);

// dx = dL/dx (overwritten); dx may alias dy.
absl::Status LayerNormBackwardInput(cudaStream_t stream, const float* x, const float* gamma,
                                    const float* mean, const float* rstd, const float* dy,
                                    float* dx, int rows, int cols);

// dgamma += sum_r dy * xhat, dbeta += sum_r dy.
absl::Status LayerNormBackwardWeight(cudaStream_t stream, const float* x, const float* mean,
                                     const float* rstd, const float* dy, float* dgamma,
                                     float* dbeta, int rows, int cols);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_LAYERNORM_CUH_
