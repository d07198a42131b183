// GEMM on 16-bit inputs (bf16, f16) with fp32 accumulation, AVX-512: Note [16-bit GEMM].
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/gemm_pack.h"
#include "kernels/cpu/transpose.h"
#include "pipewright/cpu.h"
#include "pipewright/status.h"

namespace pipewright::cpu {

// Note [16-bit GEMM]
// The result is defined by one summation order, whatever the kernel, the blocking, or the part
// of C computed. Element (i, j) is a single fp32 running sum:
//   s = (alpha == 1 ? beta * c : 0)                      (beta == 0: s = 0, beta == 1: s = c)
//   for each k pair (2p, 2p + 1) in increasing p:  s += a[i,2p+1] b[2p+1,j];  s += a[i,2p] b[2p,j]
//   c = (alpha == 1 ? s : alpha * s + beta * c)          (one fused multiply-add)
// Each product of two 16-bit values is exact in fp32, so each step is one rounding to nearest
// even; a trailing odd k pairs with a zero. Denormals are flushed (fp32 DAZ and FTZ for the
// whole call). This is exactly what vdpbf16ps computes per lane (odd element first, DAZ/FTZ
// implied), and exactly what two vfmadd231ps on the widened inputs compute under MXCSR DAZ|FTZ,
// so the two micro-kernels below give identical bits (tested), and the choice between them is
// only a matter of speed.
//
//  - kBf16Dot: vdpbf16ps on "k-pair interleaved" bf16 panels (two consecutive k of one row or
//    column share a 32-bit word). Half the instructions per flop of FMA, but some CPUs issue it
//    at a quarter of the FMA rate (the Intel Xeon, family 6 model 207, of
//    docs/benchmarks-kernels.md).
//  - kFma: vfmadd231ps on panels widened to fp32 while packing (a 16-bit shift for bf16,
//    vcvtph2ps for f16), k in the order above (2p + 1, then 2p).
//
// Blocking (BlockedGemm): k in blocks of at most kc; per block, B is packed up to kPackedBBytes at
// a time (L2) as micro-panels of kNr columns, and A a few micro-panels of kMr rows at a time (or,
// fp32 A stored m x k, read in place: Note [A in place]), each A micro-panel (L1) swept across
// the B block. The micro-kernel holds a kMr x kNr tile of C in kMr
// * kNr / 16 zmm accumulators; per k step it loads kNr / 16 vectors of B and broadcasts kMr values
// of A. Between k blocks the running sums are stored in C itself (exact: they are fp32 values), so
// the blocking does not change the bits. alpha != 1 with beta != 0 needs c's old value after
// the last block: that case runs k as one block. Edges: packing pads the rows of A and the
// columns of B with zeros up to the tile; the tile's loads and stores of C are masked.

namespace {

// C = beta * C on rows [m0, m1) x columns [n0, n1) (beta == 0 overwrites, NaN included).
void ScaleBlock(float beta, float* c, int ldc, int m0, int m1, int n0, int n1) {
  for (int i = m0; i < m1; ++i) {
    float* row = c + static_cast<size_t>(i) * ldc;
    for (int j = n0; j < n1; ++j) row[j] = beta == 0.0f ? 0.0f : row[j] * beta;
  }
}

}  // namespace

#if PW_HAVE_X86_VARIANTS

namespace {

constexpr int kMr = 14;        // rows of the C tile
constexpr int kNv = 2;         // zmm vectors per tile row
constexpr int kNr = 16 * kNv;  // columns of the C tile
constexpr int kMcPanels = 8;   // micro-panels of A packed at a time (~100 KiB, L2)
// k per block. 16-bit: an A micro-panel of kKc * kMr values is 21 KiB, the B micro-panel it
// meets 24 KiB. fp32: 256 (14 KiB of A, 32 KiB of B), which measured faster than 192 on
// gpt-small's products (docs/benchmarks-kernels.md) and keeps its k = 256 products in one block.
constexpr int kKcDot = 384, kKcFma = 192;
constexpr int kKcF32 = 256;
// ... but up to this k in one block when all of B's columns then fit one packed B block
// (Note [fp32 k blocks]).
constexpr int kKcF32Whole = 1024;

using pack::kPackedBBytes;
using pack::Line;
using pack::Operands;
using pack::PackColumnPairs;
using pack::PackedSteps;
using pack::PackRowPairs;
using pack::Scratch;

// Note [fp32 GEMM]. The kFma micro-kernel and the blocking above also multiply fp32 matrices:
// the panels hold the fp32 values in natural k order (kc steps per k block), nothing is widened
// and denormals are not flushed. Element (i, j) is one fp32 running sum, from beta * c when
// alpha == 1 (or 0), adding a[i,p] b[p,j] in increasing p with fused multiply-adds; between k
// blocks the sum is stored in C, exactly. So the bits do not depend on the blocking or on the
// part of C a call computes, and threads may split C freely. It is cpu::Gemm's fp32 GEMM on
// CPUs with AVX-512 (PIPEWRIGHT_GEMM=openblas selects OpenBLAS instead): inside a training step
// it runs 5-10% faster than OpenBLAS's Cooperlake sgemm on gpt-small's products
// (docs/benchmarks-kernels.md), and it writes C without zeroing it first.
//
// Note [Whole-vector panel stores]. An A micro-panel's k step is kMr = 14 values (56 bytes):
// stored one masked vector per step, 6 of every 8 stores straddle two cache lines. The packing
// of a weight gradient's transposed A (PackColumnsF32) stores eight steps, 112 values, as 7 whole
// vectors instead, each assembled with one two-source permute (vpermt2d): 0.33 -> 0.28 ns per
// value in a harness reading A from L3; the weight gradients 3-10% faster in kernels_bench's
// BM_GemmCold, and this packing 2.0% -> 1.4% of a gpt-small step in perf (same values, same
// bits). PackRowsF32, whose stores follow a 16 x 16 transpose, measured no faster so in a step,
// so it keeps its masked stores.
struct Steps14Index {
  alignas(64) int32_t lanes[7][16];
};
constexpr Steps14Index MakeSteps14Index() {
  Steps14Index t{};
  for (int v = 0; v < 7; ++v) {  // value e = 16 v + l is lane e % 14 of step e / 14 (v or v + 1)
    for (int l = 0; l < 16; ++l) t.lanes[v][l] = ((16 * v + l) / 14 - v) * 16 + (16 * v + l) % 14;
  }
  return t;
}
constexpr Steps14Index kSteps14Index = MakeSteps14Index();

// Stores lanes [0, 14) of x[0], ..., x[7] as 112 consecutive values at dst.
PW_TARGET_AVX512 inline void Store8Steps14(const __m512i* x, uint32_t* dst) {
#pragma GCC unroll 7
  for (int v = 0; v < 7; ++v) {
    const __m512i index = _mm512_load_si512(kSteps14Index.lanes[v]);
    _mm512_storeu_si512(dst + 16 * v, _mm512_permutex2var_epi32(x[v], index, x[v + 1]));
  }
}

// fp32 operands for the kFma micro-kernel in natural k order: `count` stored
// rows from `src` (row stride ld) with k contiguous, k in [0, kc). Panels of R rows, panel q =
// rows [q R, q R + R), kc steps of R values; rows past `count` are zero.
template <int R>
PW_TARGET_AVX512 void PackRowsF32(const float* src, size_t ld, int count, int kc, uint32_t* dst) {
  for (int r0 = 0; r0 < count; r0 += R) {
    uint32_t* panel = dst + static_cast<size_t>(r0 / R) * kc * R;
    for (int g = 0; g < R; g += 16) {  // 16 rows x 16 k at a time, transposed
      const int rows = std::clamp(std::min(count - r0, R) - g, 0, 16);
      const __mmask16 store = static_cast<__mmask16>((1u << std::min(16, R - g)) - 1);
      const float* block = src + static_cast<size_t>(r0 + g) * ld;
      for (int p = 0; p < kc; p += 16) {
        const int ks = std::min(16, kc - p);
        const __mmask16 load = static_cast<__mmask16>((1u << ks) - 1);
        __m512i x[16];
        for (int r = 0; r < 16; ++r) {
          x[r] = r < rows ? _mm512_castps_si512(_mm512_maskz_loadu_ps(load, block + r * ld + p))
                          : _mm512_setzero_si512();
        }
        Transpose16x16(x);
        for (int q = 0; q < ks; ++q) {
          _mm512_mask_storeu_epi32(panel + static_cast<size_t>(p + q) * R + g, store, x[q]);
        }
      }
    }
  }
}

// fp32 operands whose k runs down the stored rows: k in [0, kc) is stored row k (row stride ld),
// columns [0, count). Same panels as PackRowsF32.
template <int R>
PW_TARGET_AVX512 void PackColumnsF32(const float* src, size_t ld, int count, int kc,
                                     uint32_t* dst) {
  // Row by row within chunks of kChunk panels (each source row's chunk is read once, as whole
  // cache lines, and the rows ahead are prefetched: rows of a weight-gradient operand are
  // kilobytes apart, beyond what the hardware prefetchers follow), scattering each row into the
  // chunk's panels; for R = 14, eight rows at a time (Note [Whole-vector panel stores]).
  constexpr int kAhead = 8, kChunk = 8 * R;
  for (int c1 = 0; c1 < count; c1 += kChunk) {
    const int width = std::min(kChunk, count - c1);
    const auto prefetch_ahead = [&](int p) {
      if (p + kAhead >= kc) return;
      const char* ahead =
          reinterpret_cast<const char*>(src + static_cast<size_t>(p + kAhead) * ld + c1);
      for (int b = 0; b < width * 4; b += 64) __builtin_prefetch(ahead + b, 0, 3);
      __builtin_prefetch(ahead + width * 4 - 1, 0, 3);
    };
    int p0 = 0;
    if constexpr (R == 14) {
      for (; p0 + 8 <= kc; p0 += 8) {
        for (int p = p0; p < p0 + 8; ++p) prefetch_ahead(p);
        for (int c0 = 0; c0 < width; c0 += R) {
          const __mmask16 load = static_cast<__mmask16>((1u << std::min(R, width - c0)) - 1);
          __m512i x[8];
          for (int q = 0; q < 8; ++q) {
            const float* row = src + static_cast<size_t>(p0 + q) * ld + c1 + c0;
            x[q] = _mm512_castps_si512(_mm512_maskz_loadu_ps(load, row));
          }
          Store8Steps14(
              x, dst + static_cast<size_t>((c1 + c0) / R) * kc * R + static_cast<size_t>(p0) * R);
        }
      }
    }
    for (int p = p0; p < kc; ++p) {
      const float* row = src + static_cast<size_t>(p) * ld + c1;
      prefetch_ahead(p);
      for (int c0 = 0; c0 < width; c0 += R) {
        uint32_t* out =
            dst + static_cast<size_t>((c1 + c0) / R) * kc * R + static_cast<size_t>(p) * R;
        for (int c = 0; c < R; c += 16) {
          const int valid = std::clamp(width - c0 - c, 0, 16);
          const __mmask16 load = static_cast<__mmask16>((1u << valid) - 1);
          const __mmask16 store = static_cast<__mmask16>((1u << std::min(16, R - c)) - 1);
          _mm512_mask_storeu_epi32(out + c, store,
                                   _mm512_castps_si512(_mm512_maskz_loadu_ps(load, row + c0 + c)));
        }
      }
    }
  }
}

enum class Init { kZero, kLoad, kLoadScaled };          // s = 0; s = c; s = beta c
enum class Store { kPlain, kScaled, kScaledPlusBeta };  // c = s; c = alpha s; c = alpha s + beta c

// acc += the products of the bf16 pairs in a and b, odd element first (vdpbf16ps). Inline
// assembly rather than the intrinsic: the intrinsic needs the avx512bf16 target on the whole
// micro-kernel, and the FMA instantiation of that template must run on CPUs without it.
PW_TARGET_AVX512 inline __m512 DotBf16Pairs(__m512 acc, __m512i a, __m512i b) {
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// The micro-kernel: C[0:rows, 0:cols] (row stride ldc) from `steps` packed k steps of an A and a
// B micro-panel (PackedSteps), initialised and stored as `init` and `store` say. The tile's
// padding rows and columns compute products of zeros and are neither loaded nor stored.
// Note [GEMM epilogue]. A Linear layer's forward is a product, then a pass adding the bias (and
// with GELU computing the activation) over the whole output: on gpt-small's 1,024 x 1,024 MLP
// output that pass re-reads 4 MiB that the product has just written back past L2. The fp32 GEMM
// can instead finish each C tile in registers: after its last k block it adds bias[column] to
// the final sums, stores them (the pre-activation) and, when asked, stores GELU of them too, with
// the same vector GELU as the elementwise kernels (gelu.h). The additions and the GELU are the
// same operations on the same fp32 values as the GEMM, BiasAdd and BiasGeluForward in turn, so
// the bits are the same (tested); only the memory traffic goes. A residual connection's add
// (residual: the tile's first element of an m x n tensor, row stride ld_act) follows the bias
// the same way (Note [Residual epilogue] in runtime/layers/transformer.cc).
//
// What a tile's last k block does after its sums are final (Note [GEMM epilogue]): adds
// bias[column] (bias at the tile's first column, or null) and, when act is not null, also stores
// GELU of the result at act (the tile's first element, row stride ld_act).
struct TileEpilogue {
  const float* bias;
  float* act;
  size_t ld_act;
  const float* residual = nullptr;  // added after the bias (row stride ld_act), or null
};

// Note [A in place]. Packing A costs a pass over it from L3 (0.3 ns per value) for every block
// of B's columns it meets, which a product with few columns cannot amortise: with gpt-small's
// 256 columns that pass was 5% of the product. An fp32 A stored m x k (rows with k contiguous:
// the forward's activations, the input gradient's dY) is already in the order the micro-kernel
// walks each row in, so the fp32 GEMM reads it in place: each k step broadcasts element p of MR
// rows lda apart instead of MR consecutive packed values, and each row's lines (16 steps each)
// come in behind the hardware's stream prefetchers. A harness of the blocking, rotating 8 cold
// A matrices, measured 150 -> 158 GFLOP/s with 256 columns and k = 256, 145 -> 152 with
// k = 1,024, and within 1% with 768 or 1,024 columns; in gpt-small's step its 256-column
// products took 3-5% less time and all its products 1.0-1.5% less (docs/benchmarks-kernels.md). The
// values and the order of the multiply-adds are those of the packed panel, so the bits are too.
// A partial strip's rows past `rows` read row rows - 1 again and are not stored: nothing
// outside A is read.
//
// The A micro-panel holds kMr rows per k step; MR < kMr computes only its first MR rows (Note
// [Row tails]). kInPlaceA (fp32 only): a_rows is A's row 0 at this k block, row i lda values
// further on (Note [A in place]), and ap and lda are not used otherwise.
template <int MR, int NV, HalfGemmKernel kKernel, bool kInPlaceA>
PW_TARGET_AVX512 void MicroKernel(int steps, const uint32_t* ap, const float* a_rows, size_t lda,
                                  const uint32_t* bp, float* c, size_t ldc, int rows, int cols,
                                  float alpha, float beta, Init init, Store store,
                                  const TileEpilogue* epi) {
  static_assert(!kInPlaceA || kKernel == HalfGemmKernel::kFma, "A in place is fp32");
  size_t a_at[MR];  // row i's offset from a_rows (a partial strip repeats its last row)
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) a_at[i] = static_cast<size_t>(std::min(i, rows - 1)) * lda;
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  __mmask16 mask[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    mask[v] = static_cast<__mmask16>((1u << std::clamp(cols - 16 * v, 0, 16)) - 1);
  }
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = _mm512_setzero_ps();
      if (init != Init::kZero && i < rows) {
        acc[i][v] = _mm512_maskz_loadu_ps(mask[v], c + i * ldc + 16 * v);
        if (init == Init::kLoadScaled) acc[i][v] = _mm512_mul_ps(vb, acc[i][v]);
      }
    }
  }
  static_assert(MR <= kMr, "an A micro-panel has kMr rows");
  for (int s = 0; s < steps; ++s, bp += 16 * NV) {
    __m512i b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(bp + 16 * v);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      __m512i a;  // a pair, or fp32 bits
      if constexpr (kInPlaceA) {
        a = _mm512_castps_si512(_mm512_set1_ps(a_rows[a_at[i]]));
      } else {
        a = _mm512_set1_epi32(static_cast<int>(ap[i]));
      }
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        if constexpr (kKernel == HalfGemmKernel::kBf16Dot) {
          acc[i][v] = DotBf16Pairs(acc[i][v], a, b[v]);
        } else {
          acc[i][v] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b[v]), acc[i][v]);
        }
      }
    }
    if constexpr (kInPlaceA) {
      ++a_rows;
    } else {
      ap += kMr;
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
    float* row = c + i * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      __m512 out = acc[i][v];
      if (store == Store::kScaled) out = _mm512_mul_ps(va, out);
      if (store == Store::kScaledPlusBeta) {
        const __m512 old = _mm512_maskz_loadu_ps(mask[v], row + 16 * v);
        out = _mm512_fmadd_ps(va, out, _mm512_mul_ps(vb, old));
      }
      if (epi != nullptr && epi->bias != nullptr) {
        out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask[v], epi->bias + 16 * v));
      }
      if (epi != nullptr && epi->residual != nullptr) {
        out = _mm512_add_ps(
            out, _mm512_maskz_loadu_ps(mask[v], epi->residual + i * epi->ld_act + 16 * v));
      }
      _mm512_mask_storeu_ps(row + 16 * v, mask[v], out);
      if (epi != nullptr && epi->act != nullptr) {
        using V = simd::Vec<16>::F;
        const V g = gelu::Gelu<V>(static_cast<V>(out));
        _mm512_mask_storeu_ps(epi->act + i * epi->ld_act + 16 * v, mask[v], static_cast<__m512>(g));
      }
    }
  }
}

