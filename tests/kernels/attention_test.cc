// Tests of the flash-style CPU attention (kernels/cpu/attention.cc) against a naive
// double-precision reference, under every instruction set this CPU runs (each variant called
// directly). Sizes are deliberately not multiples of the 64-row tiles or the 16-float padding of
// the head dim. Outputs and scratch start as NaN, so an element the kernel forgets to write, or
// scratch it reads before writing, fails the check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/cpu.h"

namespace pipewright::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Shape {
  int B, T, C, H;
};

std::string Name(const Shape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
         " H=" + std::to_string(s.H);
}

std::vector<float> RandomVec(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Naive attention in double: out [B,T,C], lse [B,H,T] and, for a given dout, dqkv [B,T,3C]
// (the analytic gradient: dv = P^T dO, dS = P (dO V^T - rowsum(dO O)), dq = s dS K, dk = s dS^T Q).
struct Reference {
  std::vector<double> out, lse, dqkv;
};

Reference NaiveAttention(const std::vector<double>& qkv, const std::vector<double>& dout,
                         const Shape& s) {
  const int D = s.C / s.H;
  const size_t ld = 3 * static_cast<size_t>(s.C);
  const double scale = 1 / std::sqrt(static_cast<double>(D));
  Reference r;
  r.out.assign(static_cast<size_t>(s.B) * s.T * s.C, 0.0);
  r.lse.assign(static_cast<size_t>(s.B) * s.H * s.T, 0.0);
  r.dqkv.assign(qkv.size(), 0.0);
  std::vector<double> p(static_cast<size_t>(s.T) * s.T);
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.H; ++h) {
      auto q = [&](int t, int d) {
        return qkv[(static_cast<size_t>(b) * s.T + t) * ld + h * D + d];
      };
      auto k = [&](int t, int d) { return q(t, d + s.C); };
      auto v = [&](int t, int d) { return q(t, d + 2 * s.C); };
      auto grad = [&](int t, int part, int d) -> double& {
        return r.dqkv[(static_cast<size_t>(b) * s.T + t) * ld + part * s.C + h * D + d];
      };
      const size_t row0 = static_cast<size_t>(b) * s.T;
      for (int i = 0; i < s.T; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += q(i, d) * k(j, d);
          p[i * s.T + j] = dot * scale;
          mx = std::max(mx, p[i * s.T + j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(p[i * s.T + j] - mx);
        r.lse[(static_cast<size_t>(b) * s.H + h) * s.T + i] = mx + std::log(sum);
        for (int j = 0; j <= i; ++j) p[i * s.T + j] = std::exp(p[i * s.T + j] - mx) / sum;
        for (int d = 0; d < D; ++d) {
          double o = 0;
          for (int j = 0; j <= i; ++j) o += p[i * s.T + j] * v(j, d);
          r.out[(row0 + i) * s.C + h * D + d] = o;
        }
      }
      for (int i = 0; i < s.T; ++i) {
        const double* g = &dout[(row0 + i) * s.C + h * D];
        double delta = 0;
        for (int d = 0; d < D; ++d) delta += g[d] * r.out[(row0 + i) * s.C + h * D + d];
        for (int j = 0; j <= i; ++j) {
          double dp = 0;
          for (int d = 0; d < D; ++d) dp += g[d] * v(j, d);
          const double pij = p[i * s.T + j], ds = pij * (dp - delta) * scale;
          for (int d = 0; d < D; ++d) {
            grad(i, 0, d) += ds * k(j, d);
            grad(j, 1, d) += ds * q(i, d);
            grad(j, 2, d) += pij * g[d];
          }
        }
      }
    }
  }
  return r;
}

void ExpectClose(const std::vector<float>& got, const std::vector<double>& want, double rtol,
                 double atol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 10; ++i) {
    if (!(std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i]))) {
      ADD_FAILURE() << what << " at " << i << ": " << got[i] << " vs " << want[i];
      ++bad;
    }
  }
}

