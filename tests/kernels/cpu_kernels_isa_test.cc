// The CPU kernels' ISA variants (kernels/cpu/vec.h): every kernel with an `Isa` parameter is run
// under each ISA this CPU supports and compared with the baseline variant and, where useful, a
// double-precision reference. Also checked: the promises of cpu_kernels.h that an element's bits
// do not depend on the range a call covers, that the fused bias + GELU kernels compute the same
// bits as their unfused pairs, and the NaN / Inf behaviour of fast_math.h.
//
// Tolerances between variants: the variants differ only in vector width (partial-sum order) and
// fused multiply-adds, so they agree to a few float ulps of the operands: 2e-6 relative, plus an
// absolute term of a few ulps of the largest term where a result cancels (GELU' near its zero,
// a momentum update where beta m and (1 - beta) g nearly cancel). Column sums
// (BiasBackward) and the dtype conversions are the same bits on every ISA.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"
#include "tests/kernels/kernel_test_util.h"

namespace pipewright::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using kernel_test::RandomVec;

// Bit-for-bit equality (NaN payloads included).
void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want,
                    const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << what << " at " << i << ": " << got[i] << " vs " << want[i];
  }
}

template <typename W>
void ExpectNear(const std::vector<float>& got, const std::vector<W>& want, double rtol, double atol,
                const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = static_cast<double>(want[i]);
    if (std::isnan(w)) {
      EXPECT_TRUE(std::isnan(got[i])) << what << " at " << i;
      continue;
    }
    EXPECT_NEAR(got[i], w, atol + rtol * std::fabs(w)) << what << " at " << i;
  }
}

double GeluRef(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double GeluGradRef(double x) {
  const double k = std::sqrt(2 / M_PI), u = k * (x + 0.044715 * x * x * x);
  const double t = std::tanh(u);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}

// ---------------------------------------------------------------- fast_math.h

TEST(FastMath, ExpAndTanhAccuracy) {
  typedef float V4 __attribute__((vector_size(16)));
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(FastExp(x) - want) / want);
    const V4 v = FastExpT(V4{x, x, x, x});  // the vector version (Estrin's scheme)
    worst = std::max(worst, std::fabs(v[2] - want) / want);
    EXPECT_NEAR(FastTanh(x / 8), std::tanh(x / 8.0), 3e-7) << x;
  }
  EXPECT_LT(worst, 2e-7);
}

TEST(FastMath, NaNAndInfAsDocumented) {
  EXPECT_EQ(FastExp(kInf), FastExp(88.0f));
  EXPECT_TRUE(std::isnormal(FastExp(kInf)));
  EXPECT_EQ(FastExp(-kInf), FastExp(-87.0f));
  EXPECT_TRUE(std::isnormal(FastExp(-kInf)));
  EXPECT_TRUE(std::isnormal(FastExp(-1000.0f)));
  EXPECT_TRUE(std::isnan(FastExp(kNaN)));
  EXPECT_EQ(FastTanh(kInf), 1.0f);
  EXPECT_EQ(FastTanh(-kInf), -1.0f);
  EXPECT_TRUE(std::isnan(FastTanh(kNaN)));
  typedef float V4 __attribute__((vector_size(16)));
  const V4 v = FastExpT(V4{kInf, -kInf, kNaN, 0.0f});
  EXPECT_EQ(v[0], FastExp(88.0f));
  EXPECT_EQ(v[1], FastExp(-87.0f));
  EXPECT_TRUE(std::isnan(v[2]));
  EXPECT_EQ(v[3], 1.0f);
}

// FastExpLanes is FastExp's algorithm on vector lanes: compiled for the same ISA as the scalar
// loop (so with the same fused multiply-adds), every lane has the scalar result's bits, at the
// clamps and for NaN and +-Inf too. The CPU attention's softmax relies on it.
std::vector<float> ExpInputs() {
  std::vector<float> x = {0.0f, -0.0f, 88.0f, -87.0f, 100.0f, -100.0f, kInf, -kInf, kNaN, 1e-30f};
  for (float v = -95.0f; v <= 95.0f; v += 0.0093f) x.push_back(v);
  while (x.size() % 16 != 0) x.push_back(0.5f);
  return x;
}

template <typename V>
__attribute__((always_inline)) inline void ExpBothWays(const float* x, float* lanes, float* scalar,
                                                       size_t n) {
  constexpr size_t kW = sizeof(V) / sizeof(float);
  for (size_t i = 0; i < n; i += kW) {
    V v;
    std::memcpy(&v, x + i, sizeof(v));
    v = FastExpLanes(v);
    std::memcpy(lanes + i, &v, sizeof(v));
  }
  for (size_t i = 0; i < n; ++i) scalar[i] = FastExp(x[i]);
}

