// Embedding kernels (see embedding.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/kernel_util.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kColThreads = 128;      // columns per dwte block
constexpr int kTokenPartitions = 64;  // dwte blocks per column tile (token id % 64)
constexpr int kTokenChunk = 2048;     // tokens staged in shared memory at a time

__global__ void EmbeddingForwardKernel(const int32_t* tokens, const float* wte, const float* wpe,
                                       float* out, size_t total, int T, int C) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t bt = i / C;
    const int c = static_cast<int>(i % C);
    const int t = static_cast<int>(bt % T);
    out[i] = wte[static_cast<size_t>(tokens[bt]) * C + c] + wpe[static_cast<size_t>(t) * C + c];
  }
}

// Block (column tile x, partition y): thread owns column c and every token id v with
// v % kTokenPartitions == y; it walks all rows in order and applies the rows whose token it owns.
// Token ids outside [begin, begin + part) are skipped (a vocab-parallel rank's range; the whole
// embedding passes begin 0 and its vocabulary), and a row's dwte row is tok - begin.
__global__ void __launch_bounds__(kColThreads)
    EmbeddingBackwardTokenKernel(const float* dout, const int32_t* tokens, float* dwte, size_t rows,
                                 int C, int64_t begin, int64_t part) {
  __shared__ int32_t tok_s[kTokenChunk];
  const int c = blockIdx.x * kColThreads + threadIdx.x;
  const int partition = blockIdx.y;
  for (size_t base = 0; base < rows; base += kTokenChunk) {
    const int n = static_cast<int>(rows - base < kTokenChunk ? rows - base : kTokenChunk);
    __syncthreads();  // previous chunk fully consumed
    for (int i = threadIdx.x; i < n; i += kColThreads) tok_s[i] = tokens[base + i];
    __syncthreads();
    if (c < C) {
      for (int i = 0; i < n; ++i) {
        const int32_t tok = tok_s[i];  // uniform over the block: no divergence
        if (tok % kTokenPartitions != partition) continue;
        const int64_t v = tok - begin;
        if (v < 0 || v >= part) continue;
        float* dst = dwte + static_cast<size_t>(v) * C + c;
        *dst = *dst + dout[(base + i) * C + c];
      }
    }
  }
}

// One thread per (t, c): dwpe[t, c] += dout[0, t, c], then dout[1, t, c], ... (CPU order).
__global__ void EmbeddingBackwardPositionKernel(const float* dout, float* dwpe, int B, int T,
                                                int C) {
  const size_t total = static_cast<size_t>(T) * C;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = dwpe[i];
    for (int b = 0; b < B; ++b) acc = acc + dout[static_cast<size_t>(b) * total + i];
    dwpe[i] = acc;
  }
}

// The vocab-parallel forward (ops::EmbeddingPartForward): the rank's token rows, zero rows for
// the others, plus the positions where `wpe` is given; the CPU's expression per element.
__global__ void EmbeddingPartForwardKernel(const int32_t* tokens, const float* wte, int64_t begin,
                                           int64_t part, const float* wpe, float* out, size_t total,
                                           int T, int C) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t bt = i / C;
    const int c = static_cast<int>(i % C);
    const int t = static_cast<int>(bt % T);
    const int64_t v = tokens[bt] - begin;
    const bool mine = v >= 0 && v < part;
    const float w = mine ? wte[static_cast<size_t>(v) * C + c] : 0.0f;
    if (wpe == nullptr) {
      out[i] = w;
    } else {
      const float p = wpe[static_cast<size_t>(t) * C + c];
      out[i] = mine ? w + p : p;
    }
  }
}

absl::Status CheckShape(const char* op, int B, int T, int C) {
  if (B < 0 || T < 0 || C < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: negative shape B=%d T=%d C=%d", op, B, T, C));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EmbeddingForward(cudaStream_t stream, const int32_t* tokens, const float* wte,
                              const float* wpe, float* out, int B, int T, int C) {
  PW_RETURN_IF_ERROR(CheckShape("EmbeddingForward", B, T, C));
  const size_t total = static_cast<size_t>(B) * T * C;
  if (total == 0) return absl::OkStatus();
  EmbeddingForwardKernel<<<internal::GridFor(total), internal::kElementwiseThreads, 0, stream>>>(
      tokens, wte, wpe, out, total, T, C);
  PW_CUDA_LAUNCH_CHECK("EmbeddingForwardKernel");
  return absl::OkStatus();
}

// The whole table: every token id is in [0, INT32_MAX).
absl::Status EmbeddingBackward(cudaStream_t stream, const float* dout, const int32_t* tokens,
                               float* dwte, float* dwpe, int B, int T, int C) {
  return EmbeddingPartBackward(stream, dout, tokens, 0, INT32_MAX, dwte, dwpe, B, T, C);
}

absl::Status EmbeddingPartForward(cudaStream_t stream, const int32_t* tokens, const float* wte_part,
                                  int64_t begin, int64_t part, const float* wpe, float* out, int B,
                                  int T, int C) {
  PW_RETURN_IF_ERROR(CheckShape("EmbeddingPartForward", B, T, C));
  const size_t total = static_cast<size_t>(B) * T * C;
  if (total == 0) return absl::OkStatus();
  EmbeddingPartForwardKernel<<<internal::GridFor(total), internal::kElementwiseThreads, 0,
                               stream>>>(tokens, wte_part, begin, part, wpe, out, total, T, C);
  PW_CUDA_LAUNCH_CHECK("EmbeddingPartForwardKernel");
  return absl::OkStatus();
}

absl::Status EmbeddingPartBackward(cudaStream_t stream, const float* dout, const int32_t* tokens,
                                   int64_t begin, int64_t part, float* dwte_part, float* dwpe,
                                   int B, int T, int C) {
  PW_RETURN_IF_ERROR(CheckShape("EmbeddingPartBackward", B, T, C));
  if (static_cast<size_t>(B) * T * C == 0) return absl::OkStatus();
  const dim3 grid(internal::CeilDiv(C, kColThreads), kTokenPartitions);
  EmbeddingBackwardTokenKernel<<<grid, kColThreads, 0, stream>>>(
      dout, tokens, dwte_part, static_cast<size_t>(B) * T, C, begin, part);
  PW_CUDA_LAUNCH_CHECK("EmbeddingBackwardTokenKernel");
  if (dwpe == nullptr) return absl::OkStatus();  // no positions (the Llama token embedding)
  const size_t tc = static_cast<size_t>(T) * C;
  EmbeddingBackwardPositionKernel<<<internal::GridFor(tc), internal::kElementwiseThreads, 0,
                                    stream>>>(dout, dwpe, B, T, C);
  PW_CUDA_LAUNCH_CHECK("EmbeddingBackwardPositionKernel");
  return absl::OkStatus();
}

}  // namespace pipewright::cuda
