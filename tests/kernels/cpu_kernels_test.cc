// Tests for the CPU reference kernels (kernels/cpu/cpu_kernels.h).
// Gradients are checked against central differences of double-precision re-implementations.
#include "kernels/cpu/cpu_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace pipewright::cpu {
namespace {

using kernel_test::RandomVec;

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Central-difference gradient of f at x (double precision).
std::vector<double> NumericGrad(const std::function<double(const std::vector<double>&)>& f,
                                std::vector<double> x, double eps = 1e-5) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double fp = f(x);
    x[i] = saved - eps;
    const double fm = f(x);
    x[i] = saved;
    g[i] = (fp - fm) / (2 * eps);
  }
  return g;
}

void ExpectClose(const std::vector<float>& got, const std::vector<double>& want, double rtol,
                 double atol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], atol + rtol * std::fabs(want[i])) << what << " at " << i;
  }
}

// ---------------------------------------------------------------- GEMM

// Naive double reference on the stored (possibly strided / transposed) matrices.
void NaiveGemm(bool ta, bool tb, int m, int n, int k, double alpha, const std::vector<float>& a,
               int lda, const std::vector<float>& b, int ldb, double beta, std::vector<double>& c,
               int ldc) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int p = 0; p < k; ++p) {
        const double av =
            ta ? a[static_cast<size_t>(p) * lda + i] : a[static_cast<size_t>(i) * lda + p];
        const double bv =
            tb ? b[static_cast<size_t>(j) * ldb + p] : b[static_cast<size_t>(p) * ldb + j];
        s += av * bv;
      }
      double& cv = c[static_cast<size_t>(i) * ldc + j];
      cv = alpha * s + beta * cv;
    }
  }
}

struct GemmShape {
  int m, n, k, pad;  // pad: extra columns in every leading dimension
  float alpha, beta;
};

TEST(Gemm, AllTransposeCombosMatchNaive) {
  const GemmShape shapes[] = {
      {1, 1, 1, 0, 1.0f, 0.0f},    {1, 7, 5, 0, 1.0f, 0.0f},     {6, 1, 4, 0, 1.0f, 0.0f},
      {5, 3, 1, 0, 1.0f, 0.0f},    {13, 9, 17, 3, 0.5f, 0.0f},   {8, 8, 8, 0, 1.0f, 1.0f},
      {7, 11, 5, 2, -1.5f, 0.75f}, {33, 65, 47, 5, 1.0f, -2.0f},
  };
  uint32_t seed = 1;
  for (const auto& s : shapes) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        const int a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
        const int b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
        const int lda = a_cols + s.pad, ldb = b_cols + s.pad, ldc = s.n + s.pad;
        auto a = RandomVec(static_cast<size_t>(a_rows) * lda, seed++);
        auto b = RandomVec(static_cast<size_t>(b_rows) * ldb, seed++);
        auto c = RandomVec(static_cast<size_t>(s.m) * ldc, seed++);
        std::vector<double> want = ToDouble(c);
        NaiveGemm(ta, tb, s.m, s.n, s.k, s.alpha, a, lda, b, ldb, s.beta, want, ldc);
        Gemm(ta, tb, s.m, s.n, s.k, s.alpha, a.data(), lda, b.data(), ldb, s.beta, c.data(), ldc);
        for (int i = 0; i < s.m; ++i) {
          for (int j = 0; j < ldc; ++j) {
            const size_t idx = static_cast<size_t>(i) * ldc + j;
            // Padding columns of C must be left untouched (want holds the original there).
            EXPECT_NEAR(c[idx], want[idx], 1e-4 * (1 + std::fabs(want[idx])))
                << "m=" << s.m << " n=" << s.n << " k=" << s.k << " ta=" << ta << " tb=" << tb
                << " at (" << i << "," << j << ")";
          }
        }
      }
    }
  }
}