using MicroKernelFn = void (*)(int, const uint32_t*, const float*, size_t, const uint32_t*, float*,
                               size_t, int, int, float, float, Init, Store, const TileEpilogue*);

// Note [Row tails]. A product's rows are rarely a multiple of kMr = 14: gpt-small's 1,024 token
// rows end in a strip of 2, its 256-row weight gradients in one of 4, and a thread's share of a
// split product in others. The full micro-kernel would spend 14 rows' multiply-adds on such a
// strip; the last strip of each block runs on a kernel of 4 or 8 rows instead (same packed
// panel, same per-element sums, so the same bits), whose k step costs 4 or 8 cycles instead of
// 14.
template <HalfGemmKernel kKernel, bool kInPlaceA = false>
struct RowKernels {
  static MicroKernelFn For(int rows) {
    if (rows <= 4) return MicroKernel<4, kNv, kKernel, kInPlaceA>;
    if (rows <= 8) return MicroKernel<8, kNv, kKernel, kInPlaceA>;
    return MicroKernel<kMr, kNv, kKernel, kInPlaceA>;
  }
};
using RowKernelsFn = MicroKernelFn (*)(int rows);

// Sets MXCSR DAZ|FTZ (Note [16-bit GEMM]) for its lifetime and restores the caller's.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};

