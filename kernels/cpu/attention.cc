// Multi-head causal self-attention as a tiled, flash-style kernel (FlashAttention-2's loop
// structure on one CPU core): no T x T matrix exists anywhere, and the forward saves only the
// row log-sum-exp, exactly as the CUDA kernel does (kernels/cuda/attention.cu).
//
// Note [CPU attention tiling]
// Work is one (batch, head) pair at a time; nothing is shared between pairs, so a pair's bits
// do not depend on which range of pairs a call covers. Per pair:
//  pack     the head's q (pre-scaled by 1/sqrt(D)), k, v (and dout) into contiguous scratch,
//           the head dim zero-padded to Dp = D rounded up to 16 and the sequence to Tp = T
//           rounded up to kTile; q, k or v also transposed ([Dp, Tp]) where they are the
//           right-hand side of a product over d. Zero padding adds exact zeros, so padded and
//           unpadded products agree bit for bit.
//  forward  per query tile of kForwardTile queries, over key tiles of as many keys up to the
//           diagonal (tiles above it are skipped): the scores transposed, S^T = K Q^T (Note
//           [Transposed scores]); online softmax (running max m and sum l per query, O rescaled
//           by exp(m_old - m_new)); O += P V. Finally out = O / l and lse = m + log l.
//  backward per key tile of kTile keys, over query tiles of kTile rows from the diagonal down,
//           with dK and dV of the tile in scratch: P = exp(S - lse) recomputed, dV += P^T dO,
//           dP = dO V^T, dS = P (dP - delta) with delta_i = dout_i . out_i, dQ += dS K (a
//           head-sized accumulator), dK += dS^T Q. dq is scaled by 1/sqrt(D) once when it is
//           stored.
// Masked (j > i) probabilities are exactly zero. In a diagonal tile the products also skip
// the masked triangle per block of micro-kernel rows (Causal), which only drops exact zeros.
//
// Each product is TileGemm: C (+)= A B over a register-blocked micro-kernel of kRows rows x 2
// vectors, written with GCC vector types (vec.h) so one body compiles to SSE/NEON (4 lanes, 4
// rows), AVX2 (8 lanes, 6 rows) and AVX-512 (16 lanes, 8 rows): 8 to 16 accumulators that fit the
// ISA's registers. Every output element is a sequential sum over k (fused multiply-adds where
// the ISA has them: GCC contracts a * b + c in C++ by default). The softmax loops are vector
// loops of the variant's width: the forward's run down the key rows of W queries at a time (Note
// [Transposed scores]), the backward's along its rows of scores.
//
// Memory per pair: forward 3 Tp Dp + kForwardTile (kForwardTile + Dp + 3) floats, backward
// 6 Tp Dp + Tp + 2 kTile (kTile + Dp) floats; a 64 x 64 tile is 16 KiB, a 128 x 128 one 64 KiB,
// so the tiles a product touches stay in L1/L2 (here 48 KiB / 2 MiB per core).
//
// Note [Attention tiles]. The forward's tiles are twice the backward's. A forward row pays per
// key tile for its max, its sum, the rescale of its output row and a scalar exp, so with fewer,
// wider key tiles it does less of that for the same products; gpt-small's micro-batch (T = 128:
// one query tile instead of two, one pass over each row instead of up to two) measured 1.43 ->
// 1.29 ms in kernels_bench, T = 1,024 7.9 -> 7.0 ms. The backward keeps 64: at 128 its
// probability and gradient tiles (64 KiB each) outgrow L1 and it ran 7% slower. The backward
// recomputes P from lse and does not depend on the forward's tiling; the forward's last bits do
// (the online softmax rescales at key-tile boundaries), so changing kForwardTile moves them.
//
// Note [Transposed scores]. The forward's softmax reduces over keys for each query. With the
// scores stored a query per row, every row paid a horizontal max and a horizontal sum (lane
// trees, a dependent chain of shuffles), a scalar exp and its own loop set-up, for a row of
// ~70 visible scores on average at T = 128: that was 36% of the forward's time. The forward
// computes S^T = K Q^T instead (keys down the rows, queries along them) and runs the softmax on
// W queries at a time down the key rows, so the max, the exp and the sum are plain lane-wise
// vector operations and a query's running max, sum and rescale factor are lanes of vectors.
// P^T is then the A operand of O += P V read with its strides swapped. The probabilities are
// the same values (the same exp of the same differences); each query's sum now adds its keys
// in order in one lane where it used W partial sums and a tree, so out and lse move in their
// last bits. kernels_bench, gpt-small's micro-batch forward: 1.32-1.34 -> 1.15-1.17 ms
// (docs/benchmarks-kernels.md).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/transpose.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu {
namespace {

constexpr int kTile = 64;          // the backward's queries per query tile and keys per key tile
constexpr int kForwardTile = 128;  // the forward's (Note [Attention tiles])
constexpr int kDimAlign = 16;      // padding of the head dim and of a product's column count

constexpr int RoundUp(int x, int m) { return (x + m - 1) / m * m; }

// Which part of a product a causal tile needs, for the block of rows [r0, r1):
//  kCols  columns c < r1 + off (scores: key c of the tile is visible to row r iff c <= r + off),
//  kColsFrom columns c >= r0 - off, from a multiple of the vector width (transposed scores:
//         query c of the tile sees key r iff c >= r - off),
//  kKTo   k < r1 + off         (A = P or dS, rows = queries, k = keys),
//  kKFrom k >= r0 + off        (A = P^T or dS^T, rows = keys, k = queries).
// Everything left out is a product with an exact zero of A or a column nobody reads.
enum class Causal { kNone, kCols, kColsFrom, kKTo, kKFrom };

// C[M x N] (+)= A[M x K] B[K x N]. A(r, p) = a[r * ars + p * aps]; B row p at b + p * ldb with N
// contiguous floats, N a multiple of kDimAlign; C row r at c + r * ldc.
struct GemmArgs {
  int M, N, K;
  const float* a;
  int ars, aps;
  const float* b;
  int ldb;
  float* c;
  int ldc;
  bool accumulate;
  Causal causal = Causal::kNone;
  int off = 0;
};
using GemmFn = void (*)(const GemmArgs&);

// Rows [r0, r0 + R) x NV vectors from column col, k in [k0, k1).
template <int W, int R, int NV>
PW_KERNEL_BODY void MicroKernel(const GemmArgs& g, int r0, int col, int k0, int k1) {
  using V = typename simd::Vec<W>::F;
  V acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = g.c + static_cast<size_t>(r0 + r) * g.ldc + col + v * W;
      acc[r][v] = g.accumulate ? simd::Load<W>(cp) : V{};
    }
  }
  const float* a = g.a + static_cast<size_t>(r0) * g.ars;
  for (int p = k0; p < k1; ++p) {
    const float* bp = g.b + static_cast<size_t>(p) * g.ldb + col;
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = simd::Load<W>(bp + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float ar = a[static_cast<size_t>(r) * g.ars + static_cast<size_t>(p) * g.aps];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += ar * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      simd::Store<W>(g.c + static_cast<size_t>(r0 + r) * g.ldc + col + v * W, acc[r][v]);
    }
  }
}