TEST(Gemm, BetaZeroOverwritesGarbageAndKZeroScales) {
  const int m = 3, n = 4, k = 2;
  auto a = RandomVec(m * k, 7), b = RandomVec(k * n, 8);
  std::vector<float> c(m * n, std::numeric_limits<float>::quiet_NaN());
  Gemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  EXPECT_TRUE(AllFinite(c.data(), c.size()));
  std::vector<float> d(m * n, 2.0f);
  Gemm(false, false, m, n, 0, 1.0f, a.data(), 1, b.data(), n, 0.5f, d.data(), n);
  for (float v : d) EXPECT_FLOAT_EQ(v, 1.0f);
}

void CheckGemmHalf(bool is_bf16) {
  const int m = 19, n = 23, k = 37;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      const int a_rows = ta ? k : m, a_cols = ta ? m : k;
      const int b_rows = tb ? n : k, b_cols = tb ? k : n;
      const int lda = a_cols + 1, ldb = b_cols + 2;
      auto a = RandomVec(static_cast<size_t>(a_rows) * lda, 100 + ta * 2 + tb);
      auto b = RandomVec(static_cast<size_t>(b_rows) * ldb, 200 + ta * 2 + tb);
      std::vector<uint16_t> a16(a.size()), b16(b.size());
      std::vector<float> ar(a.size()), br(b.size());  // the 16-bit values widened back
      if (is_bf16) {
        FloatToBf16(a.data(), a16.data(), a.size());
        FloatToBf16(b.data(), b16.data(), b.size());
        Bf16ToFloat(a16.data(), ar.data(), a.size());
        Bf16ToFloat(b16.data(), br.data(), b.size());
      } else {
        FloatToHalf(a.data(), a16.data(), a.size());
        FloatToHalf(b.data(), b16.data(), b.size());
        HalfToFloat(a16.data(), ar.data(), a.size());
        HalfToFloat(b16.data(), br.data(), b.size());
      }
      auto c = RandomVec(static_cast<size_t>(m) * n, 300);
      std::vector<double> exact = ToDouble(c), full = ToDouble(c);
      NaiveGemm(ta, tb, m, n, k, 1.0, ar, lda, br, ldb, 0.5, exact, n);
      NaiveGemm(ta, tb, m, n, k, 1.0, a, lda, b, ldb, 0.5, full, n);
      GemmHalf(is_bf16, ta, tb, m, n, k, 1.0f, a16.data(), lda, b16.data(), ldb, 0.5f, c.data(), n);
      // Against the rounded inputs: f32 accumulation accuracy.
      ExpectClose(c, exact, 1e-5, 1e-5, "vs rounded inputs");
      // Against the unrounded f32 inputs: dtype-level accuracy (8 vs 11 significand bits).
      const double tol = is_bf16 ? 0.1 : 0.015;
      ExpectClose(c, full, 0.0, tol, "vs f32 inputs");
    }
  }
}

TEST(GemmHalf, Bf16MatchesF32) { CheckGemmHalf(true); }
TEST(GemmHalf, F16MatchesF32) { CheckGemmHalf(false); }

// ---------------------------------------------------------------- conversion

TEST(Convert, Bf16KnownValues) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(-2.5f), 0xC020);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lives only in the low 16 bits must not truncate to Inf.
  uint32_t nan_bits = 0x7F800001u;
  float low_nan;
  std::memcpy(&low_nan, &nan_bits, 4);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(low_nan))));
  // Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);
  // Overflow rounds to Inf.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_FLOAT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_FLOAT_EQ(Bf16ToFloat(0xC020), -2.5f);
}

