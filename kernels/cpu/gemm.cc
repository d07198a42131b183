// GEMM via OpenBLAS cblas_sgemm (row-major). GemmHalf widens its 16-bit inputs to f32 first.
#include <cblas.h>

#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace pipewright::cpu {

void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == 0.0f) {
    // C = beta * C (beta == 0 overwrites, so stale NaNs in C do not survive).
    for (int i = 0; i < m; ++i) {
      float* row = c + static_cast<size_t>(i) * ldc;
      if (beta == 0.0f) {
        for (int j = 0; j < n; ++j) row[j] = 0.0f;
      } else if (beta != 1.0f) {
        for (int j = 0; j < n; ++j) row[j] *= beta;
      }
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

namespace {

// Widens a stored rows x cols matrix (row stride ld) into a dense f32 buffer (row stride cols).
void Widen(bool is_bf16, const uint16_t* src, int rows, int cols, int ld, std::vector<float>& dst) {
  dst.resize(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    const uint16_t* s = src + static_cast<size_t>(r) * ld;
    float* d = dst.data() + static_cast<size_t>(r) * cols;
    if (is_bf16) {
      Bf16ToFloat(s, d, static_cast<size_t>(cols));
    } else {
      HalfToFloat(s, d, static_cast<size_t>(cols));
    }
  }
}

}  // namespace

void GemmHalf(bool is_bf16, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
              const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
              int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    Gemm(trans_a, trans_b, m, n, k, alpha, nullptr, 1, nullptr, 1, beta, c, ldc);
    return;
  }
  // Scratch is reused across calls on the same thread, so steady state does not allocate.
  thread_local std::vector<float> a32;
  thread_local std::vector<float> b32;
  const int a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  Widen(is_bf16, a, a_rows, a_cols, lda, a32);
  Widen(is_bf16, b, b_rows, b_cols, ldb, b32);
  Gemm(trans_a, trans_b, m, n, k, alpha, a32.data(), a_cols, b32.data(), b_cols, beta, c, ldc);
}

}  // namespace pipewright::cpu
