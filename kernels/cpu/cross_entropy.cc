// Fused softmax + cross-entropy, stable: max-subtracted exponentials (FastExp), their sum in
// double, log-sum-exp in double. One body over Vec<W> (vec.h) per kernel, compiled for AVX-512,
// AVX2 and the baseline; every row is computed on its own (rows may be split across threads).
//
// FastExp never returns 0 (fast_math.h), so a logit more than 87 below the row's maximum (or
// -Inf) gets probability ~1.6e-38 / sum instead of an exact 0; the loss and the gradient are
// unchanged at float precision.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu {
namespace {

using simd::ForEach;
using simd::KeepFirst;
using simd::LoadN;
using simd::ReduceAdd;
using simd::StoreN;
using simd::Vec;
using simd::Widen;

// sum_j exp(row[j] - mx), the exponentials also stored in out when it is not null.
template <int W>
PW_KERNEL_BODY double SumExp(const float* row, int vocab, float mx, float* out) {
  typename Vec<W>::D sum[2] = {}, lo, hi;
  ForEach<W>(vocab, [&](size_t j, int k) PW_LAMBDA {
    const typename Vec<W>::F e = KeepFirst<W>(FastExpT(LoadN<W>(row + j, k) - mx), k);
    if (out != nullptr) StoreN<W>(out + j, e, k);
    Widen<W>(e, &lo, &hi);
    sum[0] += lo;
    sum[1] += hi;
  });
  return ReduceAdd<W>(sum[0] + sum[1]);
}

struct ForwardKernel {
  template <int W>
  PW_KERNEL_BODY double Run(const float* logits, const int32_t* targets, int rows, int vocab,
                            int64_t* count) {
    double total = 0.0;
    int64_t n = 0;
    for (int r = 0; r < rows; ++r) {
      const int32_t t = targets[r];
      if (t < 0) continue;
      const float* row = logits + static_cast<size_t>(r) * vocab;
      const float mx = simd::Max<W>(row, vocab);
      const double lse = std::log(SumExp<W>(row, vocab, mx, nullptr)) + static_cast<double>(mx);
      total += lse - static_cast<double>(row[t]);
      ++n;
    }
    if (count != nullptr) *count = n;
    return total;
  }
};

struct BackwardKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* logits, const int32_t* targets, int rows, int vocab,
                          float scale, float* dlogits) {
    for (int r = 0; r < rows; ++r) {
      const int32_t t = targets[r];
      const float* row = logits + static_cast<size_t>(r) * vocab;
      float* drow = dlogits + static_cast<size_t>(r) * vocab;
      if (t < 0) {
        for (int j = 0; j < vocab; ++j) drow[j] = 0.0f;
        continue;
      }
      const float mx = simd::Max<W>(row, vocab);
      const float k = static_cast<float>(scale / SumExp<W>(row, vocab, mx, drow));
      ForEach<W>(vocab, [&](size_t j, int n)
                            PW_LAMBDA { StoreN<W>(drow + j, LoadN<W>(drow + j, n) * k, n); });
      drow[t] -= scale;
    }
  }
};

}  // namespace

double SoftmaxCrossEntropyForward(const float* logits, const int32_t* targets, int rows, int vocab,
                                  int64_t* count, Isa isa) {
  return simd::Dispatch<ForwardKernel>(isa, logits, targets, rows, vocab, count);
}

void SoftmaxCrossEntropyBackward(const float* logits, const int32_t* targets, int rows, int vocab,
                                 float scale, float* dlogits, Isa isa) {
  simd::Dispatch<BackwardKernel>(isa, logits, targets, rows, vocab, scale, dlogits);
}

}  // namespace pipewright::cpu