// The blocking both GEMMs share (Note [16-bit GEMM], Note [fp32 GEMM]) over rows [m0, m1) x
// columns [n0, n1) of C, with k > 0 and alpha != 0. k runs in equal blocks of at most kc_limit
// (rounded up to even when `even_blocks`, so that every block starts a k pair), a k block of kc
// being steps_of(kc) packed steps; C's columns in blocks of up to kPackedBBytes of packed B.
// Per (column block, k block): every micro-panel of B is packed by pack_b(pc, jc, nr, kc, bp)
// (the block stays in L2); then A, kMcPanels micro-panels at a time by pack_a(pc, ic, mc, kc,
// ap), and each micro-panel of A (L1) is swept across the whole B block. So C is computed in
// strips of kMr rows, left to right: each row's tiles are consecutive cache lines, which the
// hardware prefetchers fetch ahead of the stores. (Sweeping columns of tiles down the whole
// height of C instead, with only a B micro-panel packed at a time, touched a new page per tile
// row and ran 10-20% slower on a C not already in cache: docs/benchmarks-kernels.md.) Between k
// blocks the running sums are stored in C itself.
//
// With in_place_a (Note [A in place]), A is not packed: micro_for's kernels read row i of a k
// block at in_place_a->a + i * lda + pc.
struct InPlaceA {
  const float* a;
  size_t lda;
};
template <typename StepsOf, typename PackA, typename PackB>
PW_TARGET_AVX512 void BlockedGemm(int k, float alpha, float beta, float* c, int ldc, int m0, int m1,
                                  int n0, int n1, int kc_limit, bool even_blocks,
                                  RowKernelsFn micro_for, StepsOf steps_of, PackA pack_a,
                                  PackB pack_b, const GemmEpilogue& epilogue = {},
                                  const InPlaceA* in_place_a = nullptr) {
  thread_local std::vector<Line> a_buf, b_buf;
  // alpha != 1 with beta != 0 combines the finished sum with c's old value: one k block.
  if (alpha != 1.0f && beta != 0.0f) kc_limit = k;
  const int blocks = (k + kc_limit - 1) / kc_limit;
  int kc_max = (k + blocks - 1) / blocks;
  if (even_blocks) kc_max += kc_max & 1;
  const int steps_max = steps_of(kc_max);
  const int nc_max = std::max(kNr, kPackedBBytes / (4 * steps_max) / kNr * kNr);
  constexpr int mc_max = kMr * kMcPanels;
  uint32_t* ap =
      in_place_a != nullptr ? nullptr : Scratch(a_buf, static_cast<size_t>(mc_max) * steps_max);
  uint32_t* bp = Scratch(b_buf, static_cast<size_t>(std::min(nc_max, n1 - n0) + kNr) * steps_max);
  for (int jc0 = n0; jc0 < n1; jc0 += nc_max) {
    const int nc = std::min(nc_max, n1 - jc0);
    for (int pc = 0; pc < k; pc += kc_max) {
      const int kc = std::min(kc_max, k - pc), steps = steps_of(kc);
      const bool first = pc == 0, last = pc + kc == k;
      Init init = Init::kLoad;  // a later block continues the running sum stored in C
      if (first) {
        init = alpha != 1.0f || beta == 0.0f ? Init::kZero
               : beta == 1.0f                ? Init::kLoad
                                             : Init::kLoadScaled;
      }
      Store store = Store::kPlain;
      if (last && alpha != 1.0f) store = beta == 0.0f ? Store::kScaled : Store::kScaledPlusBeta;
      for (int jc = 0; jc < nc; jc += kNr) {
        pack_b(pc, jc0 + jc, std::min(kNr, nc - jc), kc, bp + static_cast<size_t>(jc) * steps);
      }
      for (int ic = m0; ic < m1; ic += mc_max) {
        const int mc = std::min(mc_max, m1 - ic);
        if (in_place_a == nullptr) pack_a(pc, ic, mc, kc, ap);
        const bool epilogue_now = last && (epilogue.bias != nullptr || epilogue.act != nullptr ||
                                           epilogue.residual != nullptr);
        for (int ir = 0; ir < mc; ir += kMr) {
          float* strip = c + static_cast<size_t>(ic + ir) * ldc + jc0;
          const uint32_t* apanel =
              in_place_a != nullptr ? nullptr : ap + static_cast<size_t>(ir) * steps;
          const float* a_rows =
              in_place_a != nullptr
                  ? in_place_a->a + static_cast<size_t>(ic + ir) * in_place_a->lda + pc
                  : nullptr;
          const size_t lda = in_place_a != nullptr ? in_place_a->lda : 0;
          const int rows = std::min(kMr, mc - ir);
          const MicroKernelFn micro = micro_for(rows);
          for (int jc = 0; jc < nc; jc += kNr) {
            TileEpilogue tile{nullptr, nullptr, static_cast<size_t>(epilogue.ld_act)};
            if (epilogue.bias != nullptr) tile.bias = epilogue.bias + jc0 + jc;
            if (epilogue.act != nullptr) {
              tile.act = epilogue.act + static_cast<size_t>(ic + ir) * epilogue.ld_act + jc0 + jc;
            }
            if (epilogue.residual != nullptr) {
              tile.residual =
                  epilogue.residual + static_cast<size_t>(ic + ir) * epilogue.ld_act + jc0 + jc;
            }
            micro(steps, apanel, a_rows, lda, bp + static_cast<size_t>(jc) * steps, strip + jc, ldc,
                  rows, std::min(kNr, nc - jc), alpha, beta, init, store,
                  epilogue_now ? &tile : nullptr);
          }
        }
      }
    }
  }
}

