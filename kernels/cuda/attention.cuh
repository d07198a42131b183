// Causal multi-head self-attention on the GPU as fused, flash-attention-style fp32 kernels: the
// T x T score/probability matrix never exists in global memory.
//
// Layout (same as cpu::AttentionForward): qkv [B, T, 3C] = (q | k | v), C = H * D, head h at
// columns [h*D, (h+1)*D) of each third; out [B, T, C]; scale 1/sqrt(D); key j attends to query
// i iff j <= i. Head dims: any D in [1, 128] (kernels are instantiated for D <= 32, 64, 128 and
// zero-pad up to that); any T >= 1.
//
// Instead of cpu's probs [B,H,T,T], the forward saves lse [B, H, T]: the log-sum-exp of each
// query row's scaled scores, from which the backward recomputes P = exp(scale q.k - lse) tile
// by tile.
//
// Determinism: no atomics. Every output element is produced by exactly one thread summing in a
// fixed order: the backward runs one kernel over key tiles (dK, dV) and one over query tiles
// (dQ), each recomputing the probabilities it needs.
#ifndef PIPEWRIGHT_KERNELS_CUDA_ATTENTION_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_ATTENTION_CUH_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace pipewright::cuda {

// Largest head dimension the kernels support.
inline constexpr int kAttentionMaxHeadDim = 128;

// out [B,T,C] and lse [B,H,T] are overwritten. InvalidArgument when C % H != 0, D > 128, or B/H
// exceed the grid limits (65535).
absl::Status AttentionForward(cudaStream_t stream, const float* qkv, float* out, float* lse, int B,
                              int T, int C, int H);

// dqkv [B,T,3C] is overwritten (every element). out and lse are the forward's outputs for the
// same qkv. scratch: caller-owned device buffer of B*H*T floats (receives rowsum(dout * out)
// per head; free to reuse once the backward has run in stream order).
absl::Status AttentionBackward(cudaStream_t stream, const float* dout, const float* qkv,
                               const float* out, const float* lse, float* dqkv, float* scratch,
                               int B, int T, int C, int H);

// Incremental decoding (kernels/cpu/attention_decode.cc's twin, Note [Decoding attention]
// there): n query rows of one sequence at positions [start, start + n), row i at q + i * ldq
// (head h at columns [h D, (h+1) D)), and the cached keys and values of positions
// [0, start + n), row j at kv + j * ldkv (k at columns [0, C), v at [C, 2C)); out row i (at
// out + i * ldo) = softmax(q_i k_j^T / sqrt(D) over j <= start + i) v. Agrees with the full
// forward to fp32 rounding. InvalidArgument for D > 128, more than 65535 heads or rows, or more
// positions than the kernel's shared memory holds (about 12,000).
absl::Status AttentionDecode(cudaStream_t stream, const float* q, int ldq, const float* kv,
                             int ldkv, float* out, int ldo, int start, int n, int C, int H);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_ATTENTION_CUH_
