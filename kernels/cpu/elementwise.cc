// Elementwise kernels: bias, add, scale, GELU (tanh approximation) and the fused bias + GELU.
// Every kernel is one body over Vec<W> (vec.h), compiled for AVX-512, AVX2 and the baseline.
// GELU is compute-bound (4-6x faster on AVX-512 than SSE2); the bias, add and scale kernels are
// memory-bound at the model's sizes, so their variants run at about the same speed: they exist
// because one body costs nothing more and a process then runs one ISA throughout.
//
// Note [GELU as a sigmoid]
// 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)) = s, so GELU(x) = x s and
// GELU'(x) = s + x s (1 - s) 2 u'(x), with u = sqrt(2/pi) (x + 0.044715 x^3): one exponential and
// one division per element, and no cancellation in 1 + tanh u for negative x. u is clamped below
// at -40 so that s >= e^-80 stays a normal float (subnormal arithmetic is ~100x slower on x86);
// the results this changes are below 1e-28 in absolute value. GELU(+Inf) = +Inf,
// GELU(-Inf) = -Inf (x s with s ~ e^-80) and NaN stays NaN.
//
// Column sums (BiasBackward, the fused backward's bias gradient) add each row onto the running
// value in row order, as the scalar loop `dbias[c] += dy[r, c]` does: additions only, so every
// ISA computes the same bits.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu {
namespace {

using gelu::Gelu;
using gelu::GeluGrad;
using simd::ColumnBlocks;
using simd::ForEach;
using simd::LoadN;
using simd::StoreN;
using simd::Vec;

struct BiasAddKernel {
  template <int W>
  PW_KERNEL_BODY void Run(float* y, const float* bias, int rows, int cols) {
    for (int r = 0; r < rows; ++r) {
      float* row = y + static_cast<size_t>(r) * cols;
      ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA {
        StoreN<W>(row + c, LoadN<W>(row + c, k) + LoadN<W>(bias + c, k), k);
      });
    }
  }
};

struct BiasBackwardKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* dy, int ld, float* dbias, int rows, int cols) {
    ColumnBlocks<W>(rows, cols, [&](int r0, int r1, size_t c, int k) PW_LAMBDA {
      typename Vec<W>::F acc = LoadN<W>(dbias + c, k);
      for (int r = r0; r < r1; ++r) acc += LoadN<W>(dy + static_cast<size_t>(r) * ld + c, k);
      StoreN<W>(dbias + c, acc, k);
    });
  }
};

struct AddKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* a, const float* b, float* out, size_t n) {
    ForEach<W>(n, [&](size_t i, int k) PW_LAMBDA {
      StoreN<W>(out + i, LoadN<W>(a + i, k) + LoadN<W>(b + i, k), k);
    });
  }
};

struct ScaleKernel {
  template <int W>
  PW_KERNEL_BODY void Run(float* x, size_t n, float s) {
    ForEach<W>(n, [&](size_t i, int k) PW_LAMBDA { StoreN<W>(x + i, LoadN<W>(x + i, k) * s, k); });
  }
};

struct GeluForwardKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* x, float* y, size_t n) {
    ForEach<W>(n,
               [&](size_t i, int k) PW_LAMBDA { StoreN<W>(y + i, Gelu(LoadN<W>(x + i, k)), k); });
  }
};

struct GeluBackwardKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* x, const float* dy, float* dx, size_t n) {
    ForEach<W>(n, [&](size_t i, int k) PW_LAMBDA {
      StoreN<W>(dx + i, LoadN<W>(dy + i, k) * GeluGrad(LoadN<W>(x + i, k)), k);
    });
  }
};

struct BiasGeluForwardKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* x, const float* bias, float* pre, float* y, int rows,
                          int cols) {
    for (int r = 0; r < rows; ++r) {
      const size_t off = static_cast<size_t>(r) * cols;
      ForEach<W>(cols, [&](size_t c, int k) PW_LAMBDA {
        const typename Vec<W>::F v = LoadN<W>(x + off + c, k) + LoadN<W>(bias + c, k);
        if (pre != nullptr) StoreN<W>(pre + off + c, v, k);
        StoreN<W>(y + off + c, Gelu(v), k);
      });
    }
  }
};

struct BiasGeluBackwardKernel {
  template <int W>
  PW_KERNEL_BODY void Run(const float* pre, const float* dy, float* dpre, float* dbias, int rows,
                          int cols, int ld) {
    // One row at a time: the GELU work dominates, and walking four rows at once was ~10% slower
    // than one (and than GeluBackward then BiasBackward) at [1024, 1024].
    ColumnBlocks<W, 1>(rows, cols, [&](int r0, int r1, size_t c, int k) PW_LAMBDA {
      typename Vec<W>::F acc = LoadN<W>(dbias + c, k);
      for (int r = r0; r < r1; ++r) {
        const size_t i = static_cast<size_t>(r) * ld + c;
        const typename Vec<W>::F d = LoadN<W>(dy + i, k) * GeluGrad(LoadN<W>(pre + i, k));
        StoreN<W>(dpre + i, d, k);
        acc += d;
      }
      StoreN<W>(dbias + c, acc, k);
    });
  }
};

}  // namespace

void BiasAdd(float* y, const float* bias, int rows, int cols, Isa isa) {
  simd::Dispatch<BiasAddKernel>(isa, y, bias, rows, cols);
}

void BiasBackward(const float* dy, float* dbias, int rows, int cols, Isa isa) {
  simd::Dispatch<BiasBackwardKernel>(isa, dy, cols, dbias, rows, cols);
}

void BiasBackward(const float* dy, int ld, float* dbias, int rows, int cols, Isa isa) {
  simd::Dispatch<BiasBackwardKernel>(isa, dy, ld, dbias, rows, cols);
}

void Add(const float* a, const float* b, float* out, size_t n, Isa isa) {
  simd::Dispatch<AddKernel>(isa, a, b, out, n);
}

void AddInPlace(float* y, const float* x, size_t n, Isa isa) {
  simd::Dispatch<AddKernel>(isa, static_cast<const float*>(y), x, y, n);
}

void Scale(float* x, size_t n, float s, Isa isa) { simd::Dispatch<ScaleKernel>(isa, x, n, s); }

void GeluForward(const float* x, float* y, size_t n, Isa isa) {
  simd::Dispatch<GeluForwardKernel>(isa, x, y, n);
}

void GeluBackward(const float* x, const float* dy, float* dx, size_t n, Isa isa) {
  simd::Dispatch<GeluBackwardKernel>(isa, x, dy, dx, n);
}

void BiasGeluForward(const float* x, const float* bias, float* pre, float* y, int rows, int cols,
                     Isa isa) {
  simd::Dispatch<BiasGeluForwardKernel>(isa, x, bias, pre, y, rows, cols);
}

void BiasGeluBackward(const float* pre, const float* dy, float* dpre, float* dbias, int rows,
                      int cols, Isa isa) {
  simd::Dispatch<BiasGeluBackwardKernel>(isa, pre, dy, dpre, dbias, rows, cols, cols);
}

void BiasGeluBackward(const float* pre, const float* dy, float* dpre, float* dbias, int rows,
                      int cols, int ld, Isa isa) {
  simd::Dispatch<BiasGeluBackwardKernel>(isa, pre, dy, dpre, dbias, rows, cols, ld);
}

}  // namespace pipewright::cpu