// MicroKernel for `rows` <= R rows (the last block of a product).
template <int W, int R, int NV>
PW_KERNEL_BODY void MicroKernelRows(const GemmArgs& g, int rows, int r0, int col, int k0, int k1) {
  if constexpr (R > 1) {
    if (rows < R) return MicroKernelRows<W, R - 1, NV>(g, rows, r0, col, k0, k1);
  }
  MicroKernel<W, R, NV>(g, r0, col, k0, k1);
}

// Row blocks of kRows; column blocks of 2 vectors, then one.
template <int W, int kRows>
PW_KERNEL_BODY void TileGemmBody(const GemmArgs& g) {
  static_assert(kDimAlign % W == 0, "a product's columns are whole vectors");
  for (int r0 = 0; r0 < g.M; r0 += kRows) {
    const int rows = std::min(kRows, g.M - r0);
    int n = g.N, k0 = 0, k1 = g.K, col = 0;
    if (g.causal == Causal::kCols) n = std::min(n, RoundUp(std::max(r0 + rows + g.off, 0), W));
    if (g.causal == Causal::kColsFrom) col = std::clamp((r0 - g.off) / W * W, 0, n);
    if (g.causal == Causal::kKTo) k1 = std::clamp(r0 + rows + g.off, 0, k1);
    if (g.causal == Causal::kKFrom) k0 = std::clamp(r0 + g.off, 0, k1);
    for (; col + 2 * W <= n; col += 2 * W) MicroKernelRows<W, kRows, 2>(g, rows, r0, col, k0, k1);
    if (col < n) MicroKernelRows<W, kRows, 1>(g, rows, r0, col, k0, k1);
  }
}