// Rows [m0, m1) x columns [n0, n1) of C; k > 0 and alpha != 0.
PW_TARGET_AVX512 void GemmHalfAvx512(const Operands& g, int m0, int m1, int n0, int n1,
                                     HalfGemmKernel kernel) {
  FlushDenormals flush;
  const bool dot = kernel == HalfGemmKernel::kBf16Dot;
  const RowKernelsFn micro =
      dot ? RowKernels<HalfGemmKernel::kBf16Dot>::For : RowKernels<HalfGemmKernel::kFma>::For;
  BlockedGemm(
      g.k, g.alpha, g.beta, g.c, g.ldc, m0, m1, n0, n1, dot ? kKcDot : kKcFma,
      /*even_blocks=*/true, micro, [&](int kc) { return PackedSteps(kernel, kc); },
      [&](int pc, int ic, int mc, int kc, uint32_t* ap) {
        if (g.trans_a) {  // stored k x m
          PackColumnPairs<kMr>(kernel, g.is_bf16, g.a + static_cast<size_t>(pc) * g.lda + ic, g.lda,
                               mc, kc, ap);
        } else {  // stored m x k
          PackRowPairs<kMr>(kernel, g.is_bf16, g.a + static_cast<size_t>(ic) * g.lda + pc, g.lda,
                            mc, kc, ap);
        }
      },
      [&](int pc, int jc, int nr, int kc, uint32_t* bp) {
        if (g.trans_b) {  // stored n x k
          PackRowPairs<kNr>(kernel, g.is_bf16, g.b + static_cast<size_t>(jc) * g.ldb + pc, g.ldb,
                            nr, kc, bp);
        } else {  // stored k x n
          PackColumnPairs<kNr>(kernel, g.is_bf16, g.b + static_cast<size_t>(pc) * g.ldb + jc, g.ldb,
                               nr, kc, bp);
        }
      });
}

