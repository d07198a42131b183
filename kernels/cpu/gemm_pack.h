// Packing of 16-bit GEMM operands into k-pair panels, shared by the AVX-512 micro-kernels
// (gemm_bf16.cc) and the AMX one (gemm_amx.cc). Internal to kernels/cpu.
#ifndef PIPEWRIGHT_KERNELS_CPU_GEMM_PACK_H_
#define PIPEWRIGHT_KERNELS_CPU_GEMM_PACK_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/transpose.h"

#if PW_HAVE_X86_VARIANTS
#include <immintrin.h>

namespace pipewright::cpu::pack {

// A packed block of B, the columns a k block's micro-panels sweep (both blockings): half the
// 2 MiB L2.
constexpr int kPackedBBytes = 1 << 20;

// A 16-bit GEMM's operands (GemmHalfBlock's arguments).
struct Operands {
  bool is_bf16, trans_a, trans_b;
  int k;
  float alpha;
  const uint16_t* a;
  int lda;
  const uint16_t* b;
  int ldb;
  float beta;
  float* c;
  int ldc;
};

// 64-byte aligned packing scratch of the calling thread; grows, never shrinks.
struct alignas(64) Line {
  uint32_t w[16];
};
inline uint32_t* Scratch(std::vector<Line>& buf, size_t words) {
  const size_t lines = (words + 15) / 16;
  if (buf.size() < lines) buf.resize(lines);
  return buf.data()->w;
}

// The k steps of one k block as packed: kBf16Dot has one 32-bit word (k pair) per step, kFma
// two fp32 values per pair (2p + 1, then 2p).
inline int PackedSteps(HalfGemmKernel kernel, int kc) {
  const int kp = (kc + 1) / 2;
  return kernel == HalfGemmKernel::kBf16Dot ? kp : 2 * kp;
}

// 16 lanes of 16-bit values (the low halves of `x`'s 32-bit lanes) widened to fp32 bits.
PW_TARGET_AVX512 inline __m512i Widen(bool is_bf16, __m512i x) {
  if (is_bf16) return _mm512_slli_epi32(x, 16);
  return _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)));
}

// Stores the k pairs of one step p for 16 panel rows (A) or columns (B) starting at c, the lanes
// `store` selects; lane l of `pairs` holds element 2p in its low and 2p + 1 in its high half.
PW_TARGET_AVX512 inline void StorePairs(HalfGemmKernel kernel, bool is_bf16, uint32_t* panel, int R,
                                        int p, int c, __mmask16 store, __m512i pairs) {
  if (kernel == HalfGemmKernel::kBf16Dot) {
    _mm512_mask_storeu_epi32(panel + static_cast<size_t>(p) * R + c, store, pairs);
    return;
  }
  uint32_t* out = panel + static_cast<size_t>(2 * p) * R + c;  // odd k, then even k
  _mm512_mask_storeu_epi32(out, store, Widen(is_bf16, _mm512_srli_epi32(pairs, 16)));
  _mm512_mask_storeu_epi32(out + R, store, Widen(is_bf16, pairs));
}

// An operand whose k pairs are contiguous in memory (A not transposed, B transposed): `count`
// stored rows from `src` (row stride ld), k in [0, kc) from each row's start. Writes panels of R
// rows, panel q = rows [q R, q R + R), as PackedSteps(kernel, kc) steps of R values (32-bit
// words or fp32); rows past `count` are zero, and so is the partner of a trailing odd k.
template <int R>
PW_TARGET_AVX512 void PackRowPairs(HalfGemmKernel kernel, bool is_bf16, const uint16_t* src,
                                   size_t ld, int count, int kc, uint32_t* dst) {
  const int kp = (kc + 1) / 2, steps = PackedSteps(kernel, kc);
  for (int r0 = 0; r0 < count; r0 += R) {
    uint32_t* panel = dst + static_cast<size_t>(r0 / R) * steps * R;
    for (int g = 0; g < R; g += 16) {  // 16 rows x 16 pairs at a time, transposed
      const int rows = std::clamp(count - r0 - g, 0, 16);
      const __mmask16 store = static_cast<__mmask16>((1u << std::min(16, R - g)) - 1);
      const uint16_t* block = src + static_cast<size_t>(r0 + g) * ld;
      for (int p = 0; p < kp; p += 16) {
        // The 16-bit mask zeroes k past kc, the partner of an odd tail included.
        const int words = std::min(32, kc - 2 * p);
        const __mmask32 load = static_cast<__mmask32>((uint64_t{1} << words) - 1);
        __m512i x[16];
        for (int r = 0; r < 16; ++r) {
          x[r] = r < rows ? _mm512_maskz_loadu_epi16(load, block + r * ld + 2 * p)
                          : _mm512_setzero_si512();
        }
        Transpose16x16(x);
        const int pairs = std::min(16, kp - p);
        for (int q = 0; q < pairs; ++q)
          StorePairs(kernel, is_bf16, panel, R, p + q, g, store, x[q]);
      }
    }
  }
}

// An operand whose k runs down the stored rows (A transposed, B not transposed): k in [0, kc)
// is stored row k (row stride ld), columns [0, count) from `src`. Same panels as PackRowPairs.
template <int R>
PW_TARGET_AVX512 void PackColumnPairs(HalfGemmKernel kernel, bool is_bf16, const uint16_t* src,
                                      size_t ld, int count, int kc, uint32_t* dst) {
  const int kp = (kc + 1) / 2, steps = PackedSteps(kernel, kc);
  for (int c0 = 0; c0 < count; c0 += R) {
    uint32_t* panel = dst + static_cast<size_t>(c0 / R) * steps * R;
    for (int p = 0; p < kp; ++p) {
      const uint16_t* even = src + static_cast<size_t>(2 * p) * ld + c0;
      const bool has_odd = 2 * p + 1 < kc;  // else a zero partner (nothing is read)
      const uint16_t* odd = has_odd ? even + ld : even;
      for (int c = 0; c < R; c += 16) {
        const int valid = std::clamp(count - c0 - c, 0, 16);
        const __mmask16 load = static_cast<__mmask16>((1u << valid) - 1);
        const __mmask16 store = static_cast<__mmask16>((1u << std::min(16, R - c)) - 1);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(load, even + c));
        const __m512i hi =
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(has_odd ? load : __mmask16{0}, odd + c));
        StorePairs(kernel, is_bf16, panel, R, p, c, store,
                   _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
}

}  // namespace pipewright::cpu::pack

#endif  // PW_HAVE_X86_VARIANTS
#endif  // PIPEWRIGHT_KERNELS_CPU_GEMM_PACK_H_
