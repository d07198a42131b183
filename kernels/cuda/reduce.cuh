// Multi-tensor reductions for gradient checks and global norms, mirroring cpu::AllFinite and
// cpu::SumSquares over many tensors at once. Tensor lists are HOST arrays of DEVICE pointers;
// they are copied into kernel parameters (kReduceTensorsPerLaunch per launch), so they may be
// freed when the call returns. Results land in DEVICE memory in stream order.
//
// Deterministic: the number of blocks given to a tensor depends only on its size, each block
// sums a fixed element subset in a fixed order (in double), and a second kernel adds each
// tensor's block partials in block order. No atomics.
#ifndef PIPEWRIGHT_KERNELS_CUDA_REDUCE_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_REDUCE_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pipewright::cuda {

inline constexpr int kReduceTensorsPerLaunch = 64;

// *d_flag = 1 when every element of every tensor is finite (count == 0 included), else 0.
// Exponent-bit test, like the CPU: immune to fast-math.
absl::Status AllFiniteMulti(cudaStream_t stream, const float* const* host_ptrs,
                            const int64_t* host_sizes, int count, int* d_flag);

// d_out[i] = sum of squares of tensor i, accumulated in double (d_out: `count` doubles).
// Block partials live in a small stream-ordered scratch (cudaMallocAsync/cudaFreeAsync on
// `stream`, at most 64 doubles per tensor of one launch batch, i.e. <= 32 KiB).
absl::Status SumSquaresMulti(cudaStream_t stream, const float* const* host_ptrs,
                             const int64_t* host_sizes, int count, double* d_out);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_REDUCE_CUH_