// What one forward + backward of the kernel produced.
struct Result {
  std::vector<float> out, lse, dqkv;
};

// Pairs [0, B H) in calls of `split` pairs (all of them when split <= 0), scratch poisoned.
Result RunKernel(const std::vector<float>& qkv, const std::vector<float>& dout, const Shape& s,
                 Isa isa, int split = 0) {
  Result r{std::vector<float>(dout.size(), kNaN),
           std::vector<float>(static_cast<size_t>(s.B) * s.H * s.T, kNaN),
           std::vector<float>(qkv.size(), kNaN)};
  std::vector<float> fwd(AttentionForwardScratchFloats(s.T, s.C, s.H), kNaN);
  std::vector<float> bwd(AttentionBackwardScratchFloats(s.T, s.C, s.H), kNaN);
  const int pairs = s.B * s.H, step = split > 0 ? split : pairs;
  for (int p = 0; p < pairs; p += step) {
    AttentionForward(qkv.data(), r.out.data(), r.lse.data(), s.T, s.C, s.H, p,
                     std::min(pairs, p + step), fwd.data(), isa);
  }
  for (int p = 0; p < pairs; p += step) {
    AttentionBackward(dout.data(), qkv.data(), r.out.data(), r.lse.data(), r.dqkv.data(), s.T, s.C,
                      s.H, p, std::min(pairs, p + step), bwd.data(), isa);
  }
  return r;
}

bool Supported(Isa isa) {
  const CpuFeatures& f = GetCpuFeatures();
  switch (isa) {
    case Isa::kAvx512:
      return f.avx512() && f.fma;
    case Isa::kAvx2:
      return f.avx2 && f.fma;
    case Isa::kBaseline:
      break;
  }
  return true;
}

class AttentionIsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!Supported(GetParam())) GTEST_SKIP() << IsaName(GetParam()) << " not supported here";
  }

  // Forward and backward of random inputs in [-range, range] against the reference, within
  // tolerances multiplied by `tol` (fp32 scores carry an error proportional to their size).
  void Check(const Shape& s, uint32_t seed, float range = 1.5f, double tol = 1.0) {
    const auto qkv = RandomVec(static_cast<size_t>(s.B) * s.T * 3 * s.C, seed, -range, range);
    const auto dout = RandomVec(static_cast<size_t>(s.B) * s.T * s.C, seed + 1, -1.0f, 1.0f);
    const Reference want = NaiveAttention({qkv.begin(), qkv.end()}, {dout.begin(), dout.end()}, s);
    const Result got = RunKernel(qkv, dout, s, GetParam());
    const std::string at = std::string(IsaName(GetParam())) + " " + Name(s) + ": ";
    ExpectClose(got.out, want.out, tol * 1e-4, tol * 1e-5, at + "out");
    ExpectClose(got.lse, want.lse, tol * 1e-5, tol * 1e-5, at + "lse");
    ExpectClose(got.dqkv, want.dqkv, tol * 1e-4, tol * 2e-5, at + "dqkv");
  }
};

TEST_P(AttentionIsaTest, MatchesNaiveReference) {
  const Shape shapes[] = {
      {2, 5, 8, 2},      // D = 4
      {1, 7, 6, 1},      // D = 6, one head
      {2, 37, 64, 2},    // D = 32
      {1, 65, 128, 2},   // D = 64, one row past a tile
      {2, 63, 64, 1},    // D = 64, one row short of a tile
      {1, 130, 64, 2},   // three backward query tiles, two forward ones, D = 32
      {1, 260, 64, 2},   // three forward query tiles, D = 32
      {1, 200, 60, 3},   // D = 20: padded to 32
      {1, 129, 100, 1},  // D = 100: padded to 112
  };
  uint32_t seed = 100;
  for (const Shape& s : shapes) {
    Check(s, seed);
    seed += 2;
  }
}

