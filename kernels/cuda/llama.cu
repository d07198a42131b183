// The Llama family's kernels (llama.cuh).
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/kernel_util.cuh"
#include "kernels/cuda/llama.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kRowThreads = 256;

__global__ void __launch_bounds__(kRowThreads)
    RmsNormForwardKernel(const float* x, const float* w, float* y, float* rstd, int cols,
                         float eps) {
  __shared__ double red[32];
  const float* xr = x + static_cast<size_t>(blockIdx.x) * cols;
  double ss = 0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += static_cast<double>(xr[c]) * xr[c];
  ss = internal::BlockSum(ss, red);
  const float rs = 1.0f / sqrtf(static_cast<float>(ss / cols) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  float* yr = y + static_cast<size_t>(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = w[c] * (xr[c] * rs);
}

__global__ void __launch_bounds__(kRowThreads)
    RmsNormBackwardInputKernel(const float* x, const float* w, const float* rstd, const float* dy,
                               float* dx, int cols) {
  __shared__ double red[32];
  const size_t off = static_cast<size_t>(blockIdx.x) * cols;
  const float rs = rstd[blockIdx.x];
  double dot = 0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    dot += static_cast<double>(dy[off + c] * w[c]) * (x[off + c] * rs);
  }
  dot = internal::BlockSum(dot, red);
  const float m = static_cast<float>(dot / cols);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    dx[off + c] = rs * (dy[off + c] * w[c] - x[off + c] * rs * m);
  }
}

__global__ void RmsNormBackwardWeightKernel(const float* x, const float* rstd, const float* dy,
                                            float* dw, int rows, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc = 0;
  for (int r = 0; r < rows; ++r) {
    const size_t i = static_cast<size_t>(r) * cols + c;
    acc += dy[i] * (x[i] * rstd[r]);
  }
  dw[c] += acc;
}

__global__ void RopeKernel(float* x, int rows, int T, int ld, int col, int heads, int D,
                           float theta, float sign, int first) {
  const int half = D / 2;
  const int64_t total = static_cast<int64_t>(rows) * heads * half;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(k % half);
    const int h = static_cast<int>((k / half) % heads);
    const int64_t r = k / (static_cast<int64_t>(half) * heads);
    const float inv = 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(D));
    const float a_t = static_cast<float>(first + r % T) * inv;
    const float c = cosf(a_t), s = sign * sinf(a_t);
    float* v = x + r * ld + col + static_cast<int64_t>(h) * D;
    const float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
  }
}

__global__ void SwiGluForwardKernel(const float* gu, float* out, int rows, int F) {
  const int64_t total = static_cast<int64_t>(rows) * F;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / F, i = k % F;
    const float g = gu[r * 2 * F + i];
    out[k] = g / (1.0f + expf(-g)) * gu[r * 2 * F + F + i];
  }
}

__global__ void SwiGluBackwardKernel(const float* gu, const float* dout, float* dgu, int rows,
                                     int F) {
  const int64_t total = static_cast<int64_t>(rows) * F;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / F, i = k % F;
    const float g = gu[r * 2 * F + i], u = gu[r * 2 * F + F + i];
    const float s = 1.0f / (1.0f + expf(-g)), dy = dout[k];
    dgu[r * 2 * F + F + i] = dy * g * s;
    dgu[r * 2 * F + i] = dy * u * s * (1.0f + g * (1.0f - s));
  }
}

// One thread per element of qkv [rows, 3C].
__global__ void ExpandKvKernel(const float* x, float* qkv, int rows, int heads, int kv_heads,
                               int D) {
  const int C = heads * D, K = kv_heads * D, rep = heads / kv_heads;
  const int64_t total = static_cast<int64_t>(rows) * 3 * C;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / (3 * C);
    const int j = static_cast<int>(k % (3 * C));
    const float* in = x + r * (C + 2 * K);
    if (j < C) {
      qkv[k] = in[j];
    } else {
      const int part = (j - C) / C, within = (j - C) % C;  // 0: k, 1: v
      const int h = within / D, d = within % D;
      qkv[k] = in[C + part * K + (h / rep) * D + d];
    }
  }
}

// One thread per element of dx [rows, C + 2K]: q copied, each kv element summed over its query
// heads in head order.
__global__ void ReduceKvKernel(const float* dqkv, float* dx, int rows, int heads, int kv_heads,
                               int D) {
  const int C = heads * D, K = kv_heads * D, rep = heads / kv_heads, W = C + 2 * K;
  const int64_t total = static_cast<int64_t>(rows) * W;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / W;
    const int j = static_cast<int>(k % W);
    const float* in = dqkv + r * 3 * C;
    if (j < C) {
      dx[k] = in[j];
    } else {
      const int part = (j - C) / K, within = (j - C) % K;
      const int g = within / D, d = within % D;
      const float* first = in + (1 + part) * C + g * rep * D + d;
      float acc = first[0];
      for (int h = 1; h < rep; ++h) acc += first[h * D];
      dx[k] = acc;
    }
  }
}

__global__ void TokenEmbeddingForwardKernel(const int32_t* tokens, const float* table, float* out,
                                            int n, int C) {
  const int64_t total = static_cast<int64_t>(n) * C;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[k] = table[static_cast<int64_t>(tokens[k / C]) * C + k % C];
  }
}

