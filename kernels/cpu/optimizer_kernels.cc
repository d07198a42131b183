// Optimizer updates (AdamW, SGD with momentum) and gradient reductions, compiled for AVX-512,
// AVX2 and the baseline (vec.h).
//
// The updates are plain loops that GCC vectorises for each variant (the build's
// -fno-math-errno lets it use vector square roots); an element's arithmetic is the same in the
// vector loop and its scalar remainder (the same operations, each correctly rounded or fused the
// same way), so it does not depend on where a range starts. SumSquares sums in W double lanes.
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu {
namespace {

struct AdamWKernel {
  template <int W>
  PW_KERNEL_BODY void Run(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                          float beta1, float beta2, float eps, float weight_decay, float inv_bc1,
                          float inv_bc2, float grad_scale) {
    const float one_minus_b1 = 1.0f - beta1, one_minus_b2 = 1.0f - beta2;
    for (size_t i = 0; i < n; ++i) {
      const float g = grad[i] * grad_scale;  // exact when grad_scale == 1
      const float mi = beta1 * m[i] + one_minus_b1 * g;
      const float vi = beta2 * v[i] + one_minus_b2 * g * g;
      m[i] = mi;
      v[i] = vi;
      const float mhat = mi * inv_bc1;
      const float vhat = vi * inv_bc2;
      param[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + weight_decay * param[i]);
    }
  }
};

struct SgdMomentumKernel {
  template <int W>
  PW_KERNEL_BODY void Run(float* param, const float* grad, float* buf, size_t n, float lr,
                          float momentum, float weight_decay) {
    for (size_t i = 0; i < n; ++i) {
      const float g = grad[i] + weight_decay * param[i];
      const float b = momentum * buf[i] + g;
      buf[i] = b;
      param[i] -= lr * b;
    }
  }
};

struct SumSquaresKernel {
  template <int W>
  PW_KERNEL_BODY double Run(const float* x, size_t n) {
    typename simd::Vec<W>::D s[2] = {}, lo, hi;
    simd::ForEach<W>(n, [&](size_t i, int k) PW_LAMBDA {
      simd::Widen<W>(simd::LoadN<W>(x + i, k), &lo, &hi);
      s[0] += lo * lo;
      s[1] += hi * hi;
    });
    return simd::ReduceAdd<W>(s[0] + s[1]);
  }
};

struct AllFiniteKernel {
  template <int W>
  PW_KERNEL_BODY bool Run(const float* x, size_t n) {
    // Bit test on the exponent (all ones = Inf/NaN); immune to -ffast-math and vectorizable.
    uint32_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, sizeof(u));
      bad |= static_cast<uint32_t>((u & 0x7F800000u) == 0x7F800000u);
    }
    return bad == 0;
  }
};

}  // namespace

void AdamWUpdate(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                 float beta1, float beta2, float eps, float weight_decay, int64_t t,
                 float grad_scale, Isa isa) {
  const double td = static_cast<double>(t);
  const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(beta1), td)));
  const float inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(beta2), td)));
  simd::Dispatch<AdamWKernel>(isa, param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay,
                              inv_bc1, inv_bc2, grad_scale);
}

void SgdMomentumUpdate(float* param, const float* grad, float* buf, size_t n, float lr,
                       float momentum, float weight_decay, Isa isa) {
  simd::Dispatch<SgdMomentumKernel>(isa, param, grad, buf, n, lr, momentum, weight_decay);
}

double SumSquares(const float* x, size_t n, Isa isa) {
  return simd::Dispatch<SumSquaresKernel>(isa, x, n);
}

bool AllFinite(const float* x, size_t n, Isa isa) {
  return simd::Dispatch<AllFiniteKernel>(isa, x, n);
}

}  // namespace pipewright::cpu