struct OperandsF32 {
  bool trans_a, trans_b;
  int k;
  float alpha;
  const float* a;
  int lda;
  const float* b;
  int ldb;
  float beta;
  float* c;
  int ldc;
};

// Note [fp32 k blocks]. Blocks of k cost two ways: every k block after the first reloads the
// running sums from C (which, swept over all rows in between, has left L2), and every block of
// columns repacks A. When A is stored m x k (not transposed), k <= kKcF32Whole and all n columns
// of B fit one packed block at that k (n * k * 4 <= kPackedBBytes), k runs as one block: C is
// loaded and stored once and A packed once. gpt-small's products with k = 768 or 1,024 and 256
// columns (the MLP projection's forward, the input gradients of the qkv and MLP input Linears)
// measured 4-7% faster so (docs/benchmarks-kernels.md). Weight gradients (A transposed) keep
// kKcF32: as one k block their A micro-panels of up to 1,024 steps outgrow L1, and their A packing
// (PackColumnsF32) grew in the step's profile for no gain in isolation. The bits are the same
// either way (Note [fp32 GEMM]).
int KcF32(bool trans_a, int k, int n) {
  if (trans_a) return kKcF32;
  const size_t width = static_cast<size_t>((n + kNr - 1) / kNr * kNr);
  return k <= kKcF32Whole && width * k * 4 <= kPackedBBytes ? k : kKcF32;
}