// One (batch, head) pair's operands.
struct Head {
  int T, C, D, Dp, Tp;
  size_t row0, col;  // the pair's first token row (b T) and its column in a third (h D)
  const float* q;    // the pair's q at token 0 (k at +C, v at +2C; row stride 3C)
  const float* k;
  const float* v;
  size_t ld_qkv;
  float scale;
};

Head MakeHead(const float* qkv, int T, int C, int H, int pair) {
  Head hd;
  hd.T = T;
  hd.C = C;
  hd.D = C / H;
  hd.Dp = RoundUp(hd.D, kDimAlign);
  hd.Tp = RoundUp(T, kTile);
  hd.row0 = static_cast<size_t>(pair / H) * T;
  hd.col = static_cast<size_t>(pair % H) * hd.D;
  hd.ld_qkv = 3 * static_cast<size_t>(C);
  hd.q = qkv + hd.row0 * hd.ld_qkv + hd.col;
  hd.k = hd.q + C;
  hd.v = hd.q + 2 * static_cast<size_t>(C);
  hd.scale = 1.0f / std::sqrt(static_cast<float>(hd.D));
  return hd;
}

// Note [Attention prefetch]. A head's rows of qkv, out, dout and dqkv are D floats each, 3C or
// C floats apart: every row is new cache lines, at a stride (3 KiB for gpt-small's qkv) that the
// hardware prefetchers do not follow, so each row's load or store waited on memory (perf: the
// loads of the packing and of delta = dout . out took about half of the attention kernels' own
// time at T = 128). The loops that walk those rows prefetch the row kPrefetchRows ahead, and
// while a pair computes, its softmax loops fetch the next pair's rows into L2 a few at a time
// (NextPairRows; the forward one row per visible key row of each query block, the backward two
// per score row, enough to cover the next pair's rows): in a gpt-small step that took the
// attention kernels from 8.9% to 8.3% of the time (perf, two runs each).
constexpr int kPrefetchRows = 8;

// Starts loading (or, for_write, fetching for a store) the cache lines of floats [p, p + n).
PW_KERNEL_BODY void PrefetchFloats(const float* p, int n, bool for_write = false) {
  const char* c = reinterpret_cast<const char*>(p);
  const char* end = reinterpret_cast<const char*>(p + n);
  for (; c < end; c += 64) {
    if (for_write) {
      __builtin_prefetch(c, 1, 3);
    } else {
      __builtin_prefetch(c, 0, 3);
    }
  }
  // The last line when [p, p + n) ends past a line that the stride above skipped.
  if (n > 0) __builtin_prefetch(reinterpret_cast<const char*>(p + n - 1), for_write ? 1 : 0, 3);
}

// Row t + kPrefetchRows of a head's rows (row stride ld, D floats), when it exists.
PW_KERNEL_BODY void PrefetchRowAhead(const Head& hd, const float* base, size_t ld, int t,
                                     bool for_write = false) {
  if (t + kPrefetchRows < hd.T) {
    PrefetchFloats(base + static_cast<size_t>(t + kPrefetchRows) * ld, hd.D, for_write);
  }
}

// The next pair's rows, fetched into L2 a few at a time while this pair computes (Note
// [Attention prefetch]): up to kMaxBases row sets (q, k, v, dout, out) of T rows of D floats.
// Step(n) issues the next n rows' prefetches; the pair's row loops call it, so the fetches of
// the next pair overlap this pair's arithmetic instead of its packing waiting on them.
struct NextPairRows {
  static constexpr int kMaxBases = 5;
  const float* base[kMaxBases] = {};
  size_t ld[kMaxBases] = {};
  int bases = 0, T = 0, D = 0;
  int base_at = 0, row_at = 0;  // the next row to fetch: row row_at of base base_at

  NextPairRows() = default;  // nothing to fetch (the call's last pair)
  explicit NextPairRows(const Head& next_pair) : T(next_pair.T), D(next_pair.D) {
    for (const float* b : {next_pair.q, next_pair.k, next_pair.v}) Add(b, next_pair.ld_qkv);
  }
  void Add(const float* b, size_t row_stride) {
    base[bases] = b;
    ld[bases++] = row_stride;
  }
  // (Counters, not a division of one running index: an idiv per row showed in perf annotate.)
  __attribute__((always_inline)) void Step(int rows) {
    for (; rows > 0 && base_at < bases; --rows) {
      const float* row = base[base_at] + static_cast<size_t>(row_at) * ld[base_at];
      if (++row_at == T) {
        row_at = 0;
        ++base_at;
      }
      const char* c = reinterpret_cast<const char*>(row);
      const char* end = reinterpret_cast<const char*>(row + D);
      for (; c < end; c += 64) __builtin_prefetch(c, 0, 2);
      __builtin_prefetch(end - 1, 0, 2);
    }
  }
};

