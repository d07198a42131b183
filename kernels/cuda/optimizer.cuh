// Multi-tensor AdamW on the GPU: one launch updates many parameter tensors with exactly the math
// of cpu::AdamWUpdate (decoupled weight decay; bias corrections computed on the host in double
// and rounded to float, as on the CPU). The device code uses explicitly rounded operations
// (__fmul_rn, __fadd_rn, ...) so no multiply-add is contracted into an FMA: results match the
// CPU reference bit for bit when the CPU build does not contract either (the default x86-64
// build does not).
//
// Passing the tensor list: the list is copied BY VALUE into the kernel's parameter space, up to
// kAdamWTensorsPerLaunch tensors per launch (about 3.3 KB, under the 4 KB parameter limit); longer
// lists are split into several launches on the same stream. No device buffer, no host-to-device
// copy and no synchronisation: the host list may be freed as soon as AdamWMulti returns. Each
// block updates one fixed-size chunk of one tensor; a block table in the same parameter block
// maps blocks to tensors.
#ifndef PIPEWRIGHT_KERNELS_CUDA_OPTIMIZER_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_OPTIMIZER_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pipewright::cuda {

// One parameter tensor of n floats (all four pointers device memory, n may be 0).
struct AdamWTensor {
  float* param;
  const float* grad;
  float* m;
  float* v;
  int64_t n;
  float weight_decay;
};

inline constexpr int kAdamWTensorsPerLaunch = 64;

// For every tensor: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p), mhat = m / (1 - b1^t), vhat = v / (1 - b2^t).
// host_list: `count` entries in HOST memory. t >= 1 (InvalidArgument otherwise).
absl::Status AdamWMulti(cudaStream_t stream, const AdamWTensor* host_list, int count, float lr,
                        float beta1, float beta2, float eps, int64_t t);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_OPTIMIZER_CUH_
