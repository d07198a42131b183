// LayerNorm over the last dimension, with saved mean / rstd for backward. One body over Vec<W>
// (vec.h) per kernel, compiled for AVX-512, AVX2 and the baseline.
//
// The forward keeps the two-pass statistics in double (no cancellation for rows with a large
// mean), now as W-lane vector partial sums combined in a fixed tree order. The input backward
// sums its two row reductions in W float lanes. The weight backward adds each row onto dgamma
// and dbeta in row order (columns may be split across threads).
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu {
namespace {

using simd::ColumnBlocks;
using simd::ForEach;
using simd::LoadN;
using simd::ReduceAdd;
using simd::StoreN;
using simd::Vec;
using simd::Widen;

struct LayerNormForwardKernel {
  // One row: y, and its mean and rstd.
  template <int W>
  PW_KERNEL_BODY void Row(const float* x, const float* gamma, const float* beta, float* y,
                          float* mean, float* rstd, int cols, float eps) {
    using F = typename Vec<W>::F;
    using D = typename Vec<W>::D;
    const double inv_n = 1.0 / cols;
    D sum[2] = {}, lo, hi;
    ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA {
      Widen<W>(LoadN<W>(x + c, k), &lo, &hi);
      sum[0] += lo;
      sum[1] += hi;
    });
    const float mu = static_cast<float>(ReduceAdd<W>(sum[0] + sum[1]) * inv_n);
    const double mu_d = mu;
    D sq[2] = {};
    ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA {
      Widen<W>(LoadN<W>(x + c, k, mu), &lo, &hi);  // padded with mu: d = 0
      sq[0] += (lo - mu_d) * (lo - mu_d);
      sq[1] += (hi - mu_d) * (hi - mu_d);
    });
    const float rs = static_cast<float>(1.0 / std::sqrt(ReduceAdd<W>(sq[0] + sq[1]) * inv_n + eps));
    ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA {
      const F xhat = (LoadN<W>(x + c, k) - mu) * rs;
      StoreN<W>(y + c, xhat * LoadN<W>(gamma + c, k) + LoadN<W>(beta + c, k), k);
    });
    *mean = mu;
    *rstd = rs;
  }

  template <int W>
  PW_KERNEL_BODY void Run(const float* x, const float* gamma, const float* beta, float* y,
                          float* mean, float* rstd, int rows, int cols, float eps) {
    for (int r = 0; r < rows; ++r) {
      const size_t off = static_cast<size_t>(r) * cols;
      Row<W>(x + off, gamma, beta, y + off, mean + r, rstd + r, cols, eps);
    }
  }
};

struct LayerNormBackwardInputKernel {
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, for one row.
  template <int W>
  PW_KERNEL_BODY void Row(const float* x, const float* gamma, float mu, float rs, const float* dy,
                          float* dx, int cols) {
    using F = typename Vec<W>::F;
    F sum_g{}, sum_gx{};
    ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA {
      const F g = LoadN<W>(dy + c, k) * LoadN<W>(gamma + c, k);  // pad: g = 0
      const F xhat = (LoadN<W>(x + c, k) - mu) * rs;
      sum_g += g;
      sum_gx += g * xhat;
    });
    const float inv_n = 1.0f / static_cast<float>(cols);
    const float mean_g = ReduceAdd<W>(sum_g) * inv_n, mean_gx = ReduceAdd<W>(sum_gx) * inv_n;
    ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA {
      const F g = LoadN<W>(dy + c, k) * LoadN<W>(gamma + c, k);
      const F xhat = (LoadN<W>(x + c, k) - mu) * rs;
      StoreN<W>(dx + c, rs * (g - mean_g - xhat * mean_gx), k);
    });
  }

  template <int W>
  PW_KERNEL_BODY void Run(const float* x, const float* gamma, const float* mean, const float* rstd,
                          const float* dy, float* dx, int rows, int cols) {
    for (int r = 0; r < rows; ++r) {
      const size_t off = static_cast<size_t>(r) * cols;
      Row<W>(x + off, gamma, mean[r], rstd[r], dy + off, dx + off, cols);
    }
  }
};

struct LayerNormBackwardWeightKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* x, const float* mean, const float* rstd, const float* dy,
                          int ld, float* dgamma, float* dbeta, int rows, int cols) {
    using F = typename Vec<W>::F;
    ColumnBlocks<W>(rows, cols, [&](int r0, int r1, size_t c, int k) PW_LAMBDA {
      F acc_g = LoadN<W>(dgamma + c, k), acc_b = LoadN<W>(dbeta + c, k);
      for (int r = r0; r < r1; ++r) {
        const size_t i = static_cast<size_t>(r) * ld + c;
        const F d = LoadN<W>(dy + i, k);
        acc_g += d * ((LoadN<W>(x + i, k) - mean[r]) * rstd[r]);
        acc_b += d;
      }
      StoreN<W>(dgamma + c, acc_g, k);
      StoreN<W>(dbeta + c, acc_b, k);
    });
  }
};

}  // namespace

void LayerNormForward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                      float* rstd, int rows, int cols, float eps, Isa isa) {
  simd::Dispatch<LayerNormForwardKernel>(isa, x, gamma, beta, y, mean, rstd, rows, cols, eps);
}

void LayerNormBackwardInput(const float* x, const float* gamma, const float* mean,
                            const float* rstd, const float* dy, float* dx, int rows, int cols,
                            Isa isa) {
  simd::Dispatch<LayerNormBackwardInputKernel>(isa, x, gamma, mean, rstd, dy, dx, rows, cols);
}

void LayerNormBackwardWeight(const float* x, const float* mean, const float* rstd, const float* dy,
                             float* dgamma, float* dbeta, int rows, int cols, Isa isa) {
  simd::Dispatch<LayerNormBackwardWeightKernel>(isa, x, mean, rstd, dy, cols, dgamma, dbeta, rows,
                                                cols);
}

void LayerNormBackwardWeight(const float* x, const float* mean, const float* rstd, const float* dy,
                             int ld, float* dgamma, float* dbeta, int rows, int cols, Isa isa) {
  simd::Dispatch<LayerNormBackwardWeightKernel>(isa, x, mean, rstd, dy, ld, dgamma, dbeta, rows,
                                                cols);
}

}  // namespace pipewright::cpu