// dst [Tp, Dp] = s * src[t, d] (row stride ld), zero outside t < T, d < D. (Inlined into each
// ISA's pair loop, like the rest of the kernel: compiled on its own it ran as SSE2.)
template <int W>
PW_KERNEL_BODY void Pack(const Head& hd, const float* src, size_t ld, float s, float* dst) {
  using V = typename simd::Vec<W>::F;
  for (int t = 0; t < hd.Tp; ++t) {
    float* row = dst + static_cast<size_t>(t) * hd.Dp;
    PrefetchRowAhead(hd, src, ld, t);
    const float* x = src + static_cast<size_t>(t) * ld;
    for (int d = 0; d < hd.Dp; d += W) {  // Dp is whole vectors; lanes at d >= D are zeros
      const int n = t < hd.T ? std::clamp(hd.D - d, 0, W) : 0;
      simd::Store<W>(row + d, n == 0 ? V{} : s * simd::LoadN<W>(x + d, n));
    }
  }
}

#if PW_HAVE_X86_VARIANTS
// PackTransposed's block with AVX-512: rows [0, n) (n <= 16; the rest zeros) of src (row stride
// ld), head dims [0, D) (zeros up to Dp, a multiple of 16), transposed in registers, 16 head dims
// at a time, into dst (row stride ld_dst) as Dp runs of 16 floats, each value times s.
PW_TARGET_AVX512 inline void TransposeBlockAvx512(const float* src, size_t ld, int n, int D, int Dp,
                                                  float s, float* dst, int ld_dst) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int d0 = 0; d0 < Dp; d0 += 16) {
    const __mmask16 load = static_cast<__mmask16>((1u << std::clamp(D - d0, 0, 16)) - 1);
    __m512i r[16];
    for (int t = 0; t < 16; ++t) {
      r[t] = t < n ? _mm512_maskz_loadu_epi32(load, src + static_cast<size_t>(t) * ld + d0)
                   : _mm512_setzero_si512();
    }
    Transpose16x16(r);
    for (int d = 0; d < 16; ++d) {
      _mm512_storeu_ps(dst + static_cast<size_t>(d0 + d) * ld_dst,
                       _mm512_mul_ps(vs, _mm512_castsi512_ps(r[d])));
    }
  }
}
#endif

// The transpose times s, dst [Dp, Tp], in blocks of 16 tokens: every store is a contiguous run (a
// column-at-a-time transpose that stores with a stride of Tp floats was a quarter of the
// backward's own time at T = 1024). With AVX-512 each block is loaded as 16 rows of 16 head
// dims and transposed in registers; otherwise each run is gathered from its column.
template <int W>
PW_KERNEL_BODY void PackTransposed(const Head& hd, const float* src, size_t ld, float s,
                                   float* dst) {
  constexpr int kBlock = 16;
  for (int t0 = 0; t0 < hd.Tp; t0 += kBlock) {
    const int n = std::clamp(hd.T - t0, 0, kBlock);
    for (int t = t0; t < t0 + n; ++t) PrefetchRowAhead(hd, src, ld, t + kBlock - kPrefetchRows);
#if PW_HAVE_X86_VARIANTS
    if constexpr (W == 16) {
      TransposeBlockAvx512(src + static_cast<size_t>(t0) * ld, ld, n, hd.D, hd.Dp, s, dst + t0,
                           hd.Tp);
      continue;
    }
#endif
    for (int d = 0; d < hd.Dp; ++d) {
      float* out = dst + static_cast<size_t>(d) * hd.Tp + t0;
      int t = 0;
      if (d < hd.D) {
        const float* x = src + static_cast<size_t>(t0) * ld + d;
        for (; t < n; ++t) out[t] = s * x[t * ld];
      }
      std::fill(out + t, out + kBlock, 0.0f);
    }
  }
}

// The rows [0, m) x columns [0, ncols) of one score tile whose key j is visible to row r iff
// j <= r + off: columns [0, visible) of row r, the rest must become exact zeros.
int Visible(int r, int off, int ncols) { return std::min(ncols, r + off + 1); }

