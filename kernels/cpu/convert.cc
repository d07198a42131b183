// dtype conversion between float32 and the 16-bit formats (bfloat16, IEEE binary16).
// All conversions round to nearest, ties to even; NaN stays NaN (quieted when narrowing, with the
// top of its payload), Inf stays Inf; subnormals of either format convert exactly.
//
// Every conversion is branch-free integer arithmetic plus selects (the f32 -> f16 subnormal case
// rounds with one float addition, see ToHalf), so the array loops vectorise for each variant of
// vec.h's Dispatch and every variant computes the same bits as the scalar functions. (The
// hardware conversions are not used: vcvtneps2bf16 flushes subnormals to zero, and vcvtph2ps
// quiets signalling NaNs, which would break the exact round trip of every 16-bit pattern.)
#include <bit>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu {
namespace {

PW_KERNEL_BODY uint16_t ToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  // NaN: keep sign and the top payload bits, force the quiet bit so it cannot become Inf.
  const uint32_t nan = (u >> 16) | 0x0040u;
  // Round to nearest even; overflow rounds up into Inf naturally.
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

PW_KERNEL_BODY float FromBf16(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

PW_KERNEL_BODY uint16_t ToHalf(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t x = u & 0x7FFFFFFFu;
  // |f| >= 65536, Inf, NaN (65520 <= |f| < 65536 rounds to Inf in the normal case below).
  const uint32_t nan = 0x7E00u | ((x >> 13) & 0x03FFu);  // quiet, the top of the payload
  const uint32_t big = x > 0x7F800000u ? nan : 0x7C00u;
  // Normal half (|f| >= 2^-14): rebias the exponent 127 -> 15, round 13 mantissa bits to even.
  const uint32_t normal = (x - 0x38000000u + 0x0FFFu + ((x >> 13) & 1u)) >> 13;
  // Subnormal half or zero (|f| < 2^-14): adding 0.5 puts the unit 2^-24 in the last mantissa
  // bit, so the FPU's round-to-nearest-even does the rounding (may carry into the smallest normal).
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(x) + 0.5f) - 0x3F000000u;
  const uint32_t h = x >= 0x47800000u ? big : x >= 0x38800000u ? normal : sub;
  return static_cast<uint16_t>(sign | h);
}

PW_KERNEL_BODY float FromHalf(uint16_t h) {
  constexpr uint32_t kExp = 0x0F800000u;  // the half exponent field, shifted into place
  uint32_t o = static_cast<uint32_t>(h & 0x7FFFu) << 13;
  const uint32_t exp = o & kExp;
  o += 0x38000000u;  // rebias 15 -> 127
  // Inf / NaN: exponent all ones (the payload is kept as is). Zero / subnormal: mant * 2^-24,
  // exact, as (2^-14 + mant * 2^-24) - 2^-14.
  const uint32_t special = o + 0x38000000u;
  const uint32_t tiny = std::bit_cast<uint32_t>(std::bit_cast<float>(o + 0x00800000u) -
                                                std::bit_cast<float>(0x38800000u));
  o = exp == kExp ? special : exp == 0 ? tiny : o;
  return std::bit_cast<float>(o | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

// out[i] = kConvert(in[i]): a plain loop that GCC vectorises for each variant (W unused).
template <auto kConvert, typename In, typename Out>
struct ConvertKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const In* in, Out* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = kConvert(in[i]);
  }
};

}  // namespace

uint16_t FloatToBf16(float f) { return ToBf16(f); }
float Bf16ToFloat(uint16_t h) { return FromBf16(h); }
uint16_t FloatToHalf(float f) { return ToHalf(f); }
float HalfToFloat(uint16_t h) { return FromHalf(h); }

void FloatToBf16(const float* in, uint16_t* out, size_t n, Isa isa) {
  simd::Dispatch<ConvertKernel<ToBf16, float, uint16_t>>(isa, in, out, n);
}
void Bf16ToFloat(const uint16_t* in, float* out, size_t n, Isa isa) {
  simd::Dispatch<ConvertKernel<FromBf16, uint16_t, float>>(isa, in, out, n);
}
void FloatToHalf(const float* in, uint16_t* out, size_t n, Isa isa) {
  simd::Dispatch<ConvertKernel<ToHalf, float, uint16_t>>(isa, in, out, n);
}
void HalfToFloat(const uint16_t* in, float* out, size_t n, Isa isa) {
  simd::Dispatch<ConvertKernel<FromHalf, uint16_t, float>>(isa, in, out, n);
}

}  // namespace pipewright::cpu