void ExpBothWaysBaseline(const float* x, float* lanes, float* scalar, size_t n) {
  ExpBothWays<simd::Vec<4>::F>(x, lanes, scalar, n);
}
#if PW_HAVE_X86_VARIANTS
PW_TARGET_AVX512 void ExpBothWaysAvx512(const float* x, float* lanes, float* scalar, size_t n) {
  ExpBothWays<simd::Vec<16>::F>(x, lanes, scalar, n);
}
#endif

TEST(FastMath, ExpLanesGiveTheScalarBits) {
  const std::vector<float> x = ExpInputs();
  std::vector<float> lanes(x.size()), scalar(x.size());
  ExpBothWaysBaseline(x.data(), lanes.data(), scalar.data(), x.size());
  ExpectSameBits(lanes, scalar, "baseline");
#if PW_HAVE_X86_VARIANTS
  if (KernelIsa() != Isa::kAvx512) GTEST_SKIP() << "no AVX-512 here (or PIPEWRIGHT_CPU_ISA)";
  ExpBothWaysAvx512(x.data(), lanes.data(), scalar.data(), x.size());
  ExpectSameBits(lanes, scalar, "avx512");
#endif
}

// ---------------------------------------------------------------- per-ISA

class KernelIsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (static_cast<int>(GetParam()) > static_cast<int>(KernelIsa())) {
      GTEST_SKIP() << IsaName(GetParam()) << " is not supported here (or PIPEWRIGHT_CPU_ISA)";
    }
  }
  Isa isa() const { return GetParam(); }
};

TEST_P(KernelIsaTest, GeluMatchesReferenceAndBaseline) {
  auto x = RandomVec(4099, 1, -12.0f, 12.0f);
  x[0] = 0.0f;
  x[1] = -30.0f;  // s = e^-80 path: the result stays a normal float
  x[2] = 1e-20f;
  auto dy = RandomVec(x.size(), 2);
  std::vector<float> y(x.size()), yb(x.size()), dx(x.size()), dxb(x.size());
  GeluForward(x.data(), y.data(), x.size(), isa());
  GeluForward(x.data(), yb.data(), x.size(), Isa::kBaseline);
  GeluBackward(x.data(), dy.data(), dx.data(), x.size(), isa());
  GeluBackward(x.data(), dy.data(), dxb.data(), x.size(), Isa::kBaseline);
  std::vector<double> want(x.size()), dwant(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    want[i] = GeluRef(x[i]);
    dwant[i] = dy[i] * GeluGradRef(x[i]);
  }
  ExpectNear(y, want, 1e-5, 1e-6, "gelu vs reference");
  ExpectNear(dx, dwant, 1e-5, 1e-6, "gelu backward vs reference");
  ExpectNear(y, yb, 2e-6, 1e-12, "gelu vs baseline");
  ExpectNear(dx, dxb, 2e-6, 1e-7, "gelu backward vs baseline");  // |dy| <= 1
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_TRUE(std::isnormal(y[1])) << y[1];
  EXPECT_TRUE(std::isnormal(dx[1] / dy[1])) << dx[1];
  // NaN propagates; +-Inf map to +-Inf.
  std::vector<float> special = {kNaN, kInf, -kInf}, out(3);
  GeluForward(special.data(), out.data(), special.size(), isa());
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_EQ(out[1], kInf);
  EXPECT_EQ(out[2], -kInf);
}

// Every flat elementwise kernel, computed whole and in pieces with odd boundaries: the same bits.
TEST_P(KernelIsaTest, FlatKernelsGiveTheSameBitsForAnyChunking) {
  const size_t n = 1000 + 5;
  const std::vector<size_t> cuts = {0, 7, 300, 301, n};
  const auto x = RandomVec(n, 3, -5.0f, 5.0f), b = RandomVec(n, 4);
  auto pieces = [&](auto fn) {
    for (size_t i = 0; i + 1 < cuts.size(); ++i) fn(cuts[i], cuts[i + 1] - cuts[i]);
  };
  std::vector<float> whole(n), split(n);
  GeluForward(x.data(), whole.data(), n, isa());
  pieces([&](size_t o, size_t m) { GeluForward(x.data() + o, split.data() + o, m, isa()); });
  ExpectSameBits(split, whole, "gelu");
  GeluBackward(x.data(), b.data(), whole.data(), n, isa());
  pieces([&](size_t o, size_t m) {
    GeluBackward(x.data() + o, b.data() + o, split.data() + o, m, isa());
  });
  ExpectSameBits(split, whole, "gelu backward");
  Add(x.data(), b.data(), whole.data(), n, isa());
  pieces([&](size_t o, size_t m) { Add(x.data() + o, b.data() + o, split.data() + o, m, isa()); });
  ExpectSameBits(split, whole, "add");
  split = x;
  pieces([&](size_t o, size_t m) { AddInPlace(split.data() + o, b.data() + o, m, isa()); });
  ExpectSameBits(split, whole, "add in place");
  whole = x;
  Scale(whole.data(), n, -0.37f, isa());
  split = x;
  pieces([&](size_t o, size_t m) { Scale(split.data() + o, m, -0.37f, isa()); });
  ExpectSameBits(split, whole, "scale");
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(whole[i], x[i] * -0.37f);
}

