// Fused softmax cross-entropy on the GPU, mirroring cpu::SoftmaxCrossEntropy*: per row
// loss = logsumexp(logits[r]) - logits[r, targets[r]], max-subtracted, the exp-sum and the
// log-sum-exp in double. targets[r] < 0 ignores the row. A target >= vocab (a caller bug; UB on
// the CPU) is not read out of bounds: its loss and gradient row are NaN so it cannot go unnoticed.
// Deterministic (fixed-order reductions, no atomics); asynchronous on `stream`.
#ifndef PIPEWRIGHT_KERNELS_CUDA_CROSS_ENTROPY_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_CROSS_ENTROPY_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pipewright::cuda {

// logits [rows, vocab], targets [rows] (device). Writes to DEVICE memory:
//   *d_loss_sum = sum of per-row losses over non-ignored rows (double),
//   *d_count    = number of non-ignored rows (may be null).
// row_loss: caller-owned device scratch of `rows` doubles; on return (in stream order) it holds
// each row's loss (0 for ignored rows). It must not be in use by other work on other streams.
// rows == 0 writes 0 and 0.
absl::Status SoftmaxCrossEntropyForward(cudaStream_t stream, const float* logits,
                                        const int32_t* targets, int rows, int vocab,
                                        double* row_loss, double* d_loss_sum, int64_t* d_count);

// dlogits[r, :] = scale * (softmax(logits[r]) - onehot(targets[r])); zero for ignored rows.
// dlogits may alias logits.
// Tensor parallelism's vocab-parallel loss (ops::RowMax, CrossEntropyPartStats,
// CrossEntropyPartBackward): stats is [3, rows] f64 = (sum of exp(logit - M), target logit, M).
absl::Status RowMax(cudaStream_t stream, const float* logits, int rows, int cols, float* max);
absl::Status CrossEntropyPartStats(cudaStream_t stream, const float* logits, const int32_t* targets,
                                   int64_t begin, const float* maxima, int ranks, int rows,
                                   int cols, double* stats);
absl::Status CrossEntropyPartBackward(cudaStream_t stream, const float* logits,
                                      const int32_t* targets, int64_t begin, const double* stats,
                                      int rows, int cols, float scale, float* dlogits);

absl::Status SoftmaxCrossEntropyBackward(cudaStream_t stream, const float* logits,
                                         const int32_t* targets, int rows, int vocab, float scale,
                                         float* dlogits);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_CROSS_ENTROPY_CUH_
