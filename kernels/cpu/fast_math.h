// Branch-free exp and tanh that compilers vectorise (libm's expf/tanhf are scalar calls and
// dominated the GELU and softmax loops). Each is written once as a template over the value type:
// a float (scalar code, which loops auto-vectorise) or a GCC vector of floats (vec.h, explicit
// vector code), with the same operations in the same order for both.
//
// Accuracy: the relative error of FastExp is below 2e-7 on [-87, 88]; FastTanh's absolute error
// is about 1e-7.
//
// NaN and Inf (promised, and tested): FastExp first clamps its argument to [-87, 88], so every
// non-NaN input, +-Inf included, gives a finite, normal result (FastExp(+Inf) = e^88 ~ 1.65e38,
// FastExp(-Inf) = e^-87 ~ 1.6e-38; never 0, Inf or a subnormal). NaN propagates: NaN in, NaN out.
// FastTanh(+-Inf) = +-1 and FastTanh(NaN) = NaN.
#ifndef PIPEWRIGHT_KERNELS_CPU_FAST_MATH_H_
#define PIPEWRIGHT_KERNELS_CPU_FAST_MATH_H_

#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/vec.h"

namespace pipewright::cpu {

namespace fast_exp {
constexpr float kHi = 88.0f, kLo = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo
// Cephes expf polynomial: exp(r) = 1 + r + r^2 P(r), P of degree 5.
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace fast_exp

// FastExp's algorithm on a float or, lane by lane, on a vector of floats V (vec.h): compiled for
// the same ISA (the same fused multiply-adds), each lane gets exactly the bits FastExp gives its
// value, as does a loop of FastExp that the compiler vectorises (tested). For vector loops that
// must agree with scalar ones; FastExpT<V> is the faster vector exp.
template <typename V>
__attribute__((always_inline)) inline V FastExpLanes(V x) {
  using namespace fast_exp;
  // Written as selects, not std::min/max: a NaN compares false and passes through.
  x = x > kHi ? V{} + kHi : x;
  x = x < kLo ? V{} + kLo : x;
  // Round to nearest with the 1.5 * 2^23 trick (SSE2 has no vector floor; keeps it vectorised).
  constexpr float kRound = 12582912.0f;
  const V n = (x * kLog2e + kRound) - kRound;
  // x = n ln2 + r, |r| <= ln2 / 2; exp(x) = 2^n exp(r).
  V r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  V p = V{} + kP0;  // Horner
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  p = p * r * r + r + 1.0f;
  if constexpr (std::is_same_v<V, float>) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    return p * std::bit_cast<float>(bits);
  } else {
    using I = decltype(x < x);  // the vector of 32-bit integers with V's lanes
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    V scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
  }
}

// e^x for a float or a vector of floats V (vec.h). The vector version uses the ISA's min/max,
// rounding and 2^n scaling (Note [Per-ISA vector operations] in vec.h) and Estrin's scheme: the
// same function, the last bits may differ from the scalar one (FastExpLanes keeps them).
template <typename V>
__attribute__((always_inline)) inline V FastExpT(V x) {
  if constexpr (std::is_same_v<V, float>) {
    return FastExpLanes(x);
  } else {
    using namespace fast_exp;
    x = simd::MinOrNaN(V{} + kHi, x);
    x = simd::MaxOrNaN(V{} + kLo, x);
    const V n = simd::RoundToInt(x * kLog2e);
    V r = x - n * kLn2Hi;
    r = r - n * kLn2Lo;
    // Estrin's scheme: as many operations as Horner's, half the dependency chain (the vector
    // loops are latency-bound).
    const V r2 = r * r;
    const V lo = kP4 * r + kP5, mid = kP2 * r + kP3, hi = kP0 * r + kP1;
    const V p = (hi * r2 + mid) * r2 + lo;
    return simd::TimesPow2(p * r2 + r + 1.0f, n);
  }
}

// tanh(u) = 1 - 2 / (exp(2u) + 1).
template <typename V>
__attribute__((always_inline)) inline V FastTanhT(V u) {
  return 1.0f - 2.0f / (FastExpT(2.0f * u) + 1.0f);
}

__attribute__((always_inline)) inline float FastExp(float x) { return FastExpT(x); }
inline float FastTanh(float u) { return FastTanhT(u); }

}  // namespace pipewright::cpu

#endif  // PIPEWRIGHT_KERNELS_CPU_FAST_MATH_H_