TEST_P(KernelIsaTest, FusedBiasGeluIsBiasAddThenGelu) {
  for (const int cols : {1000, 19}) {
    const int rows = 37;
    const size_t n = static_cast<size_t>(rows) * cols;
    const auto x = RandomVec(n, 5, -3.0f, 3.0f), bias = RandomVec(cols, 6), dy = RandomVec(n, 7);
    std::vector<float> pre = x, y(n);
    BiasAdd(pre.data(), bias.data(), rows, cols, isa());
    GeluForward(pre.data(), y.data(), n, isa());
    std::vector<float> fpre(n), fy(n);
    BiasGeluForward(x.data(), bias.data(), fpre.data(), fy.data(), rows, cols, isa());
    ExpectSameBits(fpre, pre, "fused pre");
    ExpectSameBits(fy, y, "fused y");
    std::vector<float> nopre(n);
    BiasGeluForward(x.data(), bias.data(), nullptr, nopre.data(), rows, cols, isa());
    ExpectSameBits(nopre, y, "fused y without pre");
    std::vector<float> inplace = x;  // pre = x, as ops::BiasGeluForward calls it
    BiasGeluForward(inplace.data(), bias.data(), inplace.data(), fy.data(), rows, cols, isa());
    ExpectSameBits(inplace, pre, "fused pre in place");
    ExpectSameBits(fy, y, "fused y after in place");

    // Backward: GeluBackward then BiasBackward, onto a non-zero accumulator.
    const auto dbias0 = RandomVec(cols, 8);
    std::vector<float> dpre(n), dbias = dbias0;
    GeluBackward(pre.data(), dy.data(), dpre.data(), n, isa());
    BiasBackward(dpre.data(), dbias.data(), rows, cols, isa());
    std::vector<float> fdpre = dy, fdbias = dbias0;  // dpre aliasing dy
    BiasGeluBackward(pre.data(), fdpre.data(), fdpre.data(), fdbias.data(), rows, cols, isa());
    ExpectSameBits(fdpre, dpre, "fused dpre");
    ExpectSameBits(fdbias, dbias, "fused dbias");
  }
}

TEST_P(KernelIsaTest, BiasKernelsAreExactAndSplitByRows) {
  const int rows = 45, cols = 771;
  const auto dy = RandomVec(static_cast<size_t>(rows) * cols, 9), bias = RandomVec(cols, 10);
  std::vector<float> db(cols, 0.5f), dbb(cols, 0.5f), split(cols, 0.5f);
  BiasBackward(dy.data(), db.data(), rows, cols, isa());
  BiasBackward(dy.data(), dbb.data(), rows, cols, Isa::kBaseline);
  ExpectSameBits(db, dbb, "bias backward vs baseline");
  // Consecutive row ranges accumulate to the same bits as one call (micro-batch accumulation).
  BiasBackward(dy.data(), split.data(), 6, cols, isa());
  BiasBackward(dy.data() + 6 * cols, split.data(), rows - 6, cols, isa());
  ExpectSameBits(split, db, "bias backward split by rows");
  std::vector<double> want(cols, 0.5);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) want[c] += dy[static_cast<size_t>(r) * cols + c];
  }
  ExpectNear(db, want, 1e-5, 1e-5, "bias backward vs reference");
  std::vector<float> y = dy, yb = dy;
  BiasAdd(y.data(), bias.data(), rows, cols, isa());
  BiasAdd(yb.data(), bias.data(), rows, cols, Isa::kBaseline);
  ExpectSameBits(y, yb, "bias add vs baseline");
}

