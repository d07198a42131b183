// Tests of the 16-bit GEMMs (kernels/cpu/gemm_bf16.cc, GemmHalf in kernels/cpu/gemm.cc).
//
// Reference: the exact product of the 16-bit-rounded inputs, in double. Tolerance, per element:
//   |got - ref| <= 2 (k + 4) u (|alpha| sum_k |a b| + |beta c|) + 1e-30,   u = 2^-24,
// the textbook bound for a recursive fp32 sum of k exact products (each bf16 x bf16 or f16 x f16
// product is exact in fp32, so only the k additions, alpha and beta round), with a factor 2 of
// slack. It holds whatever order the sum runs in, so it covers the native kernels and the
// widening path (OpenBLAS) alike, and it is tight: a dropped or doubled term of size |a b| is
// about sum |a b| / k, far above it for the k tested. The 1e-30 absorbs the flushed denormals.
// The native kernels are also checked to give identical bits to each other and for any split
// of C into sub-ranges.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/cpu.h"
#include "tests/kernels/kernel_test_util.h"

namespace pipewright::cpu {
namespace {

struct Shape {
  int m, n, k;
};
// Odd sizes around the tiles (14 x 32), the pairs of k, and the k blocks (192 / 384).
const Shape kShapes[] = {{1, 1, 1},    {7, 33, 65},  {65, 7, 33}, {33, 65, 300}, {300, 33, 7},
                         {1, 300, 65}, {17, 100, 1}, {14, 32, 2}, {29, 65, 385}, {15, 31, 0}};
struct Scaling {
  float alpha, beta;
};
// alpha == 1 with beta 0, 1, other; alpha != 1 with beta 0 and (one k block) beta != 0.
const Scaling kScalings[] = {
    {1.0f, 0.0f}, {1.0f, 1.0f}, {1.0f, 0.5f}, {-0.5f, 0.0f}, {0.75f, -2.0f}};

// A GEMM's operands: fp32 values already representable in the 16-bit type, and their bits.
struct Problem {
  bool is_bf16, ta, tb;
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  std::vector<uint16_t> a16, b16;
  std::vector<float> a, b, c;  // c: the initial C (NaN everywhere when beta == 0)
};

void Round16(bool is_bf16, std::vector<float>& v, std::vector<uint16_t>& bits) {
  bits = kernel_test::To16Bits(is_bf16, v);
  if (is_bf16) {
    Bf16ToFloat(bits.data(), v.data(), v.size());
  } else {
    HalfToFloat(bits.data(), v.data(), v.size());
  }
}

// Inputs uniform in [-1, 1) times 2^scale_exp (a negative exponent reaches denormal products).
Problem MakeProblem(bool is_bf16, bool ta, bool tb, Shape s, Scaling sc, int pad, uint32_t seed,
                    int scale_exp = 0) {
  Problem p{is_bf16, ta, tb, s.m, s.n, s.k, 0, 0, 0, sc.alpha, sc.beta, {}, {}, {}, {}, {}};
  const int a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
  const int b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
  p.lda = a_cols + pad;
  p.ldb = b_cols + pad;
  p.ldc = s.n + pad;
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto fill = [&](std::vector<float>& v, size_t count, int e) {
    v.resize(count);
    for (float& x : v) x = std::ldexp(dist(gen), e);
  };
  fill(p.a, static_cast<size_t>(a_rows) * p.lda + 1, scale_exp);  // + 1: never empty
  fill(p.b, static_cast<size_t>(b_rows) * p.ldb + 1, scale_exp);
  fill(p.c, static_cast<size_t>(s.m) * p.ldc, 0);
  Round16(is_bf16, p.a, p.a16);
  Round16(is_bf16, p.b, p.b16);
  if (sc.beta == 0.0f) {
    // Only the m x n region: padding columns keep their values to show they are not written.
    for (int i = 0; i < s.m; ++i) {
      for (int j = 0; j < s.n; ++j) {
        p.c[static_cast<size_t>(i) * p.ldc + j] = std::numeric_limits<float>::quiet_NaN();
      }
    }
  }
  return p;
}

std::string Describe(const Problem& p) {
  return std::string(p.is_bf16 ? "bf16" : "f16") + " m=" + std::to_string(p.m) +
         " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k) + " ta=" + std::to_string(p.ta) +
         " tb=" + std::to_string(p.tb) + " alpha=" + std::to_string(p.alpha) +
         " beta=" + std::to_string(p.beta) + " ldc=" + std::to_string(p.ldc);
}

// Checks `got` (C after the GEMM) against the double reference within the stated bound, and
// the padding columns against the initial C, bit for bit.
// Each element of C in double, and the rounding bound around it (padding columns: unused).
struct Reference {
  std::vector<double> want, bound;
};

Reference MakeReference(const Problem& p) {
  const double u = std::ldexp(1.0, -24);
  Reference r;
  r.want.assign(p.c.size(), 0);
  r.bound.assign(p.c.size(), 0);
  for (int i = 0; i < p.m; ++i) {
    for (int j = 0; j < p.n; ++j) {
      const size_t idx = static_cast<size_t>(i) * p.ldc + j;
      double sum = 0, magnitude = 0;
      for (int kk = 0; kk < p.k; ++kk) {
        const double av =
            p.a[p.ta ? static_cast<size_t>(kk) * p.lda + i : static_cast<size_t>(i) * p.lda + kk];
        const double bv =
            p.b[p.tb ? static_cast<size_t>(j) * p.ldb + kk : static_cast<size_t>(kk) * p.ldb + j];
        sum += av * bv;
        magnitude += std::fabs(av * bv);
      }
      const double c0 = p.beta == 0.0f ? 0.0 : p.c[idx];
      r.want[idx] = p.alpha * sum + p.beta * c0;
      r.bound[idx] =
          2.0 * (p.k + 4) * u * (std::fabs(p.alpha) * magnitude + std::fabs(p.beta * c0)) + 1e-30;
    }
  }
  return r;
}

// `got` within the reference's bound everywhere, and the padding columns untouched.
void ExpectWithin(const Problem& p, const Reference& r, const std::vector<float>& got) {
  ASSERT_EQ(got.size(), p.c.size());
  int failures = 0;
  for (int i = 0; i < p.m && failures < 5; ++i) {
    for (int j = 0; j < p.ldc; ++j) {
      const size_t idx = static_cast<size_t>(i) * p.ldc + j;
      if (j >= p.n) {
        EXPECT_EQ(std::memcmp(&got[idx], &p.c[idx], sizeof(float)), 0)
            << Describe(p) << ": padding written at (" << i << "," << j << ")";
        continue;
      }
      if (!(std::fabs(got[idx] - r.want[idx]) <= r.bound[idx])) {
        ADD_FAILURE() << Describe(p) << " at (" << i << "," << j << "): got " << got[idx]
                      << ", want " << r.want[idx] << " +- " << r.bound[idx];
        ++failures;
      }
    }
  }
}

void ExpectMatchesReference(const Problem& p, const std::vector<float>& got) {
  ExpectWithin(p, MakeReference(p), got);
}

std::vector<float> RunBlock(const Problem& p, HalfGemmKernel kernel, int m0, int m1, int n0, int n1,
                            std::vector<float> c) {
  GemmHalfBlock(p.is_bf16, p.ta, p.tb, p.m, p.n, p.k, p.alpha, p.a16.data(), p.lda, p.b16.data(),
                p.ldb, p.beta, c.data(), p.ldc, m0, m1, n0, n1, kernel);
  return c;
}
std::vector<float> RunBlock(const Problem& p, HalfGemmKernel kernel) {
  return RunBlock(p, kernel, 0, p.m, 0, p.n, p.c);
}
std::vector<float> RunGemmHalf(const Problem& p, Isa isa) {
  std::vector<float> c = p.c;
  GemmHalf(p.is_bf16, p.ta, p.tb, p.m, p.n, p.k, p.alpha, p.a16.data(), p.lda, p.b16.data(), p.ldb,
           p.beta, c.data(), p.ldc, isa);
  return c;
}

bool SameBits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// Every shape, transpose, scaling and padding of kShapes x kScalings through `run`.
template <typename Run>
void ForAllProblems(bool is_bf16, Run run) {
  uint32_t seed = 1;
  for (const Shape& s : kShapes) {
    for (int t = 0; t < 4; ++t) {
      for (const Scaling& sc : kScalings) {
        for (int pad : {0, 3}) {
          const Problem p = MakeProblem(is_bf16, t & 1, t & 2, s, sc, pad, seed++);
          run(p);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

void CheckKernel(bool is_bf16, HalfGemmKernel kernel) {
  if (!CanRunHalfGemmKernel(kernel)) {
    GTEST_SKIP() << HalfGemmKernelName(kernel) << " needs a CPU this one is not";
  }
  ForAllProblems(is_bf16,
                 [&](const Problem& p) { ExpectMatchesReference(p, RunBlock(p, kernel)); });
}

TEST(GemmHalfBlock, Bf16FmaMatchesReference) { CheckKernel(true, HalfGemmKernel::kFma); }
TEST(GemmHalfBlock, Bf16DotMatchesReference) { CheckKernel(true, HalfGemmKernel::kBf16Dot); }
TEST(GemmHalfBlock, HalfFmaMatchesReference) { CheckKernel(false, HalfGemmKernel::kFma); }
TEST(GemmHalfBlock, Bf16AmxMatchesReference) { CheckKernel(true, HalfGemmKernel::kAmx); }

// Note [AMX GEMM]'s order, emulated: per element, from beta * c (alpha == 1) or 0, each chunk of
// 32 k adds (E + O), E and O the chunk's even and odd fused multiply-add chains from +0; then
// alpha and beta. Inputs in the normal range (the hardware flushes denormals; std::fma does not).
std::vector<float> AmxOrder(const Problem& p) {
  std::vector<float> c = p.c;
  auto at_a = [&](int i, int k) {
    return p.a[p.ta ? static_cast<size_t>(k) * p.lda + i : static_cast<size_t>(i) * p.lda + k];
  };
  auto at_b = [&](int k, int j) {
    return p.b[p.tb ? static_cast<size_t>(j) * p.ldb + k : static_cast<size_t>(k) * p.ldb + j];
  };
  for (int i = 0; i < p.m; ++i) {
    for (int j = 0; j < p.n; ++j) {
      float& out = c[static_cast<size_t>(i) * p.ldc + j];
      float s = p.alpha != 1.0f || p.beta == 0.0f ? 0.0f : (p.beta == 1.0f ? out : p.beta * out);
      for (int k0 = 0; k0 < p.k; k0 += 32) {
        float even = 0.0f, odd = 0.0f;
        for (int k = k0; k < std::min(p.k, k0 + 32); ++k) {
          float& chain = (k - k0) % 2 == 0 ? even : odd;
          chain = std::fma(at_a(i, k), at_b(k, j), chain);
        }
        s = s + (even + odd);
      }
      out =
          p.alpha == 1.0f ? s : (p.beta == 0.0f ? p.alpha * s : std::fma(p.alpha, s, p.beta * out));
    }
  }
  return c;
}

// The AMX kernel computes exactly that order (so its bits are defined, whatever the blocking: k
// blocks of 512, B blocks of 1 MiB, edge blocks through the buffer), and any split of C gives the
// whole product's bits.
TEST(GemmAmx, ComputesTheDocumentedOrderBitForBit) {
  if (!CanRunHalfGemmKernel(HalfGemmKernel::kAmx)) GTEST_SKIP() << "no AMX on this CPU";
  uint32_t seed = 4000;
  for (const Shape s : {Shape{1, 1, 1}, Shape{32, 32, 32}, Shape{45, 70, 1001}, Shape{64, 96, 512},
                        Shape{33, 1100, 530}, Shape{7, 33, 65}}) {
    // Large shapes are slow to emulate (under ASan most of all): for them the two layouts
    // that between them use every packer (A and B as stored, and both transposed), with a
    // fresh sum, a running sum over k blocks, and alpha and beta both scaling.
    const bool large = int64_t{s.m} * s.n * s.k > 200000;
    for (int t = 0; t < 4; ++t) {
      if (large && t != 0 && t != 3) continue;
      for (const Scaling& sc : kScalings) {
        if (large && sc.alpha == 1.0f && sc.beta == 0.5f) continue;
        if (large && sc.alpha == -0.5f) continue;
        const Problem p = MakeProblem(true, t & 1, t & 2, s, sc, 1, seed++);
        const std::vector<float> got = RunBlock(p, HalfGemmKernel::kAmx);
        EXPECT_TRUE(SameBits(got, AmxOrder(p))) << Describe(p);
        std::vector<float> split = RunBlock(p, HalfGemmKernel::kAmx, 0, p.m / 2, 0, p.n, p.c);
        split = RunBlock(p, HalfGemmKernel::kAmx, p.m / 2, p.m, 0, p.n / 3, split);
        split = RunBlock(p, HalfGemmKernel::kAmx, p.m / 2, p.m, p.n / 3, p.n, split);
        EXPECT_TRUE(SameBits(got, split)) << Describe(p) << ": split";
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// The widening path (f32 copies for OpenBLAS), which CPUs without AVX-512 and forced narrower
// ISAs take, meets the same bound.
TEST(GemmHalf, WideningPathMatchesReference) {
  for (bool is_bf16 : {true, false}) {
    ForAllProblems(is_bf16, [&](const Problem& p) {
      ExpectMatchesReference(p, RunGemmHalf(p, Isa::kBaseline));
    });
  }
}

// vdpbf16ps and the FMA kernel compute the same sum to the bit (Note [16-bit GEMM]), on
// ordinary values and where products, sums and inputs are denormal (both flush them).
TEST(GemmHalfBlock, KernelsGiveIdenticalBits) {
  if (!CanRunHalfGemmKernel(HalfGemmKernel::kBf16Dot)) GTEST_SKIP() << "no AVX512_BF16";
  uint32_t seed = 500;
  for (int scale_exp : {0, -63, -70}) {
    for (int t = 0; t < 4; ++t) {
      for (const Scaling& sc : kScalings) {
        const Problem p = MakeProblem(true, t & 1, t & 2, {45, 70, 1001}, sc, 1, seed++, scale_exp);
        EXPECT_TRUE(
            SameBits(RunBlock(p, HalfGemmKernel::kFma), RunBlock(p, HalfGemmKernel::kBf16Dot)))
            << Describe(p) << " inputs scaled by 2^" << scale_exp;
      }
    }
  }
}

// Any split of C into row or column ranges gives the whole product's bits, and a range call
// writes nothing outside its range.
TEST(GemmHalfBlock, SubRangesGiveTheSameBits) {
  const HalfGemmKernel kernels[] = {HalfGemmKernel::kFma, HalfGemmKernel::kBf16Dot,
                                    HalfGemmKernel::kAmx};
  for (HalfGemmKernel kernel : kernels) {
    if (!CanRunHalfGemmKernel(kernel)) continue;
    for (int t = 0; t < 4; ++t) {
      const Problem p = MakeProblem(true, t & 1, t & 2, {67, 101, 457}, {1.0f, 1.0f}, 2, 900 + t);
      const std::vector<float> whole = RunBlock(p, kernel);
      EXPECT_TRUE(SameBits(whole, RunBlock(p, kernel))) << "not deterministic";
      const int row_cuts[] = {0, 5, 19, 20, 47, 67}, col_cuts[] = {0, 1, 33, 64, 100, 101};
      std::vector<float> by_rows = p.c, by_cols = p.c;
      for (int r = 0; r + 1 < 6; ++r) {
        by_rows = RunBlock(p, kernel, row_cuts[r], row_cuts[r + 1], 0, p.n, by_rows);
      }
      for (int c = 0; c + 1 < 6; ++c) {
        by_cols = RunBlock(p, kernel, 0, p.m, col_cuts[c], col_cuts[c + 1], by_cols);
      }
      EXPECT_TRUE(SameBits(whole, by_rows)) << HalfGemmKernelName(kernel) << " t=" << t;
      EXPECT_TRUE(SameBits(whole, by_cols)) << HalfGemmKernelName(kernel) << " t=" << t;
      // One interior block: everything else keeps the initial C.
      const std::vector<float> block = RunBlock(p, kernel, 10, 30, 40, 70, p.c);
      for (int i = 0; i < p.m; ++i) {
        for (int j = 0; j < p.ldc; ++j) {
          const size_t idx = static_cast<size_t>(i) * p.ldc + j;
          const bool inside = i >= 10 && i < 30 && j >= 40 && j < 70;
          EXPECT_EQ(std::memcmp(&block[idx], inside ? &whole[idx] : &p.c[idx], sizeof(float)), 0)
              << "(" << i << "," << j << ")";
        }
      }
    }
  }
}

// The fp32 GEMM on the same blocking (Note [fp32 GEMM]): within the recursive-sum bound of the
// double reference, and the same bits for any split of C.
std::vector<float> RunF32(const Problem& p, int m0, int m1, int n0, int n1, std::vector<float> c) {
  GemmF32Block(p.ta, p.tb, p.m, p.n, p.k, p.alpha, p.a.data(), p.lda, p.b.data(), p.ldb, p.beta,
               c.data(), p.ldc, m0, m1, n0, n1);
  return c;
}

TEST(GemmF32Block, MatchesReference) {
  if (!HaveGemmHalfAvx512()) GTEST_SKIP() << "no AVX-512";
  ForAllProblems(
      true, [&](const Problem& p) { ExpectMatchesReference(p, RunF32(p, 0, p.m, 0, p.n, p.c)); });
}

TEST(GemmF32Block, SubRangesGiveTheSameBits) {
  if (!HaveGemmHalfAvx512()) GTEST_SKIP() << "no AVX-512";
  for (int t = 0; t < 4; ++t) {
    const Problem p = MakeProblem(true, t & 1, t & 2, {67, 101, 457}, {1.0f, 1.0f}, 2, 950 + t);
    const std::vector<float> whole = RunF32(p, 0, p.m, 0, p.n, p.c);
    const int row_cuts[] = {0, 5, 19, 20, 47, 67}, col_cuts[] = {0, 1, 33, 64, 100, 101};
    std::vector<float> by_rows = p.c, by_cols = p.c;
    for (int r = 0; r + 1 < 6; ++r) {
      by_rows = RunF32(p, row_cuts[r], row_cuts[r + 1], 0, p.n, by_rows);
    }
    for (int c = 0; c + 1 < 6; ++c) {
      by_cols = RunF32(p, 0, p.m, col_cuts[c], col_cuts[c + 1], by_cols);
    }
    EXPECT_TRUE(SameBits(whole, by_rows)) << "t=" << t;
    EXPECT_TRUE(SameBits(whole, by_cols)) << "t=" << t;
  }
}

// Note [fp32 k blocks]: a product whose columns fit one packed block of B at its whole k runs k
// as one block; a wider one in blocks of 256. Columns [0, 64) of a 500-column product with
// k = 600 take one block as a call of their own and three inside the whole product (and the rest,
// 448 columns, three again): the same bits either way, with A stored either way round.
TEST(GemmF32Block, OneKBlockGivesTheBitsOfSeveral) {
  if (!HaveGemmHalfAvx512()) GTEST_SKIP() << "no AVX-512";
  for (int t = 0; t < 4; ++t) {
    for (const Scaling& sc : {Scaling{1.0f, 0.0f}, Scaling{1.0f, 1.0f}}) {
      const Problem p = MakeProblem(true, t & 1, t & 2, {40, 500, 600}, sc, 1, 990 + t);
      const std::vector<float> whole = RunF32(p, 0, p.m, 0, p.n, p.c);
      ExpectMatchesReference(p, whole);
      const std::vector<float> narrow = RunF32(p, 0, p.m, 0, 64, p.c);
      EXPECT_TRUE(SameBits(whole, RunF32(p, 0, p.m, 64, p.n, narrow))) << Describe(p);
    }
  }
}

// Products wider than one packed block of B (1 MiB: 960 fp32 columns at this k's blocks of 265)
// and taller than one packed block of A (112 rows), with several k blocks: every block boundary
// of the fp32 GEMM's BlockedGemm, within the reference bound and with the bits of a column split
// past the block edge; the 16-bit kernels (wider blocks of B here) against the reference too.
TEST(GemmBlocking, WideProductsSpanSeveralBlocksOfB) {
  if (!HaveGemmHalfAvx512()) GTEST_SKIP() << "no AVX-512";
  for (int t = 0; t < 4; ++t) {
    for (const Scaling& sc : {Scaling{1.0f, 0.0f}, Scaling{1.0f, 1.0f}}) {
      const Problem p = MakeProblem(true, t & 1, t & 2, {130, 1100, 530}, sc, 1, 970 + t);
      const Reference ref = MakeReference(p);  // once for the four kernels
      const std::vector<float> whole = RunF32(p, 0, p.m, 0, p.n, p.c);
      ExpectWithin(p, ref, whole);
      const std::vector<float> left = RunF32(p, 0, p.m, 0, 1024, p.c);
      EXPECT_TRUE(SameBits(whole, RunF32(p, 0, p.m, 1024, p.n, left))) << "t=" << t;
      ExpectWithin(p, ref, RunBlock(p, HalfGemmKernel::kFma));
      if (CanRunHalfGemmKernel(HalfGemmKernel::kBf16Dot)) {
        ExpectWithin(p, ref, RunBlock(p, HalfGemmKernel::kBf16Dot));
      }
      if (CanRunHalfGemmKernel(HalfGemmKernel::kAmx)) {
        ExpectWithin(p, ref, RunBlock(p, HalfGemmKernel::kAmx));
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// The fused epilogue (Note [GEMM epilogue]) gives the bits of the product followed by the
// AVX-512 BiasAdd, BiasGeluForward and GeluForward kernels (and, with a residual, AddInPlace),
// for any split of C, including the large and negative pre-activations where GELU saturates.
TEST(GemmF32Block, EpilogueGivesTheBitsOfTheSeparatePasses) {
  if (!HaveGemmHalfAvx512()) GTEST_SKIP() << "no AVX-512";
  for (int t = 0; t < 4; ++t) {
    for (Shape s : {Shape{67, 101, 457}, Shape{30, 1100, 40}}) {
      Problem p = MakeProblem(true, t & 1, t & 2, s, {1.0f, 0.0f}, 0, 990 + t);
      for (float& x : p.a) x *= 8.0f;  // pre-activations well past GELU's bend
      std::vector<float> bias(p.n);
      for (int j = 0; j < p.n; ++j) bias[j] = 0.25f * static_cast<float>(j % 13) - 1.5f;
      // Separate passes.
      std::vector<float> plain = RunF32(p, 0, p.m, 0, p.n, p.c);
      std::vector<float> with_bias = plain;
      BiasAdd(with_bias.data(), bias.data(), p.m, p.n, Isa::kAvx512);
      std::vector<float> residual(plain.size()), with_residual = with_bias;
      for (size_t i = 0; i < residual.size(); ++i) {
        residual[i] = static_cast<float>(static_cast<int>(i * 7919 % 2001) - 1000) / 37.0f;
      }
      AddInPlace(with_residual.data(), residual.data(), residual.size(), Isa::kAvx512);
      std::vector<float> pre(plain.size()), act(plain.size()), act_of_pre(plain.size());
      BiasGeluForward(plain.data(), bias.data(), pre.data(), act.data(), p.m, p.n, Isa::kAvx512);
      GeluForward(pre.data(), act_of_pre.data(), pre.size(), Isa::kAvx512);
      EXPECT_TRUE(SameBits(act, act_of_pre));
      // Fused, whole and split by rows and columns.
      for (auto [m0, m1, n0, n1] :
           {std::tuple{0, p.m, 0, p.n}, std::tuple{5, 19, 0, p.n}, std::tuple{0, p.m, 33, p.n}}) {
        std::vector<float> c1 = RunF32(p, 0, p.m, 0, p.n, p.c);  // C outside the range: plain
        GemmF32Block(p.ta, p.tb, p.m, p.n, p.k, 1.0f, p.a.data(), p.lda, p.b.data(), p.ldb, 0.0f,
                     c1.data(), p.ldc, m0, m1, n0, n1, GemmEpilogue{bias.data(), nullptr, 0});
        std::vector<float> c2 = plain, a2 = act;
        GemmF32Block(p.ta, p.tb, p.m, p.n, p.k, 1.0f, p.a.data(), p.lda, p.b.data(), p.ldb, 0.0f,
                     c2.data(), p.ldc, m0, m1, n0, n1, GemmEpilogue{bias.data(), a2.data(), p.n});
        std::vector<float> c3 = plain;
        GemmEpilogue with_res{bias.data(), nullptr, p.n};
        with_res.residual = residual.data();
        GemmF32Block(p.ta, p.tb, p.m, p.n, p.k, 1.0f, p.a.data(), p.lda, p.b.data(), p.ldb, 0.0f,
                     c3.data(), p.ldc, m0, m1, n0, n1, with_res);
        for (int i = m0; i < m1; ++i) {
          for (int j = n0; j < n1; ++j) {
            const size_t at = static_cast<size_t>(i) * p.n + j;
            ASSERT_EQ(std::memcmp(&c1[at], &with_bias[at], 4), 0)
                << "bias (" << i << "," << j << ")";
            ASSERT_EQ(std::memcmp(&c2[at], &pre[at], 4), 0) << "pre (" << i << "," << j << ")";
            ASSERT_EQ(std::memcmp(&a2[at], &act[at], 4), 0) << "gelu (" << i << "," << j << ")";
            ASSERT_EQ(std::memcmp(&c3[at], &with_residual[at], 4), 0)
                << "residual (" << i << "," << j << ")";
          }
        }
      }
    }
  }
}

// k == 0 and alpha == 0 only scale C, never read A or B (NaN there must not leak in), and
// beta == 0 overwrites NaN in C.
TEST(GemmHalfBlock, DegenerateScalings) {
  if (!HaveGemmHalfAvx512()) GTEST_SKIP() << "no AVX-512";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<uint16_t> nan16(64, 0x7FC0);  // bf16 NaN
  std::vector<float> c(12, 2.0f);
  GemmHalfBlock(true, false, true, 3, 4, 0, 1.0f, nan16.data(), 1, nan16.data(), 1, 0.5f, c.data(),
                4, 0, 3, 0, 4, HalfGemmKernel::kFma);
  for (float v : c) EXPECT_EQ(v, 1.0f);
  GemmHalfBlock(true, false, true, 3, 4, 5, 0.0f, nan16.data(), 5, nan16.data(), 5, 2.0f, c.data(),
                4, 0, 3, 0, 4, HalfGemmKernel::kFma);
  for (float v : c) EXPECT_EQ(v, 2.0f);
  c.assign(12, nan);
  GemmHalfBlock(true, false, true, 3, 4, 0, 1.0f, nullptr, 1, nullptr, 1, 0.0f, c.data(), 4, 0, 3,
                0, 4, HalfGemmKernel::kFma);
  for (float v : c) EXPECT_EQ(v, 0.0f);
}

// GemmHalf runs GemmHalfBlock (bf16: with Bf16GemmKernel()) when KernelIsa() is AVX-512, and
// the widening path otherwise. ctest also runs this with PIPEWRIGHT_CPU_ISA=avx2 (and
// PIPEWRIGHT_BF16_GEMM=dot), where it must widen (and use vdpbf16ps).
TEST(GemmHalfDispatch, FollowsIsa) {
  const char* forced = std::getenv("PIPEWRIGHT_CPU_ISA");
  if (forced != nullptr && std::string(forced) != "avx512") {
    EXPECT_NE(KernelIsa(), Isa::kAvx512) << "PIPEWRIGHT_CPU_ISA=" << forced;
  }
  const char* kernel_env = std::getenv("PIPEWRIGHT_BF16_GEMM");
  if (kernel_env != nullptr && std::string(kernel_env) == "dot" &&
      CanRunHalfGemmKernel(HalfGemmKernel::kBf16Dot)) {
    EXPECT_EQ(Bf16GemmKernel(), HalfGemmKernel::kBf16Dot);
  }
  for (bool is_bf16 : {true, false}) {
    const Problem p = MakeProblem(is_bf16, false, true, {70, 90, 777}, {1.0f, 0.0f}, 0, 77);
    const std::vector<float> got = RunGemmHalf(p, KernelIsa());
    if (KernelIsa() == Isa::kAvx512) {
      const HalfGemmKernel kernel = is_bf16 ? Bf16GemmKernel() : HalfGemmKernel::kFma;
      EXPECT_TRUE(SameBits(got, RunBlock(p, kernel))) << Describe(p);
    } else {
      EXPECT_TRUE(SameBits(got, RunGemmHalf(p, Isa::kBaseline))) << Describe(p);
    }
  }
}

// The CPU bf16 paths agree with each other far inside the 1e-4 relative (Frobenius) tolerance
// that docs/precision.md states for CPU vs CUDA, on the shapes CudaGemm.Bf16MatchesCpu uses.
TEST(GemmHalfDispatch, NativeAndWideningAgreeWithinTheCudaTolerance) {
  if (!HaveGemmHalfAvx512()) GTEST_SKIP() << "no AVX-512";
  const struct {
    Shape s;
    int pad;
    Scaling sc;
  } cases[] = {{{19, 23, 37}, 1, {1.0f, 0.5f}},
               {{128, 256, 64}, 0, {1.0f, 0.0f}},
               {{65, 31, 129}, 3, {-0.5f, 0.0f}},
               {{1024, 256, 1024}, 0, {1.0f, 1.0f}}};
  uint32_t seed = 300;
  for (const auto& cs : cases) {
    for (int t = 0; t < 4; ++t) {
      const Problem p = MakeProblem(true, t & 1, t & 2, cs.s, cs.sc, cs.pad, seed++);
      const std::vector<float> native = RunBlock(p, Bf16GemmKernel());
      const std::vector<float> widened = RunGemmHalf(p, Isa::kBaseline);
      double num = 0, den = 0;
      for (int i = 0; i < p.m; ++i) {
        for (int j = 0; j < p.n; ++j) {
          const size_t idx = static_cast<size_t>(i) * p.ldc + j;
          num += (static_cast<double>(native[idx]) - widened[idx]) * (native[idx] - widened[idx]);
          den += static_cast<double>(widened[idx]) * widened[idx];
        }
      }
      EXPECT_LT(std::sqrt(num / den), 1e-5) << Describe(p);
    }
  }
}

}  // namespace
}  // namespace pipewright::cpu
