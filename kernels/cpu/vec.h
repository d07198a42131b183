// Portable SIMD for the CPU kernels (internal): GCC vector types of W float lanes, the helpers
// the kernels share, and Dispatch, which runs one kernel body compiled for each ISA of isa.h.
//
// A kernel is a struct with one always-inline static member template over the lane count:
//
//   struct GeluForwardKernel {
//     template <int W>
//     PW_KERNEL_BODY void Run(const float* x, float* y, size_t n) { ... Vec<W>::F ... }
//   };
//   void GeluForward(const float* x, float* y, size_t n, Isa isa) {
//     simd::Dispatch<GeluForwardKernel>(isa, x, y, n);
//   }
//
// Dispatch instantiates Run<16> in a PW_TARGET_AVX512 function, Run<8> in a PW_TARGET_AVX2 one
// and Run<4> in a plain one (SSE2 on x86-64, NEON on aarch64), and calls the one `isa` names.
// The vector types compile to the registers of whichever of those functions the body is inlined
// into, so one body serves every ISA; lambdas passed to the helpers must be always-inline
// (PW_LAMBDA) so that they are compiled for the variant too.
//
// Note [Per-ISA vector operations]: where an ISA has a better instruction than what GCC makes of
// the portable expression (min/max that pass NaN through, rounding, scaling by 2^n), the
// operation is an overload per vector type: portable vector code for any width, and for the
// AVX2 / AVX-512 widths intrinsics in a function with that ISA's target attribute. Those are not
// always-inline (GCC refuses to always-inline a target function into the target-less bodies);
// they are inlined once the body is inside its variant, which Dispatch's variants force with
// `flatten`. A body of width 8 or 16 only ever runs inside the variant of that width.
//
// Note [Same bits for every chunking]: the helpers that walk an array (ForEach) compute every
// element with the same vector code, a partial last vector included (it is padded, computed
// whole, and only its first lanes stored), so an element's bits do not depend on where the range
// it was computed in began or ended: a caller may split any range across threads. Row kernels
// keep each row's reductions inside the row; column reductions (bias and LayerNorm weight
// gradients) add the rows onto the running sums one at a time in row order, so they may be split
// by column, and consecutive row ranges accumulate to the same bits as one call.
#ifndef PIPEWRIGHT_KERNELS_CPU_VEC_H_
#define PIPEWRIGHT_KERNELS_CPU_VEC_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/isa.h"

#if PW_HAVE_X86_VARIANTS
#include <immintrin.h>
#endif

// An always-inline lambda: [&](...) PW_LAMBDA { ... }.
#define PW_LAMBDA __attribute__((always_inline))