__global__ void TokenEmbeddingBackwardKernel(const int32_t* tokens, const float* dout,
                                             float* dtable, int n, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int i = 0; i < n; ++i)
    dtable[static_cast<int64_t>(tokens[i]) * C + c] += dout[static_cast<int64_t>(i) * C + c];
}

unsigned int Grid(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>((n + 255) / 256, 65535));
}

}  // namespace

absl::Status RmsNormForward(cudaStream_t stream, const float* x, const float* w, float* y,
                            float* rstd, int rows, int cols, float eps) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  RmsNormForwardKernel<<<rows, kRowThreads, 0, stream>>>(x, w, y, rstd, cols, eps);
  PW_CUDA_LAUNCH_CHECK("RmsNormForwardKernel");
  return absl::OkStatus();
}

absl::Status RmsNormBackwardInput(cudaStream_t stream, const float* x, const float* w,
                                  const float* rstd, const float* dy, float* dx, int rows,
                                  int cols) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  RmsNormBackwardInputKernel<<<rows, kRowThreads, 0, stream>>>(x, w, rstd, dy, dx, cols);
  PW_CUDA_LAUNCH_CHECK("RmsNormBackwardInputKernel");
  return absl::OkStatus();
}

absl::Status RmsNormBackwardWeight(cudaStream_t stream, const float* x, const float* rstd,
                                   const float* dy, float* dw, int rows, int cols) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  RmsNormBackwardWeightKernel<<<Grid(cols), 256, 0, stream>>>(x, rstd, dy, dw, rows, cols);
  PW_CUDA_LAUNCH_CHECK("RmsNormBackwardWeightKernel");
  return absl::OkStatus();
}

absl::Status Rope(cudaStream_t stream, float* x, int rows, int T, int ld, int col, int heads, int D,
                  double theta, bool inverse, int first) {
  const int64_t n = static_cast<int64_t>(rows) * heads * (D / 2);
  if (n == 0) return absl::OkStatus();
  RopeKernel<<<Grid(n), 256, 0, stream>>>(x, rows, T, ld, col, heads, D, static_cast<float>(theta),
                                          inverse ? -1.0f : 1.0f, first);
  PW_CUDA_LAUNCH_CHECK("RopeKernel");
  return absl::OkStatus();
}

absl::Status SwiGluForward(cudaStream_t stream, const float* gu, float* out, int rows, int F) {
  const int64_t n = static_cast<int64_t>(rows) * F;
  if (n == 0) return absl::OkStatus();
  SwiGluForwardKernel<<<Grid(n), 256, 0, stream>>>(gu, out, rows, F);
  PW_CUDA_LAUNCH_CHECK("SwiGluForwardKernel");
  return absl::OkStatus();
}

absl::Status SwiGluBackward(cudaStream_t stream, const float* gu, const float* dout, float* dgu,
                            int rows, int F) {
  const int64_t n = static_cast<int64_t>(rows) * F;
  if (n == 0) return absl::OkStatus();
  SwiGluBackwardKernel<<<Grid(n), 256, 0, stream>>>(gu, dout, dgu, rows, F);
  PW_CUDA_LAUNCH_CHECK("SwiGluBackwardKernel");
  return absl::OkStatus();
}

absl::Status ExpandKv(cudaStream_t stream, const float* x, float* qkv, int rows, int heads,
                      int kv_heads, int D) {
  const int64_t n = static_cast<int64_t>(rows) * 3 * heads * D;
  if (n == 0) return absl::OkStatus();
  ExpandKvKernel<<<Grid(n), 256, 0, stream>>>(x, qkv, rows, heads, kv_heads, D);
  PW_CUDA_LAUNCH_CHECK("ExpandKvKernel");
  return absl::OkStatus();
}

absl::Status ReduceKv(cudaStream_t stream, const float* dqkv, float* dx, int rows, int heads,
                      int kv_heads, int D) {
  const int64_t n = static_cast<int64_t>(rows) * (heads + 2 * kv_heads) * D;
  if (n == 0) return absl::OkStatus();
  ReduceKvKernel<<<Grid(n), 256, 0, stream>>>(dqkv, dx, rows, heads, kv_heads, D);
  PW_CUDA_LAUNCH_CHECK("ReduceKvKernel");
  return absl::OkStatus();
}

absl::Status TokenEmbeddingForward(cudaStream_t stream, const int32_t* tokens, const float* table,
                                   float* out, int n, int C) {
  const int64_t total = static_cast<int64_t>(n) * C;
  if (total == 0) return absl::OkStatus();
  TokenEmbeddingForwardKernel<<<Grid(total), 256, 0, stream>>>(tokens, table, out, n, C);
  PW_CUDA_LAUNCH_CHECK("TokenEmbeddingForwardKernel");
  return absl::OkStatus();
}

absl::Status TokenEmbeddingBackward(cudaStream_t stream, const int32_t* tokens, const float* dout,
                                    float* dtable, int n, int C) {
  if (n == 0 || C == 0) return absl::OkStatus();
  TokenEmbeddingBackwardKernel<<<Grid(C), 256, 0, stream>>>(tokens, dout, dtable, n, C);
  PW_CUDA_LAUNCH_CHECK("TokenEmbeddingBackwardKernel");
  return absl::OkStatus();
}

}  // namespace pipewright::cuda