TEST_P(AttentionIsaTest, SingleToken) {
  // One token attends to itself only: out = v, lse = q.k / sqrt(D), dq = dk = 0, dv = dout.
  Check({3, 1, 64, 2}, 200);
  Check({1, 1, 4, 2}, 202);
}

TEST_P(AttentionIsaTest, LargeScoresStayFinite) {
  // Scores up to 8 * 8 * 32 / sqrt(32) ~ 360: exp overflows unless the online softmax subtracts
  // the running max. Their fp32 rounding (~1e-4 absolute) sets the tolerance.
  Check({1, 150, 64, 2}, 300, 8.0f, 10.0);
}

TEST_P(AttentionIsaTest, RangeSplitIsBitIdentical) {
  const Shape s{3, 70, 96, 3};  // 9 pairs, D = 32
  const auto qkv = RandomVec(static_cast<size_t>(s.B) * s.T * 3 * s.C, 400, -1.5f, 1.5f);
  const auto dout = RandomVec(static_cast<size_t>(s.B) * s.T * s.C, 401, -1.0f, 1.0f);
  const Result whole = RunKernel(qkv, dout, s, GetParam());
  for (int split : {1, 2, 4}) {
    const Result part = RunKernel(qkv, dout, s, GetParam(), split);
    EXPECT_EQ(0, std::memcmp(part.out.data(), whole.out.data(), whole.out.size() * sizeof(float)))
        << "out, split " << split;
    EXPECT_EQ(0, std::memcmp(part.lse.data(), whole.lse.data(), whole.lse.size() * sizeof(float)))
        << "lse, split " << split;
    EXPECT_EQ(0,
              std::memcmp(part.dqkv.data(), whole.dqkv.data(), whole.dqkv.size() * sizeof(float)))
        << "dqkv, split " << split;
  }
}

TEST_P(AttentionIsaTest, IsCausal) {
  // Changing token t changes no output row before t, bit for bit, and every row from t on.
  const Shape s{2, 100, 64, 2};
  auto qkv = RandomVec(static_cast<size_t>(s.B) * s.T * 3 * s.C, 500, -1.0f, 1.0f);
  const auto dout = RandomVec(static_cast<size_t>(s.B) * s.T * s.C, 501, -1.0f, 1.0f);
  const Result before = RunKernel(qkv, dout, s, GetParam());
  const int changed = 70;
  for (int b = 0; b < s.B; ++b) {
    for (int c = 0; c < 3 * s.C; ++c)
      qkv[(static_cast<size_t>(b) * s.T + changed) * 3 * s.C + c] += 0.5f;
  }
  const Result after = RunKernel(qkv, dout, s, GetParam());
  for (int b = 0; b < s.B; ++b) {
    for (int t = 0; t < s.T; ++t) {
      bool differs = false;
      for (int c = 0; c < s.C; ++c) {
        const size_t i = (static_cast<size_t>(b) * s.T + t) * s.C + c;
        if (t < changed) {
          EXPECT_EQ(before.out[i], after.out[i]) << "b=" << b << " t=" << t;
        }
        differs |= before.out[i] != after.out[i];
      }
      if (t >= changed) {
        EXPECT_TRUE(differs) << "b=" << b << " t=" << t;
      }
    }
  }
}

