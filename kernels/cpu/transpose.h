// In-register transposes for the AVX-512 kernels (internal): the packing of the GEMM's panels
// (gemm_bf16.cc) and of attention's transposed heads (attention.cc).
#ifndef PIPEWRIGHT_KERNELS_CPU_TRANSPOSE_H_
#define PIPEWRIGHT_KERNELS_CPU_TRANSPOSE_H_

#include "kernels/cpu/isa.h"

#if PW_HAVE_X86_VARIANTS
// GCC 12's AVX-512 intrinsics trip -Wmaybe-uninitialized on their own `__Y = __Y` placeholder
// (GCC bug 105593, fixed in GCC 13). The warning is reported where an intrinsic is inlined, so
// a file that includes this one has it off throughout, not just around the include.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace pipewright::cpu {

// Transposes the 16 x 16 matrix of 32-bit lanes r[row] in place: 64 shuffles.
PW_TARGET_AVX512 inline void Transpose16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // lane L of t[i], t[i + 1]: rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // lane L of r[g + c]: column 4 L + c of rows g .. g + 3
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  // Column 4 L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]: a 4 x 4 transpose of
  // 128-bit lanes for each c.
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

}  // namespace pipewright::cpu

#endif  // PW_HAVE_X86_VARIANTS
#endif  // PIPEWRIGHT_KERNELS_CPU_TRANSPOSE_H_