// S = Q K^T for query rows [i0, i0 + m) and key columns [j0, j0 + ncols), into s, whose rows
// are ld_s floats apart (the tile width).
GemmArgs ScoreArgs(const Head& hd, const float* q, const float* kt, int i0, int m, int j0,
                   int ncols, float* s, int ld_s) {
  const float* qi = q + static_cast<size_t>(i0) * hd.Dp;
  GemmArgs g{m, ncols, hd.Dp, qi, hd.Dp, 1, kt + j0, hd.Tp, s, ld_s, false};
  g.causal = Causal::kCols;
  g.off = i0 - j0;
  return g;
}

size_t ForwardFloats(int T, int D) {
  const size_t tp = RoundUp(T, kTile), dp = RoundUp(D, kDimAlign);
  return 3 * tp * dp + kForwardTile * (kForwardTile + dp + 3);
}

size_t BackwardFloats(int T, int D) {
  const size_t tp = RoundUp(T, kTile), dp = RoundUp(D, kDimAlign);
  return 6 * tp * dp + tp + 2 * kTile * (kTile + dp);
}

template <int W, GemmFn kGemm>
PW_KERNEL_BODY void ForwardPair(const Head& hd, float* out, float* lse, float* scratch,
                                NextPairRows& ahead) {
  const size_t td = static_cast<size_t>(hd.Tp) * hd.Dp;
  float* qt = scratch;  // [Dp, Tp], scaled
  float* k = qt + td;   // [Tp, Dp]
  float* v = k + td;    // [Tp, Dp]
  float* st = v + td;   // [kForwardTile keys, kForwardTile queries]: scores, then probabilities
  float* o = st + kForwardTile * kForwardTile;  // [kForwardTile, Dp]: unnormalised output rows
  float* row_max = o + kForwardTile * hd.Dp;    // per query of the tile
  float* row_sum = row_max + kForwardTile;
  float* corr = row_sum + kForwardTile;  // exp(old max - new max), per query
  PackTransposed<W>(hd, hd.q, hd.ld_qkv, hd.scale, qt);
  Pack<W>(hd, hd.k, hd.ld_qkv, 1.0f, k);
  Pack<W>(hd, hd.v, hd.ld_qkv, 1.0f, v);
  using V = typename simd::Vec<W>::F;
  const typename simd::Vec<W>::I lane = simd::LaneIndex<W>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int i0 = 0; i0 < hd.T; i0 += kForwardTile) {
    const int m = std::min(kForwardTile, hd.T - i0);
    const int mw = RoundUp(m, kDimAlign);  // queries computed (the rest of Q^T is zeros)
    std::fill(o, o + static_cast<size_t>(m) * hd.Dp, 0.0f);
    std::fill(row_max, row_max + mw, kNegInf);
    std::fill(row_sum, row_sum + mw, 0.0f);
    for (int j0 = 0; j0 <= i0; j0 += kForwardTile) {  // key tiles up to the diagonal
      const int off = i0 - j0;
      const int keys = std::min(kForwardTile, off + m);  // keys some query of the tile sees
      // S^T = K Q^T: row jj (a key) from column (jj - off) on, rounded down to a vector.
      kGemm({keys, mw, hd.Dp, k + static_cast<size_t>(j0) * hd.Dp, hd.Dp, 1, qt + i0, hd.Tp, st,
             kForwardTile, false, Causal::kColsFrom, off});
      // The softmax runs down the key rows for W queries at a time, so every reduction is a
      // lane-wise max or sum (Note [Transposed scores]). Key jj is visible to query c iff
      // jj <= c + off: to all W queries of the block up to `all`, to some up to `some`.
      for (int c = 0; c < mw; c += W) {
        const int all = std::min(keys, c + off + 1), some = std::min(keys, c + W + off);
        const V old_max = simd::Load<W>(row_max + c);
        V mx = old_max;
        for (int jj = 0; jj < all; ++jj) {
          const V x = simd::Load<W>(st + jj * kForwardTile + c);
          mx = x > mx ? x : mx;
        }
        for (int jj = all; jj < some; ++jj) {
          const V x = simd::Load<W>(st + jj * kForwardTile + c);
          const V vis = lane + c + off >= jj ? x : V{} + kNegInf;
          mx = vis > mx ? vis : mx;
        }
        V sum{};
        for (int jj = 0; jj < all; ++jj) {
          ahead.Step(1);  // one row of the next pair per visible key row and query block
          float* p = st + jj * kForwardTile + c;
          const V e = FastExpLanes(simd::Load<W>(p) - mx);
          simd::Store<W>(p, e);
          sum += e;
        }
        for (int jj = all; jj < some; ++jj) {
          float* p = st + jj * kForwardTile + c;
          V e = FastExpLanes(simd::Load<W>(p) - mx);
          e = lane + c + off >= jj ? e : V{};
          simd::Store<W>(p, e);
          sum += e;
        }
        // O += P V reads, for a block of rows that may reach into the next W queries, keys up
        // to W past `some`: exact zeros there.
        for (int jj = some; jj < std::min(keys, some + W); ++jj) {
          simd::Store<W>(st + jj * kForwardTile + c, V{});
        }
        const V cr = old_max == kNegInf ? V{} : FastExpLanes(old_max - mx);
        simd::Store<W>(row_max + c, mx);
        simd::Store<W>(corr + c, cr);
        // One fused multiply-add per lane on every ISA.
        for (int l = 0; l < W; ++l) {
          row_sum[c + l] = __builtin_fmaf(row_sum[c + l], cr[l], sum[l]);
        }
      }
      if (j0 > 0) {  // rescale the rows summed over earlier key tiles (zeros before the first)
        for (int r = 0; r < m; ++r) {
          float* orow = o + static_cast<size_t>(r) * hd.Dp;
          for (int d = 0; d < hd.Dp; ++d) orow[d] *= corr[r];
        }
      }
      // O += P V, P = (S^T)^T
      kGemm({m, hd.Dp, keys, st, 1, kForwardTile, v + static_cast<size_t>(j0) * hd.Dp, hd.Dp, o,
             hd.Dp, true, Causal::kKTo, off});
    }
    for (int r = 0; r < m; ++r) {
      const float inv = 1.0f / row_sum[r];
      const float* orow = o + static_cast<size_t>(r) * hd.Dp;
      float* dst = out + static_cast<size_t>(i0 + r) * hd.C;
      PrefetchRowAhead(hd, out, hd.C, i0 + r, /*for_write=*/true);
      for (int d = 0; d < hd.D; ++d) dst[d] = orow[d] * inv;
      lse[i0 + r] = row_max[r] + std::log(row_sum[r]);
    }
  }
}

