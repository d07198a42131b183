// Multi-tensor finite check and sum of squares (see reduce.cuh).
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/kernel_util.cuh"
#include "kernels/cuda/reduce.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kElemsPerBlock = int64_t{kThreads} * 16;  // target work of one block
constexpr int kMaxBlocksPerTensor = 64;

struct TensorBatch {
  const float* ptrs[kReduceTensorsPerLaunch];
  int64_t sizes[kReduceTensorsPerLaunch];
  // Blocks [block_start[i], block_start[i + 1]) cover tensor i.
  int block_start[kReduceTensorsPerLaunch + 1];
  int count;
};
static_assert(sizeof(TensorBatch) <= 4000, "kernel parameters must stay under 4 KB");

// Depends only on n: this is what makes the summation order fixed.
int BlocksFor(int64_t n) {
  int64_t b = (n + kElemsPerBlock - 1) / kElemsPerBlock;
  if (b < 1) b = 1;
  if (b > kMaxBlocksPerTensor) b = kMaxBlocksPerTensor;
  return static_cast<int>(b);
}

struct BlockRange {
  int tensor;
  int index;   // block index within the tensor
  int blocks;  // blocks of the tensor
};

__device__ __forceinline__ BlockRange FindBlock(const TensorBatch& batch) {
  const int block = blockIdx.x;
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.block_start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, block - batch.block_start[lo], batch.block_start[lo + 1] - batch.block_start[lo]};
}

__global__ void SetFlagKernel(int* flag) { *flag = 1; }

__global__ void __launch_bounds__(kThreads) AllFiniteKernel(const TensorBatch batch, int* flag) {
  const BlockRange br = FindBlock(batch);
  const float* x = batch.ptrs[br.tensor];
  const int64_t n = batch.sizes[br.tensor];
  const int64_t stride = static_cast<int64_t>(br.blocks) * kThreads;
  int bad = 0;
  for (int64_t i = static_cast<int64_t>(br.index) * kThreads + threadIdx.x; i < n; i += stride) {
    const unsigned int u = __float_as_uint(x[i]);
    bad |= (u & 0x7F800000u) == 0x7F800000u;
  }
  // Every writer stores the same value, so the result does not depend on ordering.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 0;
}

__global__ void __launch_bounds__(kThreads)
    SumSquaresPartialKernel(const TensorBatch batch, double* partials) {
  __shared__ double scratch[32];
  const BlockRange br = FindBlock(batch);
  const float* x = batch.ptrs[br.tensor];
  const int64_t n = batch.sizes[br.tensor];
  const int64_t stride = static_cast<int64_t>(br.blocks) * kThreads;
  double s = 0.0;
  for (int64_t i = static_cast<int64_t>(br.index) * kThreads + threadIdx.x; i < n; i += stride) {
    const double d = x[i];
    s += d * d;
  }
  s = internal::BlockSum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One thread per tensor of the batch: adds its block partials in block order.
__global__ void SumSquaresFinalKernel(const TensorBatch batch, const double* partials,
                                      double* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= batch.count) return;
  double s = 0.0;
  for (int b = batch.block_start[t]; b < batch.block_start[t + 1]; ++b) s += partials[b];
  out[t] = s;
}

absl::Status CheckList(const char* op, const float* const* ptrs, const int64_t* sizes, int count) {
  if (count < 0 || (count > 0 && (ptrs == nullptr || sizes == nullptr))) {
    return absl::InvalidArgumentError(std::string(op) + ": bad tensor list");
  }
  for (int i = 0; i < count; ++i) {
    if (sizes[i] < 0) return absl::InvalidArgumentError(std::string(op) + ": negative size");
  }
  return absl::OkStatus();
}

// Calls launch(batch, blocks, first_tensor_index) for consecutive batches of the list.
template <typename Launch>
absl::Status ForEachBatch(const float* const* ptrs, const int64_t* sizes, int count,
                          Launch&& launch) {
  for (int first = 0; first < count; first += kReduceTensorsPerLaunch) {
    TensorBatch batch;
    batch.count = count - first < kReduceTensorsPerLaunch ? count - first : kReduceTensorsPerLaunch;
    int blocks = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.ptrs[i] = ptrs[first + i];
      batch.sizes[i] = sizes[first + i];
      batch.block_start[i] = blocks;
      blocks += BlocksFor(sizes[first + i]);
    }
    batch.block_start[batch.count] = blocks;
    PW_RETURN_IF_ERROR(launch(batch, blocks, first));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AllFiniteMulti(cudaStream_t stream, const float* const* host_ptrs,
                            const int64_t* host_sizes, int count, int* d_flag) {
  PW_RETURN_IF_ERROR(CheckList("AllFiniteMulti", host_ptrs, host_sizes, count));
  SetFlagKernel<<<1, 1, 0, stream>>>(d_flag);
  PW_CUDA_LAUNCH_CHECK("SetFlagKernel");
  return ForEachBatch(host_ptrs, host_sizes, count,
                      [&](const TensorBatch& batch, int blocks, int) -> absl::Status {
                        AllFiniteKernel<<<blocks, kThreads, 0, stream>>>(batch, d_flag);
                        PW_CUDA_LAUNCH_CHECK("AllFiniteKernel");
                        return absl::OkStatus();
                      });
}

absl::Status SumSquaresMulti(cudaStream_t stream, const float* const* host_ptrs,
                             const int64_t* host_sizes, int count, double* d_out) {
  PW_RETURN_IF_ERROR(CheckList("SumSquaresMulti", host_ptrs, host_sizes, count));
  if (count == 0) return absl::OkStatus();
  // Scratch for the largest batch: every batch runs after the previous one in stream order, so
  // they can share it.
  double* partials = nullptr;
  const size_t bytes = sizeof(double) * kReduceTensorsPerLaunch * kMaxBlocksPerTensor;
  PW_CUDA_RETURN_IF_ERROR(cudaMallocAsync(reinterpret_cast<void**>(&partials), bytes, stream));
  absl::Status status =
      ForEachBatch(host_ptrs, host_sizes, count,
                   [&](const TensorBatch& batch, int blocks, int first) -> absl::Status {
                     SumSquaresPartialKernel<<<blocks, kThreads, 0, stream>>>(batch, partials);
                     PW_CUDA_LAUNCH_CHECK("SumSquaresPartialKernel");
                     SumSquaresFinalKernel<<<1, kReduceTensorsPerLaunch, 0, stream>>>(
                         batch, partials, d_out + first);
                     PW_CUDA_LAUNCH_CHECK("SumSquaresFinalKernel");
                     return absl::OkStatus();
                   });
  const absl::Status freed =
      ToStatus(cudaFreeAsync(partials, stream), "cudaFreeAsync(partials)", __FILE__, __LINE__);
  return status.ok() ? freed : status;
}

}  // namespace pipewright::cuda