// Rows [m0, m1) x columns [n0, n1) of C; k > 0 and alpha != 0. The blocking of GemmHalfAvx512
// with natural k order and no denormal flushing.
PW_TARGET_AVX512 void GemmF32Avx512(const OperandsF32& g, int m0, int m1, int n0, int n1,
                                    const GemmEpilogue& epilogue) {
  // A stored m x k is read in place (Note [A in place]); stored k x m, it is packed.
  const InPlaceA in_place{g.a, static_cast<size_t>(g.lda)};
  BlockedGemm(
      g.k, g.alpha, g.beta, g.c, g.ldc, m0, m1, n0, n1, KcF32(g.trans_a, g.k, n1 - n0),
      /*even_blocks=*/false,
      g.trans_a ? RowKernels<HalfGemmKernel::kFma>::For
                : RowKernels<HalfGemmKernel::kFma, true>::For,
      [](int kc) { return kc; },
      [&](int pc, int ic, int mc, int kc, uint32_t* ap) {
        PackColumnsF32<kMr>(g.a + static_cast<size_t>(pc) * g.lda + ic, g.lda, mc, kc, ap);
      },
      [&](int pc, int jc, int nr, int kc, uint32_t* bp) {
        if (g.trans_b) {
          PackRowsF32<kNr>(g.b + static_cast<size_t>(jc) * g.ldb + pc, g.ldb, nr, kc, bp);
        } else {
          PackColumnsF32<kNr>(g.b + static_cast<size_t>(pc) * g.ldb + jc, g.ldb, nr, kc, bp);
        }
      },
      epilogue, g.trans_a ? nullptr : &in_place);
}