template <int W, GemmFn kGemm>
PW_KERNEL_BODY void BackwardPair(const Head& hd, const float* dout, const float* out,
                                 const float* lse, float* dq, float* scratch, NextPairRows& ahead) {
  const size_t td = static_cast<size_t>(hd.Tp) * hd.Dp;
  const int Dp = hd.Dp;
  float* q = scratch;                   // [Tp, Dp], scaled
  float* k = q + td;                    // [Tp, Dp]
  float* kt = k + td;                   // [Dp, Tp]
  float* vt = kt + td;                  // [Dp, Tp]
  float* dob = vt + td;                 // [Tp, Dp]: dout
  float* dq_acc = dob + td;             // [Tp, Dp]: unscaled dq
  float* delta = dq_acc + td;           // [Tp]: dout_i . out_i
  float* p = delta + hd.Tp;             // [kTile, kTile]: probabilities
  float* ds = p + kTile * kTile;        // [kTile, kTile]: dP, then dS
  float* dk_acc = ds + kTile * kTile;   // [kTile, Dp]
  float* dv_acc = dk_acc + kTile * Dp;  // [kTile, Dp]
  Pack<W>(hd, hd.q, hd.ld_qkv, hd.scale, q);
  Pack<W>(hd, hd.k, hd.ld_qkv, 1.0f, k);
  PackTransposed<W>(hd, hd.k, hd.ld_qkv, 1.0f, kt);
  PackTransposed<W>(hd, hd.v, hd.ld_qkv, 1.0f, vt);
  Pack<W>(hd, dout, hd.C, 1.0f, dob);
  using V = typename simd::Vec<W>::F;
  const typename simd::Vec<W>::I lane = simd::LaneIndex<W>();
  std::memset(dq_acc, 0, sizeof(float) * td);
  // delta_i = dout_i . out_i, in W-lane partial sums (a scalar running sum is one dependent
  // chain of D multiply-adds per row); out's row is read up to D only.
  for (int i = 0; i < hd.T; ++i) {
    const float* o = out + static_cast<size_t>(i) * hd.C;
    const float* g = dob + static_cast<size_t>(i) * Dp;
    PrefetchRowAhead(hd, out, hd.C, i);
    typename simd::Vec<W>::F dot{};
    for (int d = 0; d < hd.D; d += W) {
      const int n = std::min(W, hd.D - d);
      dot += simd::LoadN<W>(g + d, n) * simd::LoadN<W>(o + d, n);
    }
    delta[i] = simd::ReduceAdd<W>(dot);
  }
  float* dk = dq + hd.C;
  float* dv = dq + 2 * static_cast<size_t>(hd.C);
  for (int j0 = 0; j0 < hd.T; j0 += kTile) {
    std::fill(dk_acc, dk_acc + kTile * Dp, 0.0f);
    std::fill(dv_acc, dv_acc + kTile * Dp, 0.0f);
    for (int i0 = j0; i0 < hd.T; i0 += kTile) {  // query tiles from the diagonal down
      const int m = std::min(kTile, hd.T - i0);
      const int off = i0 - j0;
      const int ncols = std::min(kTile, RoundUp(off + m, kDimAlign));
      const float* qi = q + static_cast<size_t>(i0) * Dp;
      const float* doi = dob + static_cast<size_t>(i0) * Dp;
      kGemm(ScoreArgs(hd, q, kt, i0, m, j0, ncols, p, kTile));
      for (int r = 0; r < m; ++r) {  // P = exp(S - lse) where visible, exact zeros elsewhere
        float* pr = p + r * kTile;
        const int vis = Visible(r, off, ncols);
        const float l = lse[i0 + r];
        ahead.Step(2);
        for (int c = 0; c < ncols; c += W) {
          V e{};
          if (c < vis) e = lane + c < vis ? FastExpLanes(simd::Load<W>(pr + c) - l) : V{};
          simd::Store<W>(pr + c, e);
        }
      }
      // dV += P^T dO; dP = dO V^T.
      kGemm({ncols, Dp, m, p, 1, kTile, doi, Dp, dv_acc, Dp, true, Causal::kKFrom, -off});
      kGemm({m, ncols, Dp, doi, Dp, 1, vt + j0, hd.Tp, ds, kTile, false, Causal::kCols, off});
      for (int r = 0; r < m; ++r) {  // dS = P (dP - delta) where visible (dP past it is unset)
        const float* pr = p + r * kTile;
        float* dsr = ds + r * kTile;
        const int vis = Visible(r, off, ncols);
        const float dl = delta[i0 + r];
        ahead.Step(2);
        for (int c = 0; c < ncols; c += W) {
          V x{};
          if (c < vis) {
            x = simd::Load<W>(pr + c) * (simd::Load<W>(dsr + c) - dl);
            x = lane + c < vis ? x : V{};
          }
          simd::Store<W>(dsr + c, x);
        }
      }
      // dQ += dS K; dK += dS^T Q.
      kGemm({m, Dp, ncols, ds, kTile, 1, k + static_cast<size_t>(j0) * Dp, Dp,
             dq_acc + static_cast<size_t>(i0) * Dp, Dp, true, Causal::kKTo, off});
      kGemm({ncols, Dp, m, ds, 1, kTile, qi, Dp, dk_acc, Dp, true, Causal::kKFrom, -off});
    }
    for (int j = j0; j < std::min(j0 + kTile, hd.T); ++j) {  // (loops: memcpy calls cost more)
      const size_t at = static_cast<size_t>(j) * hd.ld_qkv, from = static_cast<size_t>(j - j0) * Dp;
      PrefetchRowAhead(hd, dk, hd.ld_qkv, j, /*for_write=*/true);
      PrefetchRowAhead(hd, dv, hd.ld_qkv, j, /*for_write=*/true);
      for (int d = 0; d < hd.D; ++d) dk[at + d] = dk_acc[from + d];
      for (int d = 0; d < hd.D; ++d) dv[at + d] = dv_acc[from + d];
    }
  }
  for (int i = 0; i < hd.T; ++i) {
    float* dst = dq + static_cast<size_t>(i) * hd.ld_qkv;
    const float* src = dq_acc + static_cast<size_t>(i) * Dp;
    PrefetchRowAhead(hd, dq, hd.ld_qkv, i, /*for_write=*/true);
    for (int d = 0; d < hd.D; ++d) dst[d] = hd.scale * src[d];
  }
}