TEST(Convert, HalfKnownValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.5f), 0xC100);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie to even rounds up to Inf
  EXPECT_EQ(FloatToHalf(1e6f), 0x7C00);
  EXPECT_EQ(FloatToHalf(inf), 0x7C00);
  EXPECT_EQ(FloatToHalf(-inf), 0xFC00);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
  // Ties to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  // Subnormals.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(1023 * std::ldexp(1.0f, -24)), 0x03FF);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even (0)
  EXPECT_EQ(FloatToHalf(1.5f * std::ldexp(1.0f, -25)), 0x0001);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002);      // 1.5 ulp tie -> even (2)
  EXPECT_EQ(FloatToHalf(5 * std::ldexp(1.0f, -25)), 0x0002);      // 2.5 ulp tie -> even (2)
  EXPECT_EQ(FloatToHalf(0x401 * std::ldexp(1.0f, -25)), 0x0200);  // 512.5 ulp tie -> even
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(FloatToHalf(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_FLOAT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_FLOAT_EQ(HalfToFloat(0x03FF), 1023 * std::ldexp(1.0f, -24));
  EXPECT_FLOAT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_FLOAT_EQ(HalfToFloat(0xC100), -2.5f);
  EXPECT_EQ(HalfToFloat(0xFC00), -inf);
}

TEST(Convert, EverySixteenBitPatternRoundTrips) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float hf = HalfToFloat(bits);
    if (std::isnan(hf)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(hf)))) << std::hex << h;
    } else {
      EXPECT_EQ(FloatToHalf(hf), bits) << std::hex << h;
    }
    const float bf = Bf16ToFloat(bits);
    if (std::isnan(bf)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(bf)))) << std::hex << h;
    } else {
      EXPECT_EQ(FloatToBf16(bf), bits) << std::hex << h;
    }
  }
}

TEST(Convert, HalfRoundsToNearestForRandomFloats) {
  std::mt19937 gen(42);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-27, 15);  // up to 2^16: some overflow
  std::vector<float> in(20000);
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = std::ldexp(mant(gen), expo(gen)) * ((i & 1) ? -1.0f : 1.0f);
  }
  std::vector<uint16_t> out(in.size());
  FloatToHalf(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const double x = std::fabs(static_cast<double>(in[i]));
    const uint16_t mag = out[i] & 0x7FFF;
    ASSERT_EQ(out[i] & 0x8000, in[i] < 0 ? 0x8000 : 0);
    if (x >= 65520.0) {
      EXPECT_EQ(mag, 0x7C00) << in[i];
      continue;
    }
    ASSERT_LT(mag, 0x7C00) << in[i];
    const double err = std::fabs(HalfToFloat(mag) - x);
    if (mag > 0) {
      EXPECT_LE(err, std::fabs(HalfToFloat(mag - 1) - x)) << in[i];
    }
    if (mag < 0x7BFF) {
      EXPECT_LE(err, std::fabs(HalfToFloat(mag + 1) - x)) << in[i];
    }
    EXPECT_EQ(out[i], FloatToHalf(in[i]));  // batch == scalar
  }
}

// ---------------------------------------------------------------- elementwise

