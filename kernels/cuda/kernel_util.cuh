// Internal helpers shared by the kernel .cu files (not part of the public kernel API): launch
// geometry and deterministic warp/block reductions. Every reduction here combines values in a
// fixed tree order, so a given launch configuration always produces the same bits.
#ifndef PIPEWRIGHT_KERNELS_CUDA_KERNEL_UTIL_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_KERNEL_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pipewright::cuda::internal {

// Threads per block of the grid-stride elementwise kernels.
inline constexpr int kElementwiseThreads = 256;

// Blocks for a grid-stride loop over n elements: enough to cover n once, capped so the grid stays
// small for huge n (each thread then loops). Always >= 1 so a launch with n == 0 stays valid.
inline unsigned int GridFor(size_t n, int threads = kElementwiseThreads) {
  constexpr size_t kMaxBlocks = size_t{1} << 20;
  size_t blocks = (n + static_cast<size_t>(threads) - 1) / static_cast<size_t>(threads);
  if (blocks == 0) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned int>(blocks);
}

inline constexpr int CeilDiv(int a, int b) { return (a + b - 1) / b; }

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ __forceinline__ T WarpMax(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  return v;
}

// Sum over a 1-D block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` is 32 elements of shared memory; the block may call this repeatedly with the same
// scratch (the leading barrier protects the previous call's broadcast slot).
template <typename T>
__device__ __forceinline__ T BlockSum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < num_warps ? scratch[lane] : T(0);
    w = WarpSum(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

// Max over a 1-D block; same contract as BlockSum. `lowest` is the identity (e.g. -inf).
template <typename T>
__device__ __forceinline__ T BlockMax(T v, T* scratch, T lowest) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < num_warps ? scratch[lane] : lowest;
    w = WarpMax(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

}  // namespace pipewright::cuda::internal

#endif  // PIPEWRIGHT_KERNELS_CUDA_KERNEL_UTIL_CUH_