TEST_P(KernelIsaTest, LayerNormMatchesBaseline) {
  const int rows = 9, cols = 771;  // not a multiple of any vector width
  const size_t n = static_cast<size_t>(rows) * cols;
  auto x = RandomVec(n, 11, -3.0f, 5.0f);
  for (int c = 0; c < cols; ++c) x[cols + c] += 1000.0f;  // a row with a large mean
  const auto g = RandomVec(cols, 12, 0.5f, 1.5f), b = RandomVec(cols, 13), dy = RandomVec(n, 14);
  struct Out {
    std::vector<float> y, mean, rstd, dx, dg, db;
  };
  auto run = [&](Isa which, int split_rows) {
    Out o{std::vector<float>(n), std::vector<float>(rows),        std::vector<float>(rows),
          std::vector<float>(n), std::vector<float>(cols, 0.25f), std::vector<float>(cols, 0.5f)};
    for (int r0 = 0; r0 < rows; r0 += split_rows) {
      const int m = std::min(split_rows, rows - r0);
      const size_t off = static_cast<size_t>(r0) * cols;
      LayerNormForward(x.data() + off, g.data(), b.data(), o.y.data() + off, o.mean.data() + r0,
                       o.rstd.data() + r0, m, cols, 1e-5f, which);
      LayerNormBackwardInput(x.data() + off, g.data(), o.mean.data() + r0, o.rstd.data() + r0,
                             dy.data() + off, o.dx.data() + off, m, cols, which);
      LayerNormBackwardWeight(x.data() + off, o.mean.data() + r0, o.rstd.data() + r0,
                              dy.data() + off, o.dg.data(), o.db.data(), m, cols, which);
    }
    return o;
  };
  const Out got = run(isa(), rows), base = run(Isa::kBaseline, rows), split = run(isa(), 4);
  ExpectNear(got.y, base.y, 2e-6, 2e-6, "y");
  ExpectNear(got.mean, base.mean, 1e-7, 0, "mean");
  ExpectNear(got.rstd, base.rstd, 1e-6, 0, "rstd");
  ExpectNear(got.dx, base.dx, 2e-5, 2e-6, "dx");
  ExpectNear(got.dg, base.dg, 2e-6, 2e-6, "dgamma");
  ExpectNear(got.db, base.db, 2e-6, 2e-6, "dbeta");
  // Row ranges: per-row outputs and the row-order column sums are the same bits.
  ExpectSameBits(split.y, got.y, "y split");
  ExpectSameBits(split.dx, got.dx, "dx split");
  ExpectSameBits(split.dg, got.dg, "dgamma split");
  ExpectSameBits(split.db, got.db, "dbeta split");
  // The statistics against double.
  for (int r = 0; r < rows; ++r) {
    double mu = 0, var = 0;
    for (int c = 0; c < cols; ++c) mu += x[static_cast<size_t>(r) * cols + c];
    mu /= cols;
    for (int c = 0; c < cols; ++c) {
      const double d = x[static_cast<size_t>(r) * cols + c] - mu;
      var += d * d;
    }
    var /= cols;
    EXPECT_NEAR(got.mean[r], mu, 1e-6 * std::fabs(mu) + 1e-7) << r;
    EXPECT_NEAR(got.rstd[r], 1 / std::sqrt(var + 1e-5), 1e-6 / std::sqrt(var)) << r;
  }
}

TEST_P(KernelIsaTest, CrossEntropyMatchesBaseline) {
  const int rows = 13, vocab = 257;
  const auto logits = RandomVec(static_cast<size_t>(rows) * vocab, 15, -8.0f, 8.0f);
  std::vector<int32_t> t(rows);
  for (int r = 0; r < rows; ++r) t[r] = r % 4 == 1 ? -1 : (r * 37) % vocab;
  int64_t count = 0, count_b = 0;
  const double loss =
      SoftmaxCrossEntropyForward(logits.data(), t.data(), rows, vocab, &count, isa());
  const double loss_b =
      SoftmaxCrossEntropyForward(logits.data(), t.data(), rows, vocab, &count_b, Isa::kBaseline);
  EXPECT_EQ(count, count_b);
  EXPECT_NEAR(loss, loss_b, 2e-6 * std::fabs(loss_b));
  std::vector<float> d(logits.size(), 7.0f), db(logits.size(), 7.0f), split(logits.size(), 7.0f);
  SoftmaxCrossEntropyBackward(logits.data(), t.data(), rows, vocab, 0.1f, d.data(), isa());
  SoftmaxCrossEntropyBackward(logits.data(), t.data(), rows, vocab, 0.1f, db.data(),
                              Isa::kBaseline);
  ExpectNear(d, db, 2e-6, 1e-12, "dlogits vs baseline");
  SoftmaxCrossEntropyBackward(logits.data(), t.data(), 5, vocab, 0.1f, split.data(), isa());
  SoftmaxCrossEntropyBackward(logits.data() + 5 * vocab, t.data() + 5, rows - 5, vocab, 0.1f,
                              split.data() + 5 * vocab, isa());
  ExpectSameBits(split, d, "dlogits split by rows");
}

