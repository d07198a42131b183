// GELU (tanh approximation) as one body over a float vector type V (vec.h), shared by the
// elementwise kernels (elementwise.cc) and the fp32 GEMM's fused epilogue (gemm_bf16.cc), so
// that both compute the same bits: Note [GELU as a sigmoid] in elementwise.cc.
#ifndef PIPEWRIGHT_KERNELS_CPU_GELU_H_
#define PIPEWRIGHT_KERNELS_CPU_GELU_H_

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu::gelu {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// s = 0.5 (1 + tanh u(x)) and, when du is not null, *du = u'(x) (Note [GELU as a sigmoid]).
template <typename V>
PW_KERNEL_BODY V GeluSigmoid(V x, V* du) {
  const V x2 = x * x;
  const V u = simd::MaxOrNaN(V{} + -40.0f, kSqrt2OverPi * x * (1.0f + kGeluCoeff * x2));
  if (du != nullptr) *du = kSqrt2OverPi * (1.0f + (3.0f * kGeluCoeff) * x2);
  return 1.0f / (1.0f + FastExpT(-2.0f * u));
}

template <typename V>
PW_KERNEL_BODY V Gelu(V x) {
  return x * GeluSigmoid<V>(x, nullptr);
}

template <typename V>
PW_KERNEL_BODY V GeluGrad(V x) {
  V du;
  const V s = GeluSigmoid(x, &du);
  return s + (2.0f * x) * (s * (1.0f - s)) * du;
}

}  // namespace pipewright::cpu::gelu

#endif  // PIPEWRIGHT_KERNELS_CPU_GELU_H_
