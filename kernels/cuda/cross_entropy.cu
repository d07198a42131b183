// Softmax cross-entropy kernels (see cross_entropy.cuh): one block per row for the row passes
// (max, exp-sum), then a single block sums the per-row losses in a fixed order.
#include <cuda_runtime.h>
#include <math_constants.h>

#include "absl/strings/str_format.h"
#include "kernels/cuda/cross_entropy.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/kernel_util.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kSumThreads = 1024;

struct RowStats {
  float max;
  double sum_exp;  // sum_j exp(logit_j - max)
};

// Both passes over one row; every thread of the block gets the result.
__device__ __forceinline__ RowStats ComputeRowStats(const float* row, int vocab, float* fscratch,
                                                    double* dscratch) {
  float mx = -CUDART_INF_F;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = internal::BlockMax(mx, fscratch, -CUDART_INF_F);
  double sum = 0.0;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    sum += static_cast<double>(expf(row[j] - mx));
  }
  sum = internal::BlockSum(sum, dscratch);
  return {mx, sum};
}

__global__ void __launch_bounds__(kRowThreads)
    RowLossKernel(const float* logits, const int32_t* targets, int vocab, double* row_loss) {
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  const size_t r = blockIdx.x;
  const int32_t t = targets[r];  // uniform across the block: the early returns are too
  if (t < 0) {
    if (threadIdx.x == 0) row_loss[r] = 0.0;
    return;
  }
  if (t >= vocab) {
    if (threadIdx.x == 0) row_loss[r] = CUDART_NAN;
    return;
  }
  const float* row = logits + r * vocab;
  const RowStats st = ComputeRowStats(row, vocab, fscratch, dscratch);
  if (threadIdx.x == 0) {
    const double lse = log(st.sum_exp) + static_cast<double>(st.max);
    row_loss[r] = lse - static_cast<double>(row[t]);
  }
}

// One block: thread i sums rows i, i + 1024, ... in order, then a fixed tree.
__global__ void __launch_bounds__(kSumThreads)
    SumLossKernel(const double* row_loss, const int32_t* targets, int rows, double* d_loss_sum,
                  int64_t* d_count) {
  __shared__ double dscratch[32];
  __shared__ long long cscratch[32];
  double sum = 0.0;
  long long count = 0;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    if (targets[r] >= 0) {
      sum += row_loss[r];
      ++count;
    }
  }
  sum = internal::BlockSum(sum, dscratch);
  count = internal::BlockSum(count, cscratch);
  if (threadIdx.x == 0) {
    *d_loss_sum = sum;
    if (d_count != nullptr) *d_count = static_cast<int64_t>(count);
  }
}

__global__ void __launch_bounds__(kRowThreads)
    CrossEntropyBackwardKernel(const float* logits, const int32_t* targets, int vocab, float scale,
                               float* dlogits) {
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  const size_t r = blockIdx.x;
  const int32_t t = targets[r];
  const float* row = logits + r * vocab;
  float* drow = dlogits + r * vocab;
  if (t < 0 || t >= vocab) {
    const float fill = t < 0 ? 0.0f : CUDART_NAN_F;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) drow[j] = fill;
    return;
  }
  const RowStats st = ComputeRowStats(row, vocab, fscratch, dscratch);
  // Same as the CPU: k = scale / sum in double, rounded to float; the target entry subtracts
  // scale after the multiply. Every read of row[] above precedes these writes (the block
  // reductions end in a barrier), so dlogits may alias logits.
  const float k = static_cast<float>(scale / st.sum_exp);
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    float v = expf(row[j] - st.max) * k;
    if (j == t) v -= scale;
    drow[j] = v;
  }
}

// Tensor parallelism's vocab-parallel loss: one block per row, the CPU's expressions per element
// (the sums in the block's tree order).
__global__ void __launch_bounds__(kRowThreads)
    RowMaxKernel(const float* logits, int cols, float* max) {
  __shared__ float fscratch[32];
  const size_t r = blockIdx.x;
  float mx = -CUDART_INF_F;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) mx = fmaxf(mx, logits[r * cols + j]);
  mx = internal::BlockMax(mx, fscratch, -CUDART_INF_F);
  if (threadIdx.x == 0) max[r] = mx;
}

__global__ void __launch_bounds__(kRowThreads)
    CrossEntropyPartStatsKernel(const float* logits, const int32_t* targets, int64_t begin,
                                const float* maxima, int ranks, int rows, int cols, double* stats) {
  __shared__ double dscratch[32];
  const int r = blockIdx.x;
  float m = -CUDART_INF_F;
  for (int k = 0; k < ranks; ++k) m = fmaxf(m, maxima[static_cast<size_t>(k) * rows + r]);
  const int32_t t = targets[r];  // uniform across the block
  const float* row = logits + static_cast<size_t>(r) * cols;
  double sum = 0.0;
  if (t >= 0) {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
      sum += exp(static_cast<double>(row[j]) - static_cast<double>(m));
    }
    sum = internal::BlockSum(sum, dscratch);
  }
  if (threadIdx.x == 0) {
    const int64_t v = static_cast<int64_t>(t) - begin;
    stats[r] = t >= 0 ? sum : 0.0;
    stats[rows + r] = t >= 0 && v >= 0 && v < cols ? static_cast<double>(row[v]) : 0.0;
    stats[2 * static_cast<size_t>(rows) + r] = m;
  }
}