double GeluRef(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST(Gelu, ForwardMatchesFormula) {
  auto x = RandomVec(257, 3, -6.0f, 6.0f);
  x[0] = 0.0f;
  std::vector<float> y(x.size());
  GeluForward(x.data(), y.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_NEAR(y[i], GeluRef(x[i]), 1e-6 + 1e-5 * std::fabs(y[i]));
  EXPECT_EQ(y[0], 0.0f);
}

TEST(Gelu, BackwardMatchesFiniteDifferences) {
  auto x = RandomVec(200, 4, -5.0f, 5.0f);
  auto dy = RandomVec(x.size(), 5);
  std::vector<float> dx(x.size());
  GeluBackward(x.data(), dy.data(), dx.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double h = 1e-5;
    const double num = dy[i] * (GeluRef(x[i] + h) - GeluRef(x[i] - h)) / (2 * h);
    EXPECT_NEAR(dx[i], num, 1e-5 + 1e-3 * std::fabs(num)) << x[i];
  }
  // In-place (dx aliases dy).
  std::vector<float> inplace = dy;
  GeluBackward(x.data(), inplace.data(), inplace.data(), x.size());
  EXPECT_EQ(inplace, dx);
}

TEST(Elementwise, BiasAddAddScaleAndBiasBackwardAccumulates) {
  const int rows = 3, cols = 5;
  auto y = RandomVec(rows * cols, 9), bias = RandomVec(cols, 10);
  auto y0 = y;
  BiasAdd(y.data(), bias.data(), rows, cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) EXPECT_FLOAT_EQ(y[r * cols + c], y0[r * cols + c] + bias[c]);

  std::vector<float> dbias(cols, 1.0f);
  BiasBackward(y0.data(), dbias.data(), rows, cols);
  BiasBackward(y0.data(), dbias.data(), rows, cols);  // accumulates
  for (int c = 0; c < cols; ++c) {
    double s = 0;
    for (int r = 0; r < rows; ++r) s += y0[r * cols + c];
    EXPECT_NEAR(dbias[c], 1.0 + 2 * s, 1e-5);
  }

  std::vector<float> out = y0;
  Add(out.data(), bias.data(), out.data(), cols);  // aliasing a
  for (int c = 0; c < cols; ++c) EXPECT_FLOAT_EQ(out[c], y0[c] + bias[c]);
  std::vector<float> acc = y0;
  AddInPlace(acc.data(), y0.data(), acc.size());
  Scale(acc.data(), acc.size(), 0.25f);
  for (size_t i = 0; i < acc.size(); ++i) EXPECT_FLOAT_EQ(acc[i], 0.5f * y0[i]);
}

// ---------------------------------------------------------------- LayerNorm

std::vector<double> LayerNormRef(const std::vector<double>& x, const std::vector<double>& g,
                                 const std::vector<double>& b, int rows, int cols, double eps) {
  std::vector<double> y(x.size());
  for (int r = 0; r < rows; ++r) {
    double mu = 0, var = 0;
    for (int c = 0; c < cols; ++c) mu += x[r * cols + c];
    mu /= cols;
    for (int c = 0; c < cols; ++c) var += (x[r * cols + c] - mu) * (x[r * cols + c] - mu);
    var /= cols;
    const double rs = 1 / std::sqrt(var + eps);
    for (int c = 0; c < cols; ++c) y[r * cols + c] = (x[r * cols + c] - mu) * rs * g[c] + b[c];
  }
  return y;
}

double Dot(const std::vector<double>& a, const std::vector<float>& w) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * w[i];
  return s;
}

TEST(LayerNorm, ForwardNormalizesRows) {
  const int rows = 4, cols = 33;
  auto x = RandomVec(rows * cols, 11, -3.0f, 5.0f);
  for (int c = 0; c < cols; ++c) x[cols + c] += 1000.0f;  // large mean row
  std::vector<float> ones(cols, 1.0f), zeros(cols, 0.0f), y(x.size()), mean(rows), rstd(rows);
  LayerNormForward(x.data(), ones.data(), zeros.data(), y.data(), mean.data(), rstd.data(), rows,
                   cols, 1e-5f);
  for (int r = 0; r < rows; ++r) {
    double mu = 0, var = 0;
    for (int c = 0; c < cols; ++c) mu += y[r * cols + c];
    mu /= cols;
    for (int c = 0; c < cols; ++c) var += (y[r * cols + c] - mu) * (y[r * cols + c] - mu);
    var /= cols;
    EXPECT_NEAR(mu, 0.0, 1e-5);
    EXPECT_NEAR(var, 1.0, 1e-3);
  }
  // With affine parameters: matches the double reference.
  auto g = RandomVec(cols, 12), b = RandomVec(cols, 13);
  LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, cols,
                   1e-5f);
  ExpectClose(y, LayerNormRef(ToDouble(x), ToDouble(g), ToDouble(b), rows, cols, 1e-5), 1e-4, 1e-4,
              "affine");
}

TEST(LayerNorm, BackwardInputMatchesFiniteDifferences) {
  const int rows = 3, cols = 16;
  const float eps = 1e-5f;
  auto x = RandomVec(rows * cols, 14, -2.0f, 2.0f);
  auto g = RandomVec(cols, 15, 0.5f, 1.5f), b = RandomVec(cols, 16);
  auto w = RandomVec(rows * cols, 17);  // loss = sum(y * w), so dy = w
  std::vector<float> y(x.size()), mean(rows), rstd(rows);
  LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, cols,
                   eps);
  std::vector<float> dx(x.size(), 123.0f);  // garbage: must be overwritten
  LayerNormBackwardInput(x.data(), g.data(), mean.data(), rstd.data(), w.data(), dx.data(), rows,
                         cols);
  const auto gd = ToDouble(g), bd = ToDouble(b);
  auto num = NumericGrad(
      [&](const std::vector<double>& xx) {
        return Dot(LayerNormRef(xx, gd, bd, rows, cols, eps), w);
      },
      ToDouble(x));
  ExpectClose(dx, num, 1e-2, 1e-4, "dx");
}

