// Token + learned position embedding on the GPU, mirroring cpu::Embedding*:
//   forward:  out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]   (overwrites out)
//   backward: dwte[tokens[b, t], :] += dout[b, t, :]; dwpe[t, :] += sum_b dout[b, t, :]
// Tokens must be in [0, V) (the caller checks, as on the CPU; there is no V argument, so an
// out-of-range token is an out-of-bounds access on the device).
//
// The backward is deterministic and BITWISE equal to the CPU: each output element is updated by
// one thread, adding its contributions in the CPU's order (row b*T + t ascending) with one
// rounding per addition. dwte work is split over columns and over token ids modulo a fixed
// number of partitions (a thread handles the ids of its partition for one column), so repeated
// tokens never race and no atomics are needed.
#ifndef PIPEWRIGHT_KERNELS_CUDA_EMBEDDING_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_EMBEDDING_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pipewright::cuda {

absl::Status EmbeddingForward(cudaStream_t stream, const int32_t* tokens, const float* wte,
                              const float* wpe, float* out, int B, int T, int C);

absl::Status EmbeddingBackward(cudaStream_t stream, const float* dout, const int32_t* tokens,
                               float* dwte, float* dwpe, int B, int T, int C);

// Tensor parallelism's vocab-parallel embedding (ops::EmbeddingPartForward/Backward): the token
// rows [begin, begin + part) only; `wpe` may be null in the forward (no positions added).
absl::Status EmbeddingPartForward(cudaStream_t stream, const int32_t* tokens, const float* wte_part,
                                  int64_t begin, int64_t part, const float* wpe, float* out, int B,
                                  int T, int C);
absl::Status EmbeddingPartBackward(cudaStream_t stream, const float* dout, const int32_t* tokens,
                                   int64_t begin, int64_t part, float* dwte_part, float* dwpe,
                                   int B, int T, int C);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_EMBEDDING_CUH_
