// The Llama family's kernels on the GPU (runtime/ops/llama_ops.cc is the CPU twin and the
// reference; Note [Llama layers] there): RMSNorm, the rotary turn, SwiGLU, the grouped-query
// expansion and its transpose, and the token embedding. Deterministic: every output is one
// thread's (or one block's fixed-order tree's) sum, no atomics. Asynchronous on `stream`; an
// empty problem is a no-op. Compile-checked here; CudaLlama.* in tests/kernels/cuda_kernels_test
// compares each with the CPU op on a GPU.
#ifndef PIPEWRIGHT_KERNELS_CUDA_LLAMA_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_LLAMA_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pipewright::cuda {

absl::Status RmsNormForward(cudaStream_t stream, const float* x, const float* w, float* y,
                            float* rstd, int rows, int cols, float eps);
absl::Status RmsNormBackwardInput(cudaStream_t stream, const float* x, const float* w,
                                  const float* rstd, const float* dy, float* dx, int rows,
                                  int cols);
// dw += sum over rows of dy * x * rstd.
absl::Status RmsNormBackwardWeight(cudaStream_t stream, const float* x, const float* rstd,
                                   const float* dy, float* dw, int rows, int cols);
// In place on x: for each row r (position first + r % T) and head h at column col + h D of a
// row of `ld` floats, pairs (i, i + D/2) turn by +-(first + r % T) theta^(-2i/D).
absl::Status Rope(cudaStream_t stream, float* x, int rows, int T, int ld, int col, int heads, int D,
                  double theta, bool inverse, int first = 0);
absl::Status SwiGluForward(cudaStream_t stream, const float* gu, float* out, int rows, int F);
absl::Status SwiGluBackward(cudaStream_t stream, const float* gu, const float* dout, float* dgu,
                            int rows, int F);
absl::Status ExpandKv(cudaStream_t stream, const float* x, float* qkv, int rows, int heads,
                      int kv_heads, int D);
absl::Status ReduceKv(cudaStream_t stream, const float* dqkv, float* dx, int rows, int heads,
                      int kv_heads, int D);
absl::Status TokenEmbeddingForward(cudaStream_t stream, const int32_t* tokens, const float* table,
                                   float* out, int n, int C);
// dtable[tokens[i]] += dout[i] in token order: one thread per column walks every token.
absl::Status TokenEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const float* dout,
                                    float* dtable, int n, int C);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_LLAMA_CUH_
