// GEMM via OpenBLAS cblas_sgemm (row-major). GemmHalf widens its 16-bit inputs to f32 first.
#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/parallel.h"
#include "pipewright/status.h"

namespace pipewright::cpu {

namespace {

// Note [GEMM split]. A product big enough to share is cut into blocks of rows of C (of columns
// when C is wider than tall), each one single-threaded cblas_sgemm call, and the blocks run on
// the rank's threads (ParallelFor). The cut depends on the shape only, never on the thread
// count: OpenBLAS's result for an element depends on where its row or column falls in the
// call's internal blocking (measured with OpenBLAS 0.3.21: splitting a product at an arbitrary
// row changes low bits of most results with its Haswell and Prescott kernels, and with the
// Cooperlake ones when a part drops to its small-matrix path), so a cut that followed the
// thread count would make results depend on it. With a fixed cut, one thread runs the same
// calls in turn and computes the same bits as any number of threads.
//
// The blocks are about kPartDim wide: each block re-packs the operand it shares with the others
// (B for row blocks, A for column blocks), which costs little at 512 and more below
// (gpt-small, one thread: blocks of ~512 as fast as whole products, 256 about 2% slower, 128
// about 10%). Their count is a power of two, so 2, 4, 8 threads share them evenly, and each
// block keeps at least kMinPartMacs multiply-adds. A product too narrow for two such blocks but
// big enough to matter (gpt-small's 256 x 256 x 1024 weight gradients: 3% of its products'
// work) still gets two blocks of at least kMinPairDim: left whole, it would run on one thread
// whatever the pool. A rank gets no more parallelism from a product than its count of blocks
// (two for gpt-small's 1024 x 768 x 256).
constexpr int kPartDim = 512;
constexpr int kMinPairDim = 128;
constexpr int64_t kMinPartMacs = int64_t{1} << 22;  // ~8 MFLOP: ~50 us at 150 GFLOP/s
constexpr int64_t kMinPairMacs = int64_t{1} << 25;  // the narrow products worth two blocks
constexpr int kSplitAlign = 16;                     // block edges: multiples of 16 rows/columns

// Blocks of an m x n x k product, from its shape only.
int GemmParts(int m, int n, int k) {
  const int dim = std::max(m, n);
  const int64_t macs = int64_t{m} * n * k;
  const int64_t by_dim = (dim + kPartDim / 2) / kPartDim;  // dim / kPartDim, rounded
  const int64_t most = std::min({macs / kMinPartMacs, by_dim, int64_t{dim / kSplitAlign}});
  int parts = 1;
  while (parts * int64_t{2} <= most) parts *= 2;
  if (parts == 1 && dim >= 2 * kMinPairDim && macs >= kMinPairMacs) parts = 2;
  return parts;
}

// For our own GEMMs, whose bits do not depend on the part of C a call computes: block(m0, m1,
// n0, n1) over the rank's threads, C cut along its longer side however the threads divide it,
// each part worth at least ~kMinPartMacs.
template <typename Block>
void OnAnySplit(int m, int n, int k, Block block) {
  const bool by_rows = m >= n;
  const int64_t across = int64_t{by_rows ? n : m} * std::max(k, 1);
  const int64_t grain = std::max<int64_t>(
      kSplitAlign, (kMinPartMacs / across + kSplitAlign - 1) / kSplitAlign * kSplitAlign);
  ParallelFor(by_rows ? m : n, grain, [&](int64_t lo, int64_t hi) {
    const int l = static_cast<int>(lo), h = static_cast<int>(hi);
    if (by_rows) {
      block(l, h, 0, n);
    } else {
      block(0, m, l, h);
    }
  });
}

void BlasGemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
              const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Note [One-row products]. A product with one row of C (m = 1: a Linear layer on one token,
// what every step of KV-cached generation runs, Note [Incremental decoding] in
// pipewright/layer.h) is a matrix-vector product. cblas_sgemm packs all of B for it, which cost
// more than the arithmetic (perf of gpt-tiny generation: sgemm's packing 25% of the time, its
// kernel 19%), so it is one cblas_sgemv call instead, on one thread: a choice made by the shape
// alone, so the bits still do not depend on the thread count. C's row is zeroed first when beta
// is 0, so that garbage (NaN) in it never survives whatever sgemv does with beta = 0.
void BlasGemv(bool trans_a, bool trans_b, int n, int k, float alpha, const float* a, int lda,
              const float* b, int ldb, float beta, float* c) {
  if (beta == 0.0f) std::fill(c, c + n, 0.0f);
  // x = A's one row: a[p], or with trans_a (A stored k x 1) a[p * lda].
  const int incx = trans_a ? lda : 1;
  if (trans_b) {  // B stored n x k: y = B x
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, alpha, b, ldb, a, incx, beta, c, 1);
  } else {  // B stored k x n: y = B^T x
    cblas_sgemv(CblasRowMajor, CblasTrans, k, n, alpha, b, ldb, a, incx, beta, c, 1);
  }
}

}  // namespace

// pipewright's fp32 GEMM (Note [fp32 GEMM] in gemm_bf16.cc) runs 5-10% faster than OpenBLAS's
// Cooperlake sgemm inside a gpt-small training step (docs/benchmarks-kernels.md);
// PIPEWRIGHT_GEMM=openblas keeps OpenBLAS, the GEMM of CPUs without AVX-512.
bool OwnF32Gemm() {
  static const bool own = [] {
    const char* v = std::getenv("PIPEWRIGHT_GEMM");
    return KernelIsa() == Isa::kAvx512 && HaveGemmHalfAvx512() &&
           !(v != nullptr && std::string(v) == "openblas");
  }();
  return own;
}

void BlasSgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
               int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  BlasGemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void GemmFused(bool trans_a, bool trans_b, int m, int n, int k, const float* a, int lda,
               const float* b, int ldb, float* c, int ldc, const GemmEpilogue& epilogue) {
  PW_CHECK(OwnF32Gemm() && k > 0);
  if (m <= 0 || n <= 0) return;
  OnAnySplit(m, n, k, [&](int m0, int m1, int n0, int n1) {
    GemmF32Block(trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc, m0, m1, n0, n1,
                 epilogue);
  });
}

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
  // On AVX-512 CPUs pipewright's own fp32 GEMM, split however the threads divide C (its bits do
  // not depend on the part computed).
  static const bool own = OwnF32Gemm();
  if (own) {
    OnAnySplit(m, n, k, [&](int m0, int m1, int n0, int n1) {
      GemmF32Block(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, m0, m1, n0, n1);
    });
    return;
  }
  if (m == 1) return BlasGemv(trans_a, trans_b, n, k, alpha, a, lda, b, ldb, beta, c);
  const int parts = GemmParts(m, n, k);
  if (parts <= 1) {
    BlasGemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const bool by_rows = m >= n;
  const int dim = by_rows ? m : n;
  // Block p is [edge(p), edge(p + 1)) (Note [GEMM split]).
  auto edge = [&](int64_t p) {
    return p == parts ? dim : static_cast<int>(dim * p / parts / kSplitAlign * kSplitAlign);
  };
  ParallelFor(parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int lo = edge(p), len = edge(p + 1) - lo;
      if (by_rows) {
        // Rows lo.. of op(A): row lo of A, or column lo of a transposed A.
        const float* a_part = trans_a ? a + lo : a + static_cast<size_t>(lo) * lda;
        BlasGemm(trans_a, trans_b, len, n, k, alpha, a_part, lda, b, ldb, beta,
                 c + static_cast<size_t>(lo) * ldc, ldc);
      } else {
        // Columns lo.. of op(B): column lo of B, or row lo of a transposed B.
        const float* b_part = trans_b ? b + static_cast<size_t>(lo) * ldb : b + lo;
        BlasGemm(trans_a, trans_b, m, len, k, alpha, a, lda, b_part, ldb, beta, c + lo, ldc);
      }
    }
  });
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
              const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc,
              Isa isa) {
  if (m <= 0 || n <= 0) return;
  if (isa == Isa::kAvx512) {
    // Its bits do not depend on the part of C a call computes (Note [16-bit GEMM]).
    const HalfGemmKernel kernel = is_bf16 ? Bf16GemmKernel() : HalfGemmKernel::kFma;
    OnAnySplit(m, n, k, [&](int m0, int m1, int n0, int n1) {
      GemmHalfBlock(is_bf16, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, m0, m1,
                    n0, n1, kernel);
    });
    return;
  }
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
