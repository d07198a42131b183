// Incremental decoding's attention on the GPU (attention.cuh: AttentionDecode; the CPU twin is
// kernels/cpu/attention_decode.cc, Note [Decoding attention]). One block per (head, query row):
// the scaled query in shared memory, one thread per key for the scores (a dot product over the
// head dim), a block max, the exponentials and their block sum, then one thread per head-dim
// column for the weighted sum of the values. A decoding step is a matrix-vector product per
// head, bound by reading the cache, so no tiles. No atomics: every output is one thread's sum in
// key order, the same on every run.
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cmath>

#include "absl/strings/str_format.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/kernel_util.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kDecodeThreads = 128;
// The scores live in the default 48 KiB of dynamic shared memory beside the query.
constexpr int kDecodeSmemBytes = 48 * 1024;

__global__ void __launch_bounds__(kDecodeThreads)
    AttentionDecodeKernel(const float* q, int ldq, const float* kv, int ldkv, float* out, int ldo,
                          int start, int C, int D, float scale) {
  extern __shared__ float smem[];
  __shared__ float red[32];
  const int h = blockIdx.x, i = blockIdx.y;
  const int keys = start + i + 1;  // the query at position start + i sees keys 0 .. start + i
  float* qs = smem;                // [D]
  float* s = qs + D;               // [keys]
  const size_t col = static_cast<size_t>(h) * D;
  const float* qrow = q + static_cast<size_t>(i) * ldq + col;
  for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = scale * qrow[d];
  __syncthreads();
  float mx = -CUDART_INF_F;
  for (int j = threadIdx.x; j < keys; j += blockDim.x) {
    const float* kr = kv + static_cast<size_t>(j) * ldkv + col;
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc = fmaf(qs[d], kr[d], acc);
    s[j] = acc;
    mx = fmaxf(mx, acc);
  }
  mx = internal::BlockMax(mx, red, -CUDART_INF_F);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < keys; j += blockDim.x) {
    const float e = expf(s[j] - mx);
    s[j] = e;
    sum += e;
  }
  sum = internal::BlockSum(sum, red);  // its barriers also publish every s[j]
  const float inv = 1.0f / sum;
  const float* v = kv + C + col;
  float* o = out + static_cast<size_t>(i) * ldo + col;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < keys; ++j) acc = fmaf(s[j], v[static_cast<size_t>(j) * ldkv + d], acc);
    o[d] = acc * inv;
  }
}

}  // namespace

absl::Status AttentionDecode(cudaStream_t stream, const float* q, int ldq, const float* kv,
                             int ldkv, float* out, int ldo, int start, int n, int C, int H) {
  if (H < 1 || C < 1 || C % H != 0 || C / H > kAttentionMaxHeadDim || start < 0 || n < 0 ||
      H > 65535 || n > 65535 || ldq < C || ldkv < 2 * C || ldo < C) {
    return absl::InvalidArgumentError(
        absl::StrFormat("AttentionDecode: C=%d H=%d start=%d n=%d (ld %d, %d, %d) out of range", C,
                        H, start, n, ldq, ldkv, ldo));
  }
  if (n == 0) return absl::OkStatus();
  const int D = C / H;
  const int64_t bytes = (static_cast<int64_t>(D) + start + n) * static_cast<int64_t>(sizeof(float));
  if (bytes > kDecodeSmemBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("AttentionDecode: %d positions do not fit the kernel's %d bytes of scores",
                        start + n, kDecodeSmemBytes));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  AttentionDecodeKernel<<<dim3(H, n), kDecodeThreads, static_cast<size_t>(bytes), stream>>>(
      q, ldq, kv, ldkv, out, ldo, start, C, D, scale);
  PW_CUDA_LAUNCH_CHECK("AttentionDecodeKernel");
  return absl::OkStatus();
}

}  // namespace pipewright::cuda
