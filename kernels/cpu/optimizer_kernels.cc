// Optimizer updates (AdamW, SGD with momentum) and gradient reductions.
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace pipewright::cpu {

void AdamWUpdate(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                 float beta1, float beta2, float eps, float weight_decay, int64_t t) {
  const double td = static_cast<double>(t);
  const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(beta1), td)));
  const float inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(beta2), td)));
  const float one_minus_b1 = 1.0f - beta1, one_minus_b2 = 1.0f - beta2;
  for (size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float mi = beta1 * m[i] + one_minus_b1 * g;
    const float vi = beta2 * v[i] + one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi * inv_bc1;
    const float vhat = vi * inv_bc2;
    param[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + weight_decay * param[i]);
  }
}

void SgdMomentumUpdate(float* param, const float* grad, float* buf, size_t n, float lr,
                       float momentum, float weight_decay) {
  for (size_t i = 0; i < n; ++i) {
    const float g = grad[i] + weight_decay * param[i];
    const float b = momentum * buf[i] + g;
    buf[i] = b;
    param[i] -= lr * b;
  }
}

double SumSquares(const float* x, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = x[i];
    s += d * d;
  }
  return s;
}

bool AllFinite(const float* x, size_t n) {
  // Bit test on the exponent (all ones = Inf/NaN); immune to -ffast-math and vectorizable.
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof(u));
    bad |= static_cast<uint32_t>((u & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}

}  // namespace pipewright::cpu