// A call's arguments for pairs [begin, end); the Pair functions take each pair's pointers.
struct ForwardCall {
  const float* qkv;
  float* out;
  float* lse;
  int T, C, H, begin, end;
  float* scratch;
};

struct BackwardCall {
  const float* dout;
  const float* qkv;
  const float* out;
  const float* lse;
  float* dqkv;
  int T, C, H, begin, end;
  float* scratch;
};

template <int W, GemmFn kGemm>
PW_KERNEL_BODY void ForwardBody(const ForwardCall& a) {
  for (int pair = a.begin; pair < a.end; ++pair) {
    const Head hd = MakeHead(a.qkv, a.T, a.C, a.H, pair);
    NextPairRows ahead;
    if (pair + 1 < a.end) ahead = NextPairRows(MakeHead(a.qkv, a.T, a.C, a.H, pair + 1));
    ForwardPair<W, kGemm>(hd, a.out + hd.row0 * a.C + hd.col,
                          a.lse + static_cast<size_t>(pair) * a.T, a.scratch, ahead);
  }
}

template <int W, GemmFn kGemm>
PW_KERNEL_BODY void BackwardBody(const BackwardCall& a) {
  for (int pair = a.begin; pair < a.end; ++pair) {
    const Head hd = MakeHead(a.qkv, a.T, a.C, a.H, pair);
    const size_t at = hd.row0 * a.C + hd.col;
    NextPairRows ahead;
    if (pair + 1 < a.end) {
      const Head next = MakeHead(a.qkv, a.T, a.C, a.H, pair + 1);
      const size_t next_at = next.row0 * a.C + next.col;
      ahead = NextPairRows(next);
      ahead.Add(a.dout + next_at, a.C);
      ahead.Add(a.out + next_at, a.C);
    }
    BackwardPair<W, kGemm>(hd, a.dout + at, a.out + at, a.lse + static_cast<size_t>(pair) * a.T,
                           a.dqkv + hd.row0 * hd.ld_qkv + hd.col, a.scratch, ahead);
  }
}

