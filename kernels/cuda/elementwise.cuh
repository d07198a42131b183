// Elementwise CUDA kernels: bias, add, scale, GELU (tanh approximation) and the fused
// bias + GELU forward. Semantics are those of the same-named functions in
// kernels/cpu/cpu_kernels.h: dense row-major fp32; weight gradients (BiasBackward) accumulate with
// +=, everything else overwrites its output. All launchers are asynchronous on `stream` and
// return launch errors only; n == 0 / rows == 0 is a no-op.
//
// Aliasing: every kernel here reads an element before it writes the same element from the same
// thread, so the outputs may alias inputs exactly where the CPU versions allow it (Add's out may
// be a or b; GeluBackward's dx may be dy; BiasGeluForward's y or pre may be x).
#ifndef PIPEWRIGHT_KERNELS_CUDA_ELEMENTWISE_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_ELEMENTWISE_CUH_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"

namespace pipewright::cuda {

// y[r, c] += bias[c]
absl::Status BiasAdd(cudaStream_t stream, float* y, const float* bias, int rows, int cols);

// dbias[c] += sum_r dy[r, c]. Deterministic: one thread column of a block owns each output and
// reduces its rows in a fixed order (no atomics).
absl::Status BiasBackward(cudaStream_t stream, const float* dy, float* dbias, int rows, int cols);

// out = a + b
absl::Status Add(cudaStream_t stream, const float* a, const float* b, float* out, size_t n);

// y += x
absl::Status AddInPlace(cudaStream_t stream, float* y, const float* x, size_t n);

// x *= s
absl::Status Scale(cudaStream_t stream, float* x, size_t n, float s);

// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
absl::Status GeluForward(cudaStream_t stream, const float* x, float* y, size_t n);

// dx = dy * gelu'(x)
absl::Status GeluBackward(cudaStream_t stream, const float* x, const float* dy, float* dx,
                          size_t n);

// pre[r, c] = x[r, c] + bias[c] (skipped when pre is null); y = GeluForward(pre). One pass;
// the saved pre-activation is what GeluBackward needs as its x.
absl::Status BiasGeluForward(cudaStream_t stream, const float* x, const float* bias, float* pre,
                             float* y, int rows, int cols);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_ELEMENTWISE_CUH_