// Seconds of this thread's CPU time (not wall time: a preempted probe is not slower).
double ThreadSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The faster micro-kernel on this CPU, timed on one L1-resident tile (best of 5 tries each).
// Both give the same bits, so the outcome of this race changes speed only.
HalfGemmKernel ProbeBf16Kernel() {
  constexpr int kSteps = 128, kCalls = 64;
  std::vector<Line> a((kMr * 2 * kSteps + 15) / 16), b(kNr * 2 * kSteps / 16);
  for (Line& l : a) std::fill(std::begin(l.w), std::end(l.w), 0x3F803F80u);  // bf16 1.0 pairs
  for (Line& l : b) std::fill(std::begin(l.w), std::end(l.w), 0x3F803F80u);
  std::vector<float> c(kMr * kNr);
  double best[2] = {1e30, 1e30};
  for (int attempt = 0; attempt < 5; ++attempt) {
    for (int which = 0; which < 2; ++which) {
      // The same flops: kSteps pairs for dot, 2 kSteps single k for fma.
      const MicroKernelFn fn = which == 0 ? MicroKernel<kMr, kNv, HalfGemmKernel::kBf16Dot, false>
                                          : MicroKernel<kMr, kNv, HalfGemmKernel::kFma, false>;
      const double t0 = ThreadSeconds();
      for (int call = 0; call < kCalls; ++call) {
        fn(which == 0 ? kSteps : 2 * kSteps, a.data()->w, nullptr, 0, b.data()->w, c.data(), kNr,
           kMr, kNr, 1.0f, 0.0f, Init::kZero, Store::kPlain, nullptr);
      }
      best[which] = std::min(best[which], ThreadSeconds() - t0);
    }
  }
  return best[0] < best[1] ? HalfGemmKernel::kBf16Dot : HalfGemmKernel::kFma;
}

}  // namespace