// Per-ISA variants (isa.h): the products out of line, one copy per ISA; the pair loops inline
// their bodies so that the softmax loops vectorise for the same ISA.
void GemmBaseline(const GemmArgs& g) { TileGemmBody<4, 4>(g); }
void ForwardBaseline(const ForwardCall& a) { ForwardBody<4, GemmBaseline>(a); }
void BackwardBaseline(const BackwardCall& a) { BackwardBody<4, GemmBaseline>(a); }
#if PW_HAVE_X86_VARIANTS
PW_TARGET_AVX2 void GemmAvx2(const GemmArgs& g) { TileGemmBody<8, 6>(g); }
PW_TARGET_AVX2 void ForwardAvx2(const ForwardCall& a) { ForwardBody<8, GemmAvx2>(a); }
PW_TARGET_AVX2 void BackwardAvx2(const BackwardCall& a) { BackwardBody<8, GemmAvx2>(a); }
PW_TARGET_AVX512 void GemmAvx512(const GemmArgs& g) { TileGemmBody<16, 8>(g); }
PW_TARGET_AVX512 void ForwardAvx512(const ForwardCall& a) { ForwardBody<16, GemmAvx512>(a); }
PW_TARGET_AVX512 void BackwardAvx512(const BackwardCall& a) { BackwardBody<16, GemmAvx512>(a); }
#endif

}  // namespace

size_t AttentionForwardScratchFloats(int T, int C, int H) { return ForwardFloats(T, C / H); }
size_t AttentionBackwardScratchFloats(int T, int C, int H) { return BackwardFloats(T, C / H); }

void AttentionForward(const float* qkv, float* out, float* lse, int T, int C, int H, int begin,
                      int end, float* scratch, Isa isa) {
  const ForwardCall a{qkv, out, lse, T, C, H, begin, end, scratch};
#if PW_HAVE_X86_VARIANTS
  if (isa == Isa::kAvx512) return ForwardAvx512(a);
  if (isa == Isa::kAvx2) return ForwardAvx2(a);
#endif
  ForwardBaseline(a);
}

void AttentionBackward(const float* dout, const float* qkv, const float* out, const float* lse,
                       float* dqkv, int T, int C, int H, int begin, int end, float* scratch,
                       Isa isa) {
  const BackwardCall a{dout, qkv, out, lse, dqkv, T, C, H, begin, end, scratch};
#if PW_HAVE_X86_VARIANTS
  if (isa == Isa::kAvx512) return BackwardAvx512(a);
  if (isa == Isa::kAvx2) return BackwardAvx2(a);
#endif
  BackwardBaseline(a);
}

}  // namespace pipewright::cpu
