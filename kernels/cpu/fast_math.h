// Branch-free exp and tanh that compilers vectorise (libm's expf/tanhf are scalar calls and
// dominated the GELU and softmax loops). Relative error of FastExp is below 2e-7 on [-87, 88];
// inputs are clamped to that range, so no NaN/Inf is produced for finite inputs.
#ifndef PIPEWRIGHT_KERNELS_CPU_FAST_MATH_H_
#define PIPEWRIGHT_KERNELS_CPU_FAST_MATH_H_

#include <algorithm>
#include <bit>
#include <cstdint>

namespace pipewright::cpu {

__attribute__((always_inline)) inline float FastExp(float x) {
  x = x > 88.0f ? 88.0f : x;
  x = x < -87.0f ? -87.0f : x;
  // x = n ln2 + r, |r| <= ln2 / 2; exp(x) = 2^n exp(r).
  // Round to nearest with the 1.5 * 2^23 trick (SSE2 has no vector floor; keeps it vectorised).
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // Cephes expf polynomial.
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// tanh(u) = 1 - 2 / (exp(2u) + 1); absolute error ~1e-7.
inline float FastTanh(float u) { return 1.0f - 2.0f / (FastExp(2.0f * u) + 1.0f); }

}  // namespace pipewright::cpu

#endif  // PIPEWRIGHT_KERNELS_CPU_FAST_MATH_H_
