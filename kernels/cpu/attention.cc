// Multi-head causal self-attention. Per (batch, head) the work is three GEMMs on strided views
// of qkv (row stride 3C) plus a row softmax over the causal lower triangle.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"

namespace pipewright::cpu {

void AttentionForward(const float* qkv, float* out, float* probs, int B, int T, int C, int H) {
  const int D = C / H;
  const int ld_qkv = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t tt = static_cast<size_t>(T) * T;
  for (int b = 0; b < B; ++b) {
    const float* base = qkv + static_cast<size_t>(b) * T * ld_qkv;
    float* out_b = out + static_cast<size_t>(b) * T * C;
    for (int h = 0; h < H; ++h) {
      const float* q = base + static_cast<size_t>(h) * D;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* p = probs + (static_cast<size_t>(b) * H + h) * tt;
      // S = scale * Q K^T (the full block; the upper triangle is masked below).
      Gemm(false, true, T, T, D, scale, q, ld_qkv, k, ld_qkv, 0.0f, p, T);
      for (int i = 0; i < T; ++i) {
        float* row = p + static_cast<size_t>(i) * T;
        float mx = row[0];
        for (int j = 1; j <= i; ++j) mx = row[j] > mx ? row[j] : mx;
        for (int j = 0; j <= i; ++j) row[j] = FastExp(row[j] - mx);  // vectorises
        float sum = 0.0f;
        for (int j = 0; j <= i; ++j) sum += row[j];
        const float inv = 1.0f / sum;
        for (int j = 0; j <= i; ++j) row[j] *= inv;
        for (int j = i + 1; j < T; ++j) row[j] = 0.0f;
      }
      // O = P V
      Gemm(false, false, T, D, T, 1.0f, p, T, v, ld_qkv, 0.0f, out_b + static_cast<size_t>(h) * D,
           C);
    }
  }
}

void AttentionBackward(const float* dout, const float* qkv, const float* probs, float* dqkv,
                       float* scratch, int B, int T, int C, int H) {
  const int D = C / H;
  const int ld_qkv = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t tt = static_cast<size_t>(T) * T;
  for (int b = 0; b < B; ++b) {
    const float* base = qkv + static_cast<size_t>(b) * T * ld_qkv;
    float* dbase = dqkv + static_cast<size_t>(b) * T * ld_qkv;
    const float* dout_b = dout + static_cast<size_t>(b) * T * C;
    for (int h = 0; h < H; ++h) {
      const size_t off = static_cast<size_t>(h) * D;
      const float* q = base + off;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dbase + off;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* d_o = dout_b + off;
      const float* p = probs + (static_cast<size_t>(b) * H + h) * tt;
      float* ds = scratch;
      // dV = P^T dO
      Gemm(true, false, T, D, T, 1.0f, p, T, d_o, C, 0.0f, dv, ld_qkv);
      // dP = dO V^T
      Gemm(false, true, T, T, D, 1.0f, d_o, C, v, ld_qkv, 0.0f, ds, T);
      // dS = scale * P * (dP - rowsum(dP * P)), zero above the diagonal.
      for (int i = 0; i < T; ++i) {
        const float* prow = p + static_cast<size_t>(i) * T;
        float* row = ds + static_cast<size_t>(i) * T;
        float dot = 0.0f;
        for (int j = 0; j <= i; ++j) dot += row[j] * prow[j];
        for (int j = 0; j <= i; ++j) row[j] = scale * prow[j] * (row[j] - dot);
        for (int j = i + 1; j < T; ++j) row[j] = 0.0f;
      }
      // dQ = dS K, dK = dS^T Q
      Gemm(false, false, T, D, T, 1.0f, ds, T, k, ld_qkv, 0.0f, dq, ld_qkv);
      Gemm(true, false, T, D, T, 1.0f, ds, T, q, ld_qkv, 0.0f, dk, ld_qkv);
    }
  }
}

}  // namespace pipewright::cpu