// Incremental decoding's kernel (kernels/cpu/attention_decode.cc): the rows of positions
// [start, start + n) from their q and a cache of every key and value so far, against the
// reference's rows of the whole sequence; heads in calls of one and of all, scratch poisoned.
TEST_P(AttentionIsaTest, DecodeRowsMatchTheWholeSequence) {
  const Shape shapes[] = {{1, 33, 64, 4}, {1, 7, 6, 1}, {1, 70, 60, 3}, {1, 130, 128, 2}};
  uint32_t seed = 700;
  for (const Shape& s : shapes) {
    const auto qkv = RandomVec(static_cast<size_t>(s.T) * 3 * s.C, seed++, -1.5f, 1.5f);
    const std::vector<double> dout(static_cast<size_t>(s.T) * s.C, 0.0);
    const Reference want = NaiveAttention({qkv.begin(), qkv.end()}, dout, s);
    std::vector<float> kv(static_cast<size_t>(s.T) * 2 * s.C);  // rows k | v
    for (int t = 0; t < s.T; ++t) {
      std::copy_n(qkv.data() + static_cast<size_t>(t) * 3 * s.C + s.C, 2 * s.C,
                  kv.data() + static_cast<size_t>(t) * 2 * s.C);
    }
    for (const auto& [start, n] : {std::pair{0, 1}, {0, s.T}, {s.T / 2, 1}, {s.T - 3, 3}}) {
      for (int per_call : {1, s.H}) {
        std::vector<float> out(static_cast<size_t>(n) * s.C, kNaN);
        std::vector<float> scratch(AttentionDecodeScratchFloats(start + n, s.C, s.H), kNaN);
        for (int h = 0; h < s.H; h += per_call) {
          AttentionDecode(qkv.data() + static_cast<size_t>(start) * 3 * s.C, 3 * s.C, kv.data(),
                          2 * s.C, out.data(), s.C, start, n, s.C, s.H, h,
                          std::min(s.H, h + per_call), scratch.data(), GetParam());
        }
        const std::vector<double> rows(want.out.begin() + static_cast<size_t>(start) * s.C,
                                       want.out.begin() + static_cast<size_t>(start + n) * s.C);
        ExpectClose(out, rows, 1e-4, 1e-5,
                    std::string(IsaName(GetParam())) + " " + Name(s) + " start " +
                        std::to_string(start) + " n " + std::to_string(n));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AttentionIsaTest,
                         ::testing::Values(Isa::kBaseline, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(IsaName(info.param));
                         });

// The reference's gradient against central differences of its own forward, so that the kernel
// tests above compare with a trusted gradient.
TEST(AttentionReference, GradientMatchesFiniteDifferences) {
  const Shape s{2, 6, 8, 2};
  const auto qkv32 = RandomVec(static_cast<size_t>(s.B) * s.T * 3 * s.C, 600, -1.5f, 1.5f);
  const auto w32 = RandomVec(static_cast<size_t>(s.B) * s.T * s.C, 601, -1.0f, 1.0f);
  std::vector<double> qkv(qkv32.begin(), qkv32.end()), w(w32.begin(), w32.end());
  const Reference ref = NaiveAttention(qkv, w, s);  // loss = sum(out * w): dout = w
  auto loss = [&] {
    const Reference r = NaiveAttention(qkv, w, s);
    double sum = 0;
    for (size_t i = 0; i < w.size(); ++i) sum += r.out[i] * w[i];
    return sum;
  };
  const double eps = 1e-5;
  for (size_t i = 0; i < qkv.size(); ++i) {
    const double saved = qkv[i];
    qkv[i] = saved + eps;
    const double up = loss();
    qkv[i] = saved - eps;
    const double down = loss();
    qkv[i] = saved;
    EXPECT_NEAR(ref.dqkv[i], (up - down) / (2 * eps), 1e-7) << "at " << i;
  }
}

TEST(Attention, ScratchGrowsLinearlyWithT) {
  // O(T D) per call, never O(T^2): doubling T at most doubles it (plus the fixed tile buffers).
  for (int T : {512, 1024, 4096}) {
    const size_t one = AttentionBackwardScratchFloats(T, 768, 12);
    const size_t two = AttentionBackwardScratchFloats(2 * T, 768, 12);
    EXPECT_LE(two, 2 * one) << "T=" << T;
    EXPECT_LE(AttentionForwardScratchFloats(2 * T, 768, 12),
              2 * AttentionForwardScratchFloats(T, 768, 12))
        << "T=" << T;
  }
  EXPECT_LT(AttentionBackwardScratchFloats(1024, 768, 12), 1024u * 64 * 8);
}

}  // namespace
}  // namespace pipewright::cpu