__global__ void CrossEntropyPartBackwardKernel(const float* logits, const int32_t* targets,
                                               int64_t begin, const double* stats, int rows,
                                               int cols, float scale, float* dlogits) {
  const size_t total = static_cast<size_t>(rows) * cols;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / cols), j = static_cast<int>(i % cols);
    const int32_t t = targets[r];
    if (t < 0) {
      dlogits[i] = 0.0f;
      continue;
    }
    const double m = stats[2 * static_cast<size_t>(rows) + r], inv = 1.0 / stats[r];
    const double p = exp(static_cast<double>(logits[i]) - m) * inv;
    dlogits[i] = static_cast<float>(scale * (p - (begin + j == t ? 1.0 : 0.0)));
  }
}

absl::Status CheckShape(const char* op, int rows, int vocab) {
  if (rows < 0 || vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: bad shape rows=%d vocab=%d", op, rows, vocab));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SoftmaxCrossEntropyForward(cudaStream_t stream, const float* logits,
                                        const int32_t* targets, int rows, int vocab,
                                        double* row_loss, double* d_loss_sum, int64_t* d_count) {
  PW_RETURN_IF_ERROR(CheckShape("SoftmaxCrossEntropyForward", rows, vocab));
  if (rows > 0) {
    RowLossKernel<<<rows, kRowThreads, 0, stream>>>(logits, targets, vocab, row_loss);
    PW_CUDA_LAUNCH_CHECK("RowLossKernel");
  }
  SumLossKernel<<<1, kSumThreads, 0, stream>>>(row_loss, targets, rows, d_loss_sum, d_count);
  PW_CUDA_LAUNCH_CHECK("SumLossKernel");
  return absl::OkStatus();
}

absl::Status SoftmaxCrossEntropyBackward(cudaStream_t stream, const float* logits,
                                         const int32_t* targets, int rows, int vocab, float scale,
                                         float* dlogits) {
  PW_RETURN_IF_ERROR(CheckShape("SoftmaxCrossEntropyBackward", rows, vocab));
  if (rows == 0) return absl::OkStatus();
  CrossEntropyBackwardKernel<<<rows, kRowThreads, 0, stream>>>(logits, targets, vocab, scale,
                                                               dlogits);
  PW_CUDA_LAUNCH_CHECK("CrossEntropyBackwardKernel");
  return absl::OkStatus();
}

absl::Status RowMax(cudaStream_t stream, const float* logits, int rows, int cols, float* max) {
  PW_RETURN_IF_ERROR(CheckShape("RowMax", rows, cols));
  if (rows == 0) return absl::OkStatus();
  RowMaxKernel<<<rows, kRowThreads, 0, stream>>>(logits, cols, max);
  PW_CUDA_LAUNCH_CHECK("RowMaxKernel");
  return absl::OkStatus();
}

absl::Status CrossEntropyPartStats(cudaStream_t stream, const float* logits, const int32_t* targets,
                                   int64_t begin, const float* maxima, int ranks, int rows,
                                   int cols, double* stats) {
  PW_RETURN_IF_ERROR(CheckShape("CrossEntropyPartStats", rows, cols));
  if (rows == 0) return absl::OkStatus();
  CrossEntropyPartStatsKernel<<<rows, kRowThreads, 0, stream>>>(logits, targets, begin, maxima,
                                                                ranks, rows, cols, stats);
  PW_CUDA_LAUNCH_CHECK("CrossEntropyPartStatsKernel");
  return absl::OkStatus();
}

absl::Status CrossEntropyPartBackward(cudaStream_t stream, const float* logits,
                                      const int32_t* targets, int64_t begin, const double* stats,
                                      int rows, int cols, float scale, float* dlogits) {
  PW_RETURN_IF_ERROR(CheckShape("CrossEntropyPartBackward", rows, cols));
  const size_t total = static_cast<size_t>(rows) * cols;
  if (total == 0) return absl::OkStatus();
  CrossEntropyPartBackwardKernel<<<internal::GridFor(total), internal::kElementwiseThreads, 0,
                                   stream>>>(logits, targets, begin, stats, rows, cols, scale,
                                             dlogits);
  PW_CUDA_LAUNCH_CHECK("CrossEntropyPartBackwardKernel");
  return absl::OkStatus();
}

}  // namespace pipewright::cuda