TEST(LayerNorm, BackwardWeightMatchesFiniteDifferencesAndAccumulates) {
  const int rows = 5, cols = 8;
  const float eps = 1e-5f;
  auto x = RandomVec(rows * cols, 18, -2.0f, 2.0f);
  auto g = RandomVec(cols, 19), b = RandomVec(cols, 20);
  auto w = RandomVec(rows * cols, 21);
  std::vector<float> y(x.size()), mean(rows), rstd(rows);
  LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, cols,
                   eps);
  std::vector<float> dg(cols, 0.0f), db(cols, 0.0f);
  LayerNormBackwardWeight(x.data(), mean.data(), rstd.data(), w.data(), dg.data(), db.data(), rows,
                          cols);
  const auto xd = ToDouble(x), gd = ToDouble(g), bd = ToDouble(b);
  auto num_g = NumericGrad(
      [&](const std::vector<double>& gg) {
        return Dot(LayerNormRef(xd, gg, bd, rows, cols, eps), w);
      },
      gd);
  auto num_b = NumericGrad(
      [&](const std::vector<double>& bb) {
        return Dot(LayerNormRef(xd, gd, bb, rows, cols, eps), w);
      },
      bd);
  ExpectClose(dg, num_g, 1e-2, 1e-4, "dgamma");
  ExpectClose(db, num_b, 1e-2, 1e-4, "dbeta");
  // A second call accumulates: the gradient doubles.
  auto dg1 = dg, db1 = db;
  LayerNormBackwardWeight(x.data(), mean.data(), rstd.data(), w.data(), dg.data(), db.data(), rows,
                          cols);
  for (int c = 0; c < cols; ++c) {
    EXPECT_FLOAT_EQ(dg[c], 2 * dg1[c]);
    EXPECT_FLOAT_EQ(db[c], 2 * db1[c]);
  }
}

// ---------------------------------------------------------------- cross-entropy

double CrossEntropyRef(const std::vector<double>& logits, const std::vector<int32_t>& t, int rows,
                       int vocab, int64_t* count) {
  double total = 0;
  int64_t n = 0;
  for (int r = 0; r < rows; ++r) {
    if (t[r] < 0) continue;
    double mx = -INFINITY;
    for (int j = 0; j < vocab; ++j) mx = std::max(mx, logits[r * vocab + j]);
    double s = 0;
    for (int j = 0; j < vocab; ++j) s += std::exp(logits[r * vocab + j] - mx);
    total += std::log(s) + mx - logits[r * vocab + t[r]];
    ++n;
  }
  if (count) *count = n;
  return total;
}

TEST(CrossEntropy, ForwardMatchesNaiveWithIgnoredRows) {
  const int rows = 6, vocab = 50;
  auto logits = RandomVec(rows * vocab, 22, -4.0f, 4.0f);
  std::vector<int32_t> t = {3, -1, 49, 0, -1, 17};
  int64_t count = -7, want_count = 0;
  const double loss = SoftmaxCrossEntropyForward(logits.data(), t.data(), rows, vocab, &count);
  const double want = CrossEntropyRef(ToDouble(logits), t, rows, vocab, &want_count);
  EXPECT_EQ(count, 4);
  EXPECT_EQ(want_count, 4);
  EXPECT_NEAR(loss, want, 1e-5 * std::fabs(want));
  // All rows ignored: zero loss, zero count, zero gradient.
  std::vector<int32_t> none(rows, -1);
  EXPECT_EQ(SoftmaxCrossEntropyForward(logits.data(), none.data(), rows, vocab, &count), 0.0);
  EXPECT_EQ(count, 0);
  std::vector<float> d(logits.size(), 5.0f);
  SoftmaxCrossEntropyBackward(logits.data(), none.data(), rows, vocab, 1.0f, d.data());
  for (float v : d) EXPECT_EQ(v, 0.0f);
}