namespace pipewright::cpu::simd {

template <int W>
struct Vec {
  static_assert(W == 4 || W == 8 || W == 16, "4, 8 or 16 float lanes");
  typedef float F __attribute__((vector_size(4 * W)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
  typedef double D __attribute__((vector_size(4 * W)));  // W / 2 doubles: one register
  typedef float H __attribute__((vector_size(2 * W)));   // W / 2 floats: half a register
  // Unaligned, may-alias views for loads and stores.
  typedef float FU __attribute__((vector_size(4 * W), aligned(4), may_alias));
};

template <int W>
PW_KERNEL_BODY typename Vec<W>::F Load(const float* p) {
  return *reinterpret_cast<const typename Vec<W>::FU*>(p);
}

template <int W>
PW_KERNEL_BODY void Store(float* p, typename Vec<W>::F v) {
  *reinterpret_cast<typename Vec<W>::FU*>(p) = v;
}

// The first k (1..W) floats at p, the other lanes `pad`. With k == W (a constant after inlining
// in the loops below) this is a plain load.
template <int W>
PW_KERNEL_BODY typename Vec<W>::F LoadN(const float* p, int k, float pad = 0.0f) {
  if (k == W) return Load<W>(p);
  float buf[W];
  for (int l = 0; l < W; ++l) buf[l] = pad;
  std::memcpy(buf, p, sizeof(float) * k);
  return Load<W>(buf);
}

// Stores the first k (1..W) lanes of v at p.
template <int W>
PW_KERNEL_BODY void StoreN(float* p, typename Vec<W>::F v, int k) {
  if (k == W) return Store<W>(p, v);
  float buf[W];
  Store<W>(buf, v);
  std::memcpy(p, buf, sizeof(float) * k);
}

// {0, 1, ..., W - 1}: compared with a count, a mask of the lanes below it.
template <int W>
PW_KERNEL_BODY typename Vec<W>::I LaneIndex() {
  typename Vec<W>::I lane;
  for (int l = 0; l < W; ++l) lane[l] = l;
  return lane;
}

// v with lanes k.. set to zero (k in 1..W).
template <int W>
PW_KERNEL_BODY typename Vec<W>::F KeepFirst(typename Vec<W>::F v, int k) {
  if (k == W) return v;
  return LaneIndex<W>() < k ? v : typename Vec<W>::F{};
}

// v widened to double: lanes [0, W/2) in *lo, lanes [W/2, W) in *hi. (One vector of W doubles
// would be wider than the ISA's registers, which GCC lowers through memory.)
template <int W>
PW_KERNEL_BODY void Widen(typename Vec<W>::F v, typename Vec<W>::D* lo, typename Vec<W>::D* hi) {
  typename Vec<W>::H h[2];
  std::memcpy(h, &v, sizeof(v));
  *lo = __builtin_convertvector(h[0], typename Vec<W>::D);
  *hi = __builtin_convertvector(h[1], typename Vec<W>::D);
}

// op over the lanes as a tree (lane l with lane l + n/2, ...): a fixed order, log2(n) deep.
template <typename T, int N, typename Op>
PW_KERNEL_BODY T ReduceLanes(const T (&lanes)[N], Op op) {
  T x[N];
  for (int l = 0; l < N; ++l) x[l] = lanes[l];
#pragma GCC unroll 16
  for (int w = N / 2; w > 0; w /= 2) {
#pragma GCC unroll 16
    for (int l = 0; l < w; ++l) x[l] = op(x[l], x[l + w]);
  }
  return x[0];
}

template <int W>
PW_KERNEL_BODY float ReduceAdd(typename Vec<W>::F v) {
  float x[W];
  std::memcpy(x, &v, sizeof(x));
  return ReduceLanes(x, [](float a, float b) PW_LAMBDA { return a + b; });
}

template <int W>
PW_KERNEL_BODY double ReduceAdd(typename Vec<W>::D v) {
  double x[W / 2];
  std::memcpy(x, &v, sizeof(x));
  return ReduceLanes(x, [](double a, double b) PW_LAMBDA { return a + b; });
}

template <int W>
PW_KERNEL_BODY float ReduceMax(typename Vec<W>::F v) {
  float x[W];
  std::memcpy(x, &v, sizeof(x));
  return ReduceLanes(x, [](float a, float b) PW_LAMBDA { return a > b ? a : b; });
}

// ---- per-ISA operations (Note [Per-ISA vector operations]) ----

// min(a, x) and max(a, x), except that a NaN x is returned as is.
template <typename V>
PW_KERNEL_BODY V MinOrNaN(V a, V x) {
  return x > a ? a : x;
}
template <typename V>
PW_KERNEL_BODY V MaxOrNaN(V a, V x) {
  return x < a ? a : x;
}
// x rounded to the nearest integer (ties to even), for |x| < 2^22.
template <typename V>
PW_KERNEL_BODY V RoundToInt(V x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: the sum's last bit is the units
  return (x + kRound) - kRound;
}
// p * 2^n for integral n in [-126, 127].
template <typename V>
PW_KERNEL_BODY V TimesPow2(V p, V n) {
  using I = decltype(n < n);  // the int32 vector of V's width
  return p * (V)((__builtin_convertvector(n, I) + 127) << 23);
}

#if PW_HAVE_X86_VARIANTS
// MINPS/MAXPS return their second operand when either is NaN. The AVX-512 ones are written as
// the merge-masked intrinsics with a full mask (the same instruction): the plain ones start from
// _mm512_undefined_ps, which GCC 12 reports as maybe-uninitialized.
PW_TARGET_AVX2 inline Vec<8>::F MinOrNaN(Vec<8>::F a, Vec<8>::F x) {
  return (Vec<8>::F)_mm256_min_ps((__m256)a, (__m256)x);
}
PW_TARGET_AVX2 inline Vec<8>::F MaxOrNaN(Vec<8>::F a, Vec<8>::F x) {
  return (Vec<8>::F)_mm256_max_ps((__m256)a, (__m256)x);
}
PW_TARGET_AVX2 inline Vec<8>::F RoundToInt(Vec<8>::F x) {
  return (Vec<8>::F)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
PW_TARGET_AVX512 inline Vec<16>::F MinOrNaN(Vec<16>::F a, Vec<16>::F x) {
  return (Vec<16>::F)_mm512_mask_min_ps((__m512)x, 0xFFFF, (__m512)a, (__m512)x);
}
PW_TARGET_AVX512 inline Vec<16>::F MaxOrNaN(Vec<16>::F a, Vec<16>::F x) {
  return (Vec<16>::F)_mm512_mask_max_ps((__m512)x, 0xFFFF, (__m512)a, (__m512)x);
}
PW_TARGET_AVX512 inline Vec<16>::F RoundToInt(Vec<16>::F x) {
  return (Vec<16>::F)_mm512_mask_roundscale_ps((__m512)x, 0xFFFF, (__m512)x,
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
PW_TARGET_AVX512 inline Vec<16>::F TimesPow2(Vec<16>::F p, Vec<16>::F n) {
  return (Vec<16>::F)_mm512_mask_scalef_ps((__m512)p, 0xFFFF, (__m512)p,
                                           (__m512)n);  // p 2^floor(n)
}
#endif

// body(i, k) for the vectors [i, i + k) of [0, n): k == W for all but a last partial one.
template <int W, typename Body>
PW_KERNEL_BODY void ForEach(size_t n, Body body) {
  size_t i = 0;
  for (; i + W <= n; i += W) body(i, W);
  if (i < n) body(i, static_cast<int>(n - i));
}

// Column sums that add the rows in row order, kRows rows per load and store of the running
// sums: body(r0, r1, c, k) for the rows [r0, r1) of each group and the vectors [c, c + k) of
// [0, cols), groups in row order. The grouping changes no bits (the running sums are stored
// exactly), only the memory traffic.
constexpr int kColumnRows = 4;
template <int W, int kRows = kColumnRows, typename Body>
PW_KERNEL_BODY void ColumnBlocks(int rows, int cols, Body body) {
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int r1 = rows - r0 < kRows ? rows : r0 + kRows;
    ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA { body(r0, r1, c, k); });
  }
}

// The largest value of x[0, n) (n >= 1); NaN when any element is NaN is not promised.
template <int W>
PW_KERNEL_BODY float Max(const float* x, size_t n) {
  typename Vec<W>::F acc = typename Vec<W>::F{} + x[0];
  ForEach<W>(n, [&](size_t i, int k) PW_LAMBDA {
    const typename Vec<W>::F v = LoadN<W>(x + i, k, x[0]);
    acc = v > acc ? v : acc;
  });
  return ReduceMax<W>(acc);
}

// ---- per-ISA variants ----

template <typename K, typename... A>
auto RunBaseline(A... a) {
  return K::template Run<4>(a...);
}
#if PW_HAVE_X86_VARIANTS
template <typename K, typename... A>
PW_TARGET_AVX2 __attribute__((flatten)) auto RunAvx2(A... a) {
  return K::template Run<8>(a...);
}
template <typename K, typename... A>
PW_TARGET_AVX512 __attribute__((flatten)) auto RunAvx512(A... a) {
  return K::template Run<16>(a...);
}
#endif

// K::Run compiled for `isa` (one this CPU runs: KernelIsa() or narrower), called with a.
template <typename K, typename... A>
inline auto Dispatch([[maybe_unused]] Isa isa, A... a) {
#if PW_HAVE_X86_VARIANTS
  if (isa == Isa::kAvx512) return RunAvx512<K>(a...);
  if (isa == Isa::kAvx2) return RunAvx2<K>(a...);
#endif
  return RunBaseline<K>(a...);
}

}  // namespace pipewright::cpu::simd

#endif  // PIPEWRIGHT_KERNELS_CPU_VEC_H_