TEST_P(KernelIsaTest, OptimizersMatchBaselineAndAnyChunking) {
  const size_t n = 1000 + 3;
  auto p = RandomVec(n, 16), m = RandomVec(n, 17, -0.1f, 0.1f), v = RandomVec(n, 18, 0.0f, 0.01f);
  auto pb = p, mb = m, vb = v, ps = p, ms = m, vs = v;
  for (int64_t t = 1; t <= 3; ++t) {
    const auto g = RandomVec(n, 19 + t);
    AdamWUpdate(p.data(), g.data(), m.data(), v.data(), n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, t,
                1.0f, isa());
    AdamWUpdate(pb.data(), g.data(), mb.data(), vb.data(), n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, t,
                1.0f, Isa::kBaseline);
    for (size_t o : {size_t{0}, size_t{5}, size_t{517}}) {
      const size_t end = o == 0 ? 5 : o == 5 ? 517 : n;
      AdamWUpdate(ps.data() + o, g.data() + o, ms.data() + o, vs.data() + o, end - o, 1e-2f, 0.9f,
                  0.999f, 1e-8f, 0.1f, t, 1.0f, isa());
    }
  }
  ExpectNear(p, pb, 2e-6, 2e-7, "adamw param");  // |p| ~ 1
  ExpectNear(m, mb, 2e-6, 2e-8, "adamw m");      // |m| <= 0.1
  ExpectNear(v, vb, 2e-6, 1e-12, "adamw v");
  ExpectSameBits(ps, p, "adamw split");
  ExpectSameBits(ms, m, "adamw m split");
  ExpectSameBits(vs, v, "adamw v split");

  auto q = RandomVec(n, 30), buf = RandomVec(n, 31), qb = q, bufb = buf;
  const auto g = RandomVec(n, 32);
  SgdMomentumUpdate(q.data(), g.data(), buf.data(), n, 0.1f, 0.9f, 0.01f, isa());
  SgdMomentumUpdate(qb.data(), g.data(), bufb.data(), n, 0.1f, 0.9f, 0.01f, Isa::kBaseline);
  ExpectNear(q, qb, 2e-6, 2e-7, "sgd param");  // |q|, |buf|, |g| <= 1
  ExpectNear(buf, bufb, 2e-6, 2e-7, "sgd buf");
}

TEST_P(KernelIsaTest, ConversionsAreTheScalarBits) {
  std::vector<uint16_t> all(65536 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> wide(all.size());
  Bf16ToFloat(all.data(), wide.data(), all.size(), isa());
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(wide[i]), std::bit_cast<uint32_t>(Bf16ToFloat(all[i]))) << i;
  }
  HalfToFloat(all.data(), wide.data(), all.size(), isa());
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(wide[i]), std::bit_cast<uint32_t>(HalfToFloat(all[i]))) << i;
  }
  // Random bit patterns (every class: NaN payloads, Inf, subnormals, ties), plus a tail.
  std::mt19937 gen(33);
  std::vector<float> in(100003);
  for (auto& f : in) f = std::bit_cast<float>(static_cast<uint32_t>(gen()));
  for (size_t i = 0; i < 2000; ++i)
    in[i] = std::ldexp(static_cast<float>(i), -34);  // f16 subnormals
  std::vector<uint16_t> out(in.size());
  FloatToBf16(in.data(), out.data(), in.size(), isa());
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], FloatToBf16(in[i])) << in[i];
  FloatToHalf(in.data(), out.data(), in.size(), isa());
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], FloatToHalf(in[i])) << in[i];
}

TEST_P(KernelIsaTest, Reductions) {
  const size_t n = 10007;
  auto x = RandomVec(n, 34, -3.0f, 3.0f);
  double want = 0;
  for (float f : x) want += static_cast<double>(f) * f;
  EXPECT_NEAR(SumSquares(x.data(), n, isa()), want, 1e-12 * want);
  EXPECT_TRUE(AllFinite(x.data(), n, isa()));
  for (size_t at : {size_t{0}, size_t{4096}, n - 1}) {
    auto y = x;
    y[at] = at == 0 ? kNaN : -kInf;
    EXPECT_FALSE(AllFinite(y.data(), n, isa())) << at;
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, KernelIsaTest,
                         ::testing::Values(Isa::kBaseline, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(IsaName(info.param));
                         });

}  // namespace
}  // namespace pipewright::cpu