TEST(CrossEntropy, HugeLogitsStayFinite) {
  const int rows = 2, vocab = 4;
  std::vector<float> logits = {1e4f,  0.0f,  -1e4f, 1e4f,  // two tied maxima
                               -1e4f, -1e4f, -1e4f, -1e4f + 1.0f};
  std::vector<int32_t> t = {2, 3};
  int64_t count = 0;
  const double loss = SoftmaxCrossEntropyForward(logits.data(), t.data(), rows, vocab, &count);
  ASSERT_TRUE(std::isfinite(loss));
  const double want = CrossEntropyRef(ToDouble(logits), t, rows, vocab, nullptr);
  EXPECT_NEAR(loss, want, 1e-3);
  EXPECT_NEAR(loss, (2e4 + std::log(2.0)) + (std::log(3 * std::exp(-1.0) + 1)), 1e-3);
  std::vector<float> d(logits.size());
  SoftmaxCrossEntropyBackward(logits.data(), t.data(), rows, vocab, 1.0f, d.data());
  EXPECT_TRUE(AllFinite(d.data(), d.size()));
  EXPECT_NEAR(d[0], 0.5, 1e-6);
  EXPECT_NEAR(d[2], -1.0, 1e-6);  // the target's probability underflows to 0
  EXPECT_NEAR(d[1], 0.0, 1e-6);
  for (int r = 0; r < rows; ++r) {
    double s = 0;
    for (int j = 0; j < vocab; ++j) s += d[r * vocab + j];
    EXPECT_NEAR(s, 0.0, 1e-6);
  }
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const int rows = 4, vocab = 11;
  auto logits = RandomVec(rows * vocab, 23, -3.0f, 3.0f);
  std::vector<int32_t> t = {0, 10, -1, 5};
  const float scale = 1.0f / 3.0f;  // e.g. 1 / count for a mean loss
  std::vector<float> d(logits.size(), 9.0f);
  SoftmaxCrossEntropyBackward(logits.data(), t.data(), rows, vocab, scale, d.data());
  auto num = NumericGrad(
      [&](const std::vector<double>& l) {
        return scale * CrossEntropyRef(l, t, rows, vocab, nullptr);
      },
      ToDouble(logits));
  ExpectClose(d, num, 1e-2, 1e-5, "dlogits");
  for (int j = 0; j < vocab; ++j) EXPECT_EQ(d[2 * vocab + j], 0.0f);
}

// Attention: tests/kernels/attention_test.cc.

// ---------------------------------------------------------------- embedding

TEST(Embedding, ForwardAndBackwardWithRepeatedTokens) {
  const int B = 2, T = 3, C = 4, V = 5;
  auto wte = RandomVec(V * C, 31), wpe = RandomVec(T * C, 32);
  std::vector<int32_t> tokens = {1, 4, 1, 1, 0, 2};  // token 1 appears three times
  std::vector<float> out(B * T * C);
  EmbeddingForward(tokens.data(), wte.data(), wpe.data(), out.data(), B, T, C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        EXPECT_FLOAT_EQ(out[(b * T + t) * C + c], wte[tokens[b * T + t] * C + c] + wpe[t * C + c]);

  auto dout = RandomVec(B * T * C, 33);
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  EmbeddingBackward(dout.data(), tokens.data(), dwte.data(), dwpe.data(), B, T, C);
  std::vector<double> want_te(V * C, 0.0), want_pe(T * C, 0.0);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        want_te[tokens[b * T + t] * C + c] += dout[(b * T + t) * C + c];
        want_pe[t * C + c] += dout[(b * T + t) * C + c];
      }
  ExpectClose(dwte, want_te, 1e-6, 1e-6, "dwte");
  ExpectClose(dwpe, want_pe, 1e-6, 1e-6, "dwpe");
  for (int c = 0; c < C; ++c) EXPECT_EQ(dwte[3 * C + c], 0.0f);  // unused token
  // Accumulation: a second call doubles both gradients.
  EmbeddingBackward(dout.data(), tokens.data(), dwte.data(), dwpe.data(), B, T, C);
  for (auto& v : want_te) v *= 2;
  for (auto& v : want_pe) v *= 2;
  ExpectClose(dwte, want_te, 1e-6, 1e-6, "dwte x2");
  ExpectClose(dwpe, want_pe, 1e-6, 1e-6, "dwpe x2");
}