bool HaveGemmHalfAvx512() { return GetCpuFeatures().avx512(); }

bool CanRunHalfGemmKernel(HalfGemmKernel kernel) {
  if (kernel == HalfGemmKernel::kAmx) return AmxAvailable();
  return HaveGemmHalfAvx512() && (kernel == HalfGemmKernel::kFma || GetCpuFeatures().avx512bf16);
}

HalfGemmKernel Bf16GemmKernel() {
  static const HalfGemmKernel kernel = [] {
    const char* force = std::getenv("PIPEWRIGHT_BF16_GEMM");
    auto forced = [&](const char* name) {
      return force != nullptr && std::strcmp(force, name) == 0;
    };
    if (forced("fma")) return HalfGemmKernel::kFma;
    if (forced("dot") && CanRunHalfGemmKernel(HalfGemmKernel::kBf16Dot)) {
      return HalfGemmKernel::kBf16Dot;
    }
    if (AmxAvailable() && (force == nullptr || forced("amx"))) return HalfGemmKernel::kAmx;
    if (!CanRunHalfGemmKernel(HalfGemmKernel::kBf16Dot)) return HalfGemmKernel::kFma;
    return ProbeBf16Kernel();
  }();
  return kernel;
}

#else  // not x86

bool HaveGemmHalfAvx512() { return false; }
bool CanRunHalfGemmKernel(HalfGemmKernel) { return false; }
HalfGemmKernel Bf16GemmKernel() { return HalfGemmKernel::kFma; }

#endif

const char* HalfGemmKernelName(HalfGemmKernel kernel) {
  switch (kernel) {
    case HalfGemmKernel::kBf16Dot:
      return "vdpbf16ps";
    case HalfGemmKernel::kAmx:
      return "amx";
    case HalfGemmKernel::kFma:
      break;
  }
  return "fma";
}

void GemmHalfBlock(bool is_bf16, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                   const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                   int ldc, int m_begin, int m_end, int n_begin, int n_end, HalfGemmKernel kernel) {
  PW_CHECK(0 <= m_begin && m_end <= m && 0 <= n_begin && n_end <= n);
  if (m_begin >= m_end || n_begin >= n_end) return;
  if (k <= 0 || alpha == 0.0f) {  // A and B are not read (BLAS semantics)
    ScaleBlock(beta, c, ldc, m_begin, m_end, n_begin, n_end);
    return;
  }
  PW_CHECK(CanRunHalfGemmKernel(kernel) && (is_bf16 || kernel == HalfGemmKernel::kFma));
  if (kernel == HalfGemmKernel::kAmx) {
    GemmAmxBlock(trans_a, trans_b, k, alpha, a, lda, b, ldb, beta, c, ldc, m_begin, m_end, n_begin,
                 n_end);
    return;
  }
#if PW_HAVE_X86_VARIANTS
  GemmHalfAvx512({is_bf16, trans_a, trans_b, k, alpha, a, lda, b, ldb, beta, c, ldc}, m_begin,
                 m_end, n_begin, n_end, kernel);
#endif
}

void GemmF32Block(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                  int lda, const float* b, int ldb, float beta, float* c, int ldc, int m_begin,
                  int m_end, int n_begin, int n_end, const GemmEpilogue& epilogue) {
  PW_CHECK(0 <= m_begin && m_end <= m && 0 <= n_begin && n_end <= n);
  if (m_begin >= m_end || n_begin >= n_end) return;
  const bool has_epilogue =
      epilogue.bias != nullptr || epilogue.act != nullptr || epilogue.residual != nullptr;
  PW_CHECK(epilogue.residual == nullptr || epilogue.act == nullptr);  // documented
  if (k <= 0 || alpha == 0.0f) {
    PW_CHECK(!has_epilogue);  // an epilogue needs a product (documented)
    ScaleBlock(beta, c, ldc, m_begin, m_end, n_begin, n_end);
    return;
  }
  PW_CHECK(HaveGemmHalfAvx512());
#if PW_HAVE_X86_VARIANTS
  GemmF32Avx512({trans_a, trans_b, k, alpha, a, lda, b, ldb, beta, c, ldc}, m_begin, m_end, n_begin,
                n_end, epilogue);
#endif
}

}  // namespace pipewright::cpu
