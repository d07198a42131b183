// dtype conversion between float32 and the 16-bit formats (bfloat16, IEEE binary16).
// All conversions round to nearest, ties to even; NaN stays NaN (quieted), Inf stays Inf.
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace pipewright::cpu {
namespace {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t ToBf16(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    // NaN: keep sign and the top payload bits, force the quiet bit so it cannot become Inf.
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest even; overflow rounds up into Inf naturally.
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float FromBf16(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

inline uint16_t ToHalf(float f) {
  const uint32_t u = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t x = u & 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {
    if (x > 0x7F800000u) {  // NaN: quiet, keep the top of the payload
      return static_cast<uint16_t>(sign | 0x7E00u | ((x >> 13) & 0x03FFu));
    }
    return static_cast<uint16_t>(sign | 0x7C00u);  // Inf
  }
  if (x >= 0x477FF000u) {  // >= 65520 rounds to Inf (65504 is the largest finite half)
    return static_cast<uint16_t>(sign | 0x7C00u);
  }
  if (x >= 0x38800000u) {  // normal half: rebias exponent 127 -> 15, round 13 mantissa bits
    const uint32_t e = x - 0x38000000u;
    const uint32_t r = (e + 0x0FFFu + ((e >> 13) & 1u)) >> 13;
    return static_cast<uint16_t>(sign | r);
  }
  if (x <= 0x33000000u) {  // <= 2^-25: rounds to (signed) zero; 2^-25 itself ties to even 0
    return sign;
  }
  // Subnormal half: value = m * 2^(E-150); unit is 2^-24, so h = m >> (126 - E).
  const uint32_t exp = x >> 23;
  const uint32_t m = (x & 0x007FFFFFu) | 0x00800000u;
  const uint32_t shift = 126u - exp;  // in [14, 24]
  uint32_t h = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (h & 1u))) ++h;  // may carry into the smallest normal
  return static_cast<uint16_t>(sign | h);
}

inline float FromHalf(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x03FFu;
  if (exp == 0x1Fu) {  // Inf / NaN
    return FromBits(sign | 0x7F800000u | (mant << 13));
  }
  if (exp == 0) {  // zero / subnormal: mant * 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return FromBits(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace

uint16_t FloatToBf16(float f) { return ToBf16(f); }
float Bf16ToFloat(uint16_t h) { return FromBf16(h); }
uint16_t FloatToHalf(float f) { return ToHalf(f); }
float HalfToFloat(uint16_t h) { return FromHalf(h); }

void FloatToBf16(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = ToBf16(in[i]);
}
void Bf16ToFloat(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FromBf16(in[i]);
}
void FloatToHalf(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = ToHalf(in[i]);
}
void HalfToFloat(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FromHalf(in[i]);
}

}  // namespace pipewright::cpu