// ---------------------------------------------------------------- optimizers / reductions

TEST(Optimizer, AdamWStepsMatchHandComputed) {
  std::vector<float> p = {1.0f, -2.0f, 0.5f}, g = {0.1f, -0.2f, 0.0f};
  std::vector<float> m = {0.0f, 0.0f, 0.0f}, v = {0.0f, 0.0f, 0.0f};
  const float lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  const std::vector<float> p0 = p;
  AdamWUpdate(p.data(), g.data(), m.data(), v.data(), p.size(), lr, b1, b2, eps, wd, 1);
  for (size_t i = 0; i < p.size(); ++i) {
    // Step 1: mhat = g, vhat = g^2, so the Adam term is sign(g) (0 when g == 0).
    const double mi = 0.1 * g[i], vi = 0.001 * g[i] * g[i];
    EXPECT_NEAR(m[i], mi, 1e-7);
    EXPECT_NEAR(v[i], vi, 1e-9);
    const double adam = g[i] / (std::fabs(g[i]) + eps);
    EXPECT_NEAR(p[i], p0[i] - lr * (adam + wd * p0[i]), 1e-6) << i;
  }
  // Step 2 with a new gradient, bias corrections 1 - 0.9^2 and 1 - 0.999^2.
  std::vector<float> g2 = {0.3f, 0.1f, -0.4f};
  const std::vector<float> p1 = p, m1 = m, v1 = v;
  AdamWUpdate(p.data(), g2.data(), m.data(), v.data(), p.size(), lr, b1, b2, eps, wd, 2);
  for (size_t i = 0; i < p.size(); ++i) {
    const double mi = 0.9 * m1[i] + 0.1 * g2[i], vi = 0.999 * v1[i] + 0.001 * g2[i] * g2[i];
    const double mhat = mi / (1 - 0.81), vhat = vi / (1 - 0.999 * 0.999);
    EXPECT_NEAR(p[i], p1[i] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * p1[i]), 1e-6) << i;
  }
}

// The clipping scale applied as AdamW reads the gradient: the same bits as scaling the gradient
// first, and the gradient itself is left as it was.
TEST(Optimizer, AdamWGradScaleEqualsScalingFirst) {
  const size_t n = 1000 + 7;
  std::vector<float> g(n), p(n), m(n, 0.01f), v(n, 0.001f);
  for (size_t i = 0; i < n; ++i) {
    g[i] = 0.37f * static_cast<float>(static_cast<int>(i % 101) - 50) + 0.013f;
    p[i] = 0.5f - 0.001f * static_cast<float>(i);
  }
  const float s = 0.3719f;
  std::vector<float> scaled = g, p1 = p, m1 = m, v1 = v;
  Scale(scaled.data(), n, s);
  AdamWUpdate(p1.data(), scaled.data(), m1.data(), v1.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f,
              3);
  const std::vector<float> g0 = g;
  AdamWUpdate(p.data(), g.data(), m.data(), v.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 3, s);
  EXPECT_EQ(0, std::memcmp(p.data(), p1.data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(m.data(), m1.data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(v.data(), v1.data(), n * sizeof(float)));
  EXPECT_EQ(g, g0);
}

TEST(Optimizer, SgdMomentumTwoStepsMatchHandComputed) {
  std::vector<float> p = {1.0f, -1.0f}, buf = {0.0f, 0.0f};
  const float lr = 0.1f, mom = 0.9f, wd = 0.01f;
  std::vector<float> g1 = {0.5f, 0.2f}, g2 = {-0.3f, 0.4f};
  SgdMomentumUpdate(p.data(), g1.data(), buf.data(), 2, lr, mom, wd);
  // p0 = 1: buf = 0.5 + 0.01 = 0.51, p = 1 - 0.051 = 0.949
  // p0 = -1: buf = 0.2 - 0.01 = 0.19, p = -1 - 0.019 = -1.019
  EXPECT_NEAR(buf[0], 0.51, 1e-6);
  EXPECT_NEAR(buf[1], 0.19, 1e-6);
  EXPECT_NEAR(p[0], 0.949, 1e-6);
  EXPECT_NEAR(p[1], -1.019, 1e-6);
  SgdMomentumUpdate(p.data(), g2.data(), buf.data(), 2, lr, mom, wd);
  // buf = 0.9 * 0.51 + (-0.3 + 0.00949) = 0.16849, p = 0.949 - 0.016849 = 0.932151
  // buf = 0.9 * 0.19 + (0.4 - 0.01019) = 0.56081, p = -1.019 - 0.056081 = -1.075081
  EXPECT_NEAR(buf[0], 0.16849, 1e-6);
  EXPECT_NEAR(buf[1], 0.56081, 1e-6);
  EXPECT_NEAR(p[0], 0.932151, 1e-6);
  EXPECT_NEAR(p[1], -1.075081, 1e-6);
}

TEST(Reductions, SumSquaresAndAllFinite) {
  std::vector<float> x = {3.0f, -4.0f, 0.5f};
  EXPECT_DOUBLE_EQ(SumSquares(x.data(), x.size()), 25.25);
  EXPECT_DOUBLE_EQ(SumSquares(x.data(), 0), 0.0);
  // Double accumulation: 1e6 values of 1e-3 stay accurate.
  std::vector<float> small(1000000, 1e-3f);
  EXPECT_NEAR(SumSquares(small.data(), small.size()), 1e6 * double(1e-3f) * double(1e-3f), 1e-9);
  // Values whose squares overflow float still sum finitely in double.
  std::vector<float> big = {3e38f, 3e38f};
  EXPECT_TRUE(std::isfinite(SumSquares(big.data(), big.size())));

  std::vector<float> y(100, 1.0f);
  EXPECT_TRUE(AllFinite(y.data(), y.size()));
  EXPECT_TRUE(AllFinite(y.data(), 0));
  y[99] = std::numeric_limits<float>::max();
  EXPECT_TRUE(AllFinite(y.data(), y.size()));
  y[57] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(AllFinite(y.data(), y.size()));
  EXPECT_TRUE(AllFinite(y.data(), 57));
  y[57] = 1.0f;
  y[3] = -std::numeric_limits<float>::infinity();
  EXPECT_FALSE(AllFinite(y.data(), y.size()));
}

TEST(Accumulation, WeightGradsAccumulateInputGradsOverwrite) {
  // Input-gradient kernels overwrite whatever was in the output buffer.
  const int rows = 2, cols = 6;
  auto x = RandomVec(rows * cols, 40), g = RandomVec(cols, 41), b = RandomVec(cols, 42);
  auto dy = RandomVec(rows * cols, 43);
  std::vector<float> y(x.size()), mean(rows), rstd(rows);
  LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, cols,
                   1e-5f);
  std::vector<float> dx1(x.size(), 0.0f), dx2(x.size(), 1e3f);
  LayerNormBackwardInput(x.data(), g.data(), mean.data(), rstd.data(), dy.data(), dx1.data(), rows,
                         cols);
  LayerNormBackwardInput(x.data(), g.data(), mean.data(), rstd.data(), dy.data(), dx2.data(), rows,
                         cols);
  EXPECT_EQ(dx1, dx2);
  std::vector<float> dgelu1(x.size(), 0.0f), dgelu2(x.size(), -5.0f);
  GeluBackward(x.data(), dy.data(), dgelu1.data(), x.size());
  GeluBackward(x.data(), dy.data(), dgelu2.data(), x.size());
  EXPECT_EQ(dgelu1, dgelu2);
  // Weight-gradient kernels accumulate: two calls from zero == 2x one call.
  std::vector<float> db1(cols, 0.0f), db2(cols, 0.0f);
  BiasBackward(dy.data(), db1.data(), rows, cols);
  BiasBackward(dy.data(), db2.data(), rows, cols);
  BiasBackward(dy.data(), db2.data(), rows, cols);
  for (int c = 0; c < cols; ++c) EXPECT_FLOAT_EQ(db2[c], 2 * db1[c]);
}

}  // namespace
}  // namespace pipewright::cpu
