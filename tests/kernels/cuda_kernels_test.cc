// Tests of the CUDA kernels (kernels/cuda/cuda_kernels.cuh) against the CPU reference kernels.
// Inputs are fresh random values; outputs are poisoned with NaN (all-ones bytes) before every
// launch so an element the kernel forgets to write fails the check; sizes are deliberately not
// multiples of the tile sizes. Accuracy is the relative error ||out - ref|| / ||ref|| with
// dtype-appropriate bounds. Every test skips when no CUDA device is present.
#include "kernels/cuda/cuda_kernels.cuh"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/device.h"
#include "pipewright/ops.h"
#include "pipewright/tensor.h"

namespace pipewright::cuda {
namespace {

#define PW_ASSERT_OK(expr)                                           \
  do {                                                               \
    const ::absl::Status pw_test_status_ = (expr);                   \
    ASSERT_TRUE(pw_test_status_.ok()) << pw_test_status_.ToString(); \
  } while (0)

#define PW_ASSERT_CUDA(expr)                                                                   \
  do {                                                                                         \
    const cudaError_t pw_test_err_ = (expr);                                                   \
    ASSERT_EQ(pw_test_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(pw_test_err_); \
  } while (0)

// A device array owned by the test. Allocation failures are reported as test failures.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (n_ > 0) {
      const cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T));
      if (err != cudaSuccess) {
        ADD_FAILURE() << "cudaMalloc: " << cudaGetErrorString(err);
        p_ = nullptr;
      }
    }
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  ~DeviceArray() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }

  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), n_);
    if (n_ > 0) {
      PW_ASSERT_CUDA(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    }
  }
  // All bytes 0xFF: NaN for float/double/bf16/half, -1 for integers.
  void Poison() {
    if (n_ > 0) {
      EXPECT_EQ(cudaMemset(p_, 0xFF, n_ * sizeof(T)), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    if (n_ > 0) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreate(&s_), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  void Sync() const { EXPECT_EQ(cudaStreamSynchronize(s_), cudaSuccess); }

 private:
  cudaStream_t s_ = nullptr;
};

std::vector<float> RandomVec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

template <typename T>
bool IsFinite(T v) {
  return std::isfinite(static_cast<double>(v));
}

// ||got - want|| / ||want|| over every element; got must be finite everywhere.
template <typename G, typename W>
void ExpectRelErr(const std::vector<G>& got, const std::vector<W>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first_bad = 0;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!IsFinite(got[i])) {
      if (bad++ == 0) first_bad = i;
      continue;
    }
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    num += d * d;
    den += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " non-finite elements, first at " << first_bad;
  const double rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  EXPECT_LT(rel, tol) << what << ": relative error " << rel << " over " << got.size()
                      << " elements";
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---------------------------------------------------------------- GEMM

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
      cv = beta == 0 ? alpha * s : alpha * s + beta * cv;
    }
  }
}

struct GemmShape {
  int m, n, k, pad;
  float alpha, beta;
};

// The m x n region of a row-major matrix with stride ld.
template <typename T>
std::vector<T> Region(const std::vector<T>& c, int m, int n, int ld) {
  std::vector<T> out;
  out.reserve(static_cast<size_t>(m) * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) out.push_back(c[static_cast<size_t>(i) * ld + j]);
  }
  return out;
}

// Padding columns [n, ld) must be bit-identical to `before`.
void ExpectPaddingUntouched(const std::vector<float>& after, const std::vector<float>& before,
                            int m, int n, int ld, const std::string& what) {
  size_t changed = 0;
  for (int i = 0; i < m; ++i) {
    for (int j = n; j < ld; ++j) {
      const size_t idx = static_cast<size_t>(i) * ld + j;
      changed += FloatBits(after[idx]) != FloatBits(before[idx]);
    }
  }
  EXPECT_EQ(changed, 0u) << what << ": padding columns were written";
}

void CheckGemmF32(bool allow_tf32, double tol) {
  auto blas_or = Blas::Create(0);
  ASSERT_TRUE(blas_or.ok()) << blas_or.status().ToString();
  Blas& blas = **blas_or;
  Stream stream;
  const GemmShape shapes[] = {
      {1, 1, 1, 0, 1.0f, 0.0f},     {13, 9, 17, 3, 0.5f, 0.0f},   {7, 11, 5, 2, -1.5f, 0.75f},
      {33, 65, 47, 5, 1.0f, -2.0f}, {128, 96, 64, 0, 1.0f, 0.0f}, {257, 129, 300, 1, 1.0f, 1.0f},
  };
  uint32_t seed = 11;
  for (const auto& s : shapes) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        const int a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
        const int b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
        const int lda = a_cols + s.pad, ldb = b_cols + s.pad, ldc = s.n + s.pad;
        auto a = RandomVec(static_cast<size_t>(a_rows) * lda, seed++);
        auto b = RandomVec(static_cast<size_t>(b_rows) * ldb, seed++);
        std::vector<float> c = RandomVec(static_cast<size_t>(s.m) * ldc, seed++);
        // beta == 0 must overwrite garbage: start from NaN everywhere.
        if (s.beta == 0.0f) c.assign(c.size(), std::numeric_limits<float>::quiet_NaN());
        std::vector<double> want(c.begin(), c.end());
        NaiveGemm(ta, tb, s.m, s.n, s.k, s.alpha, a, lda, b, ldb, s.beta, want, ldc);
        DeviceArray<float> da(a), db(b), dc(c);
        PW_ASSERT_OK(Gemm(stream.get(), blas, ta, tb, s.m, s.n, s.k, s.alpha, da.get(), lda,
                          db.get(), ldb, s.beta, dc.get(), ldc, allow_tf32));
        stream.Sync();
        const auto got = dc.Download();
        const std::string what = "gemm m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
                                 " k=" + std::to_string(s.k) + " ta=" + std::to_string(ta) +
                                 " tb=" + std::to_string(tb) + (allow_tf32 ? " tf32" : " fp32");
        ExpectRelErr(Region(got, s.m, s.n, ldc), Region(want, s.m, s.n, ldc), tol, what);
        ExpectPaddingUntouched(got, c, s.m, s.n, ldc, what);
      }
    }
  }
}

TEST(CudaGemm, Fp32MatchesNaive) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CheckGemmF32(/*allow_tf32=*/false, 1e-5);
}

TEST(CudaGemm, Tf32MatchesNaive) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // TF32 keeps 10 mantissa bits; the tensor cores may truncate rather than round the fp32
  // inputs, which allows up to ~2e-3 on a single product (the 1x1x1 shape).
  CheckGemmF32(/*allow_tf32=*/true, 3e-3);
}

TEST(CudaGemm, KZeroAndAlphaZeroOnlyScaleC) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto blas_or = Blas::Create(0);
  ASSERT_TRUE(blas_or.ok()) << blas_or.status().ToString();
  Stream stream;
  const int m = 5, n = 7, ldc = 9;
  auto c = RandomVec(static_cast<size_t>(m) * ldc, 5);
  DeviceArray<float> dc(c);
  PW_ASSERT_OK(Gemm(stream.get(), **blas_or, false, false, m, n, 0, 1.0f, nullptr, 1, nullptr, n,
                    0.5f, dc.get(), ldc, false));
  auto got = dc.Download();
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < ldc; ++j) {
      const size_t idx = static_cast<size_t>(i) * ldc + j;
      EXPECT_EQ(got[idx], j < n ? 0.5f * c[idx] : c[idx]) << i << "," << j;
    }
  }
  // alpha == 0, beta == 0: exact zeros even over NaN.
  dc.Poison();
  auto a = RandomVec(static_cast<size_t>(m) * 3, 6), b = RandomVec(static_cast<size_t>(3) * n, 7);
  DeviceArray<float> da(a), db(b);
  PW_ASSERT_OK(Gemm(stream.get(), **blas_or, false, false, m, n, 3, 0.0f, da.get(), 3, db.get(), n,
                    0.0f, dc.get(), ldc, true));
  got = dc.Download();
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) EXPECT_EQ(got[static_cast<size_t>(i) * ldc + j], 0.0f);
  }
  // Bad leading dimension is an argument error, not a crash.
  EXPECT_EQ(Gemm(stream.get(), **blas_or, false, false, m, n, 3, 1.0f, da.get(), 2, db.get(), n,
                 0.0f, dc.get(), ldc, false)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

void To16(bool is_bf16, const std::vector<float>& in, std::vector<uint16_t>& out,
          std::vector<float>& widened) {
  out.resize(in.size());
  widened.resize(in.size());
  if (is_bf16) {
    cpu::FloatToBf16(in.data(), out.data(), in.size());
    cpu::Bf16ToFloat(out.data(), widened.data(), in.size());
  } else {
    cpu::FloatToHalf(in.data(), out.data(), in.size());
    cpu::HalfToFloat(out.data(), widened.data(), in.size());
  }
}

void CheckGemmHalf(bool is_bf16) {
  auto blas_or = Blas::Create(0);
  ASSERT_TRUE(blas_or.ok()) << blas_or.status().ToString();
  Blas& blas = **blas_or;
  Stream stream;
  const double dtype_tol = is_bf16 ? 1e-2 : 2e-3;
  const GemmShape shapes[] = {
      {19, 23, 37, 1, 1.0f, 0.5f}, {128, 256, 64, 0, 1.0f, 0.0f}, {65, 31, 129, 3, -0.5f, 0.0f}};
  uint32_t seed = 100;
  for (const auto& s : shapes) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        const int a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
        const int b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
        const int lda = a_cols + s.pad, ldb = b_cols + s.pad, ldc = s.n + s.pad;
        auto a = RandomVec(static_cast<size_t>(a_rows) * lda, seed++);
        auto b = RandomVec(static_cast<size_t>(b_rows) * ldb, seed++);
        std::vector<uint16_t> a16, b16;
        std::vector<float> ar, br;
        To16(is_bf16, a, a16, ar);
        To16(is_bf16, b, b16, br);
        std::vector<float> c = RandomVec(static_cast<size_t>(s.m) * ldc, seed++);
        if (s.beta == 0.0f) c.assign(c.size(), std::numeric_limits<float>::quiet_NaN());
        // Reference 1: the CPU GemmHalf on the same 16-bit inputs (fp32 accumulation).
        std::vector<float> ref = c;
        cpu::GemmHalf(is_bf16, ta, tb, s.m, s.n, s.k, s.alpha, a16.data(), lda, b16.data(), ldb,
                      s.beta, ref.data(), ldc);
        // Reference 2: exact product of the unrounded fp32 inputs.
        std::vector<double> full(c.begin(), c.end());
        NaiveGemm(ta, tb, s.m, s.n, s.k, s.alpha, a, lda, b, ldb, s.beta, full, ldc);

        DeviceArray<uint16_t> da(a16), db(b16);
        DeviceArray<float> dc(c);
        PW_ASSERT_OK(GemmHalf(stream.get(), blas, is_bf16, ta, tb, s.m, s.n, s.k, s.alpha, da.get(),
                              lda, db.get(), ldb, s.beta, dc.get(), ldc));
        stream.Sync();
        const auto got = dc.Download();
        const std::string what = std::string(is_bf16 ? "bf16" : "fp16") +
                                 " m=" + std::to_string(s.m) + " ta=" + std::to_string(ta) +
                                 " tb=" + std::to_string(tb);
        ExpectRelErr(Region(got, s.m, s.n, ldc), Region(ref, s.m, s.n, ldc), 1e-4,
                     what + " vs cpu::GemmHalf");
        ExpectRelErr(Region(got, s.m, s.n, ldc), Region(full, s.m, s.n, ldc), dtype_tol,
                     what + " vs fp32 inputs");
        ExpectPaddingUntouched(got, c, s.m, s.n, ldc, what);

        // 16-bit output: the same product rounded once to 16 bits (C read as 16 bits).
        std::vector<uint16_t> c16;
        std::vector<float> cr;
        std::vector<float> c_in = RandomVec(static_cast<size_t>(s.m) * ldc, seed++);
        To16(is_bf16, c_in, c16, cr);
        std::vector<float> ref16 = cr;
        cpu::GemmHalf(is_bf16, ta, tb, s.m, s.n, s.k, s.alpha, a16.data(), lda, b16.data(), ldb,
                      s.beta, ref16.data(), ldc);
        DeviceArray<uint16_t> dc16(c16);
        if (s.beta == 0.0f) dc16.Poison();
        PW_ASSERT_OK(GemmHalfOut(stream.get(), blas, is_bf16, ta, tb, s.m, s.n, s.k, s.alpha,
                                 da.get(), lda, db.get(), ldb, s.beta, dc16.get(), ldc));
        stream.Sync();
        const auto got16 = dc16.Download();
        std::vector<float> got16f(got16.size());
        if (is_bf16) {
          cpu::Bf16ToFloat(got16.data(), got16f.data(), got16.size());
        } else {
          cpu::HalfToFloat(got16.data(), got16f.data(), got16.size());
        }
        ExpectRelErr(Region(got16f, s.m, s.n, ldc), Region(ref16, s.m, s.n, ldc), dtype_tol,
                     what + " GemmHalfOut");
      }
    }
  }
}

TEST(CudaGemm, Bf16MatchesCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CheckGemmHalf(true);
}

TEST(CudaGemm, Fp16MatchesCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CheckGemmHalf(false);
}

// ---------------------------------------------------------------- elementwise

constexpr int kRows = 37;
constexpr int kCols = 1000;

TEST(CudaElementwise, BiasAddAndBackward) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const int rows = 517, cols = kCols;  // rows not a multiple of the 16 row lanes
  auto y = RandomVec(static_cast<size_t>(rows) * cols, 1);
  auto bias = RandomVec(cols, 2);
  auto dbias = RandomVec(cols, 3);  // accumulates onto existing values
  DeviceArray<float> dy(y), dbias_d(bias), dacc(dbias);
  PW_ASSERT_OK(BiasAdd(stream.get(), dy.get(), dbias_d.get(), rows, cols));
  std::vector<float> want = y;
  cpu::BiasAdd(want.data(), bias.data(), rows, cols);
  ExpectRelErr(dy.Download(), want, 1e-6, "BiasAdd");

  DeviceArray<float> dgrad(y);
  PW_ASSERT_OK(BiasBackward(stream.get(), dgrad.get(), dacc.get(), rows, cols));
  std::vector<double> want_db(dbias.begin(), dbias.end());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) want_db[c] += y[static_cast<size_t>(r) * cols + c];
  }
  ExpectRelErr(dacc.Download(), want_db, 1e-5, "BiasBackward");
}

TEST(CudaElementwise, AddScaleGelu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const size_t n = static_cast<size_t>(kRows) * kCols + 3;
  auto a = RandomVec(n, 10, -4.0f, 4.0f), b = RandomVec(n, 11, -4.0f, 4.0f);
  DeviceArray<float> da(a), db(b), dout(n);

  dout.Poison();
  PW_ASSERT_OK(Add(stream.get(), da.get(), db.get(), dout.get(), n));
  std::vector<float> want(n);
  cpu::Add(a.data(), b.data(), want.data(), n);
  ExpectRelErr(dout.Download(), want, 1e-7, "Add");

  DeviceArray<float> dy(a);
  PW_ASSERT_OK(AddInPlace(stream.get(), dy.get(), db.get(), n));
  want = a;
  cpu::AddInPlace(want.data(), b.data(), n);
  ExpectRelErr(dy.Download(), want, 1e-7, "AddInPlace");

  DeviceArray<float> dx(a);
  PW_ASSERT_OK(Scale(stream.get(), dx.get(), n, -0.37f));
  want = a;
  cpu::Scale(want.data(), n, -0.37f);
  ExpectRelErr(dx.Download(), want, 1e-7, "Scale");

  dout.Poison();
  PW_ASSERT_OK(GeluForward(stream.get(), da.get(), dout.get(), n));
  cpu::GeluForward(a.data(), want.data(), n);
  ExpectRelErr(dout.Download(), want, 1e-5, "GeluForward");

  dout.Poison();
  PW_ASSERT_OK(GeluBackward(stream.get(), da.get(), db.get(), dout.get(), n));
  cpu::GeluBackward(a.data(), b.data(), want.data(), n);
  ExpectRelErr(dout.Download(), want, 1e-5, "GeluBackward");

  // In place (dx aliases dy), as the CPU allows.
  DeviceArray<float> dinplace(b);
  PW_ASSERT_OK(GeluBackward(stream.get(), da.get(), dinplace.get(), dinplace.get(), n));
  ExpectRelErr(dinplace.Download(), want, 1e-5, "GeluBackward in place");
}

TEST(CudaElementwise, BiasGeluForwardFused) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const size_t n = static_cast<size_t>(kRows) * kCols;
  auto x = RandomVec(n, 20, -3.0f, 3.0f);
  auto bias = RandomVec(kCols, 21);
  std::vector<float> pre = x;
  cpu::BiasAdd(pre.data(), bias.data(), kRows, kCols);
  std::vector<float> want(n);
  cpu::GeluForward(pre.data(), want.data(), n);

  DeviceArray<float> dx(x), db(bias), dpre(n), dy(n);
  dpre.Poison();
  dy.Poison();
  PW_ASSERT_OK(
      BiasGeluForward(stream.get(), dx.get(), db.get(), dpre.get(), dy.get(), kRows, kCols));
  ExpectRelErr(dpre.Download(), pre, 1e-7, "BiasGeluForward pre");
  ExpectRelErr(dy.Download(), want, 1e-5, "BiasGeluForward y");

  dy.Poison();
  PW_ASSERT_OK(BiasGeluForward(stream.get(), dx.get(), db.get(), nullptr, dy.get(), kRows, kCols));
  ExpectRelErr(dy.Download(), want, 1e-5, "BiasGeluForward without pre");
}

// ---------------------------------------------------------------- LayerNorm

TEST(CudaLayerNorm, ForwardAndBackwardMatchCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const int rows = kRows, cols = kCols;
  const size_t n = static_cast<size_t>(rows) * cols;
  auto x = RandomVec(n, 30, 2.0f, 4.0f);  // a large mean: exercises the two-pass variance
  auto gamma = RandomVec(cols, 31, 0.5f, 1.5f), beta = RandomVec(cols, 32);
  auto dy = RandomVec(n, 33);
  auto dgamma0 = RandomVec(cols, 34), dbeta0 = RandomVec(cols, 35);
  const float eps = 1e-5f;

  std::vector<float> y(n), mean(rows), rstd(rows), dx(n);
  cpu::LayerNormForward(x.data(), gamma.data(), beta.data(), y.data(), mean.data(), rstd.data(),
                        rows, cols, eps);
  cpu::LayerNormBackwardInput(x.data(), gamma.data(), mean.data(), rstd.data(), dy.data(),
                              dx.data(), rows, cols);
  std::vector<float> dgamma = dgamma0, dbeta = dbeta0;
  cpu::LayerNormBackwardWeight(x.data(), mean.data(), rstd.data(), dy.data(), dgamma.data(),
                               dbeta.data(), rows, cols);

  DeviceArray<float> dx_in(x), dgam(gamma), dbet(beta), dy_d(dy), y_d(n), mean_d(rows),
      rstd_d(rows), dx_d(n), dgamma_d(dgamma0), dbeta_d(dbeta0);
  y_d.Poison();
  mean_d.Poison();
  rstd_d.Poison();
  dx_d.Poison();
  PW_ASSERT_OK(LayerNormForward(stream.get(), dx_in.get(), dgam.get(), dbet.get(), y_d.get(),
                                mean_d.get(), rstd_d.get(), rows, cols, eps));
  ExpectRelErr(y_d.Download(), y, 1e-5, "LayerNorm y");
  ExpectRelErr(mean_d.Download(), mean, 1e-6, "LayerNorm mean");
  ExpectRelErr(rstd_d.Download(), rstd, 1e-6, "LayerNorm rstd");
  // The backward runs on the CPU's saved statistics so only the kernel itself is compared.
  mean_d.Upload(mean);
  rstd_d.Upload(rstd);
  PW_ASSERT_OK(LayerNormBackwardInput(stream.get(), dx_in.get(), dgam.get(), mean_d.get(),
                                      rstd_d.get(), dy_d.get(), dx_d.get(), rows, cols));
  ExpectRelErr(dx_d.Download(), dx, 1e-5, "LayerNorm dx");
  PW_ASSERT_OK(LayerNormBackwardWeight(stream.get(), dx_in.get(), mean_d.get(), rstd_d.get(),
                                       dy_d.get(), dgamma_d.get(), dbeta_d.get(), rows, cols));
  ExpectRelErr(dgamma_d.Download(), dgamma, 1e-5, "LayerNorm dgamma");
  ExpectRelErr(dbeta_d.Download(), dbeta, 1e-5, "LayerNorm dbeta");
}

// ---------------------------------------------------------------- cross-entropy

void CheckCrossEntropy(int rows, int vocab, uint32_t seed) {
  Stream stream;
  auto logits = RandomVec(static_cast<size_t>(rows) * vocab, seed, -5.0f, 5.0f);
  std::vector<int32_t> targets(rows);
  std::mt19937 gen(seed + 1);
  for (int r = 0; r < rows; ++r) {
    targets[r] = (r % 5 == 3) ? -1 : static_cast<int32_t>(gen() % vocab);
  }
  targets[rows - 1] = vocab - 1;  // the last class is reachable
  int64_t count = 0;
  const double want_sum =
      cpu::SoftmaxCrossEntropyForward(logits.data(), targets.data(), rows, vocab, &count);
  std::vector<double> want_rows(rows);
  for (int r = 0; r < rows; ++r) {
    want_rows[r] = cpu::SoftmaxCrossEntropyForward(logits.data() + static_cast<size_t>(r) * vocab,
                                                   &targets[r], 1, vocab, nullptr);
  }
  const float scale = 1.0f / static_cast<float>(count);
  std::vector<float> want_grad(logits.size());
  cpu::SoftmaxCrossEntropyBackward(logits.data(), targets.data(), rows, vocab, scale,
                                   want_grad.data());

  DeviceArray<float> dlogits(logits), dgrad(logits.size());
  DeviceArray<int32_t> dtargets(targets);
  DeviceArray<double> row_loss(rows), loss_sum(1);
  DeviceArray<int64_t> dcount(1);
  row_loss.Poison();
  loss_sum.Poison();
  dcount.Poison();
  dgrad.Poison();
  PW_ASSERT_OK(SoftmaxCrossEntropyForward(stream.get(), dlogits.get(), dtargets.get(), rows, vocab,
                                          row_loss.get(), loss_sum.get(), dcount.get()));
  PW_ASSERT_OK(SoftmaxCrossEntropyBackward(stream.get(), dlogits.get(), dtargets.get(), rows, vocab,
                                           scale, dgrad.get()));
  stream.Sync();
  const std::string what = "vocab=" + std::to_string(vocab);
  EXPECT_EQ(dcount.Download()[0], count) << what;
  EXPECT_NEAR(loss_sum.Download()[0], want_sum, 1e-6 * std::fabs(want_sum)) << what;
  ExpectRelErr(row_loss.Download(), want_rows, 1e-6, what + " row losses");
  const auto got_grad = dgrad.Download();
  ExpectRelErr(got_grad, want_grad, 1e-5, what + " dlogits");
  for (int r = 0; r < rows; ++r) {
    if (targets[r] >= 0) continue;
    for (int j = 0; j < vocab; ++j) {
      ASSERT_EQ(got_grad[static_cast<size_t>(r) * vocab + j], 0.0f) << "ignored row " << r;
    }
  }
  // In place: dlogits aliases logits.
  PW_ASSERT_OK(SoftmaxCrossEntropyBackward(stream.get(), dlogits.get(), dtargets.get(), rows, vocab,
                                           scale, dlogits.get()));
  ExpectRelErr(dlogits.Download(), want_grad, 1e-5, what + " dlogits in place");
}

TEST(CudaCrossEntropy, MatchesCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CheckCrossEntropy(kRows, kCols, 40);
  CheckCrossEntropy(5, 50257, 41);
}

TEST(CudaCrossEntropy, NoRowsWritesZero) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  DeviceArray<double> loss_sum(1);
  DeviceArray<int64_t> dcount(1);
  loss_sum.Poison();
  dcount.Poison();
  PW_ASSERT_OK(SoftmaxCrossEntropyForward(stream.get(), nullptr, nullptr, 0, 10, nullptr,
                                          loss_sum.get(), dcount.get()));
  EXPECT_EQ(loss_sum.Download()[0], 0.0);
  EXPECT_EQ(dcount.Download()[0], 0);
}

// ---------------------------------------------------------------- attention

struct AttnShape {
  int B, T, C, H;
};

// Head dims 16, 20 (not a multiple of 8), 64, 100 and 128; T not a multiple of any tile.
const AttnShape kAttnShapes[] = {
    {2, 37, 64, 4},  {1, 33, 60, 3},  {1, 130, 256, 4},
    {2, 70, 200, 2}, {1, 65, 256, 2}, {1, 1, 64, 1},
};

std::string AttnName(const AttnShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
         " H=" + std::to_string(s.H);
}

// lse[b, h, i] = log sum_{j <= i} exp(q_i . k_j / sqrt(D)), in double.
std::vector<double> ReferenceLse(const std::vector<float>& qkv, const AttnShape& s) {
  const int D = s.C / s.H;
  const size_t ld = 3 * static_cast<size_t>(s.C);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> lse(static_cast<size_t>(s.B) * s.H * s.T);
  std::vector<double> sc(s.T);
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.H; ++h) {
      for (int i = 0; i < s.T; ++i) {
        const float* q = qkv.data() + (static_cast<size_t>(b) * s.T + i) * ld + h * D;
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          const float* k = qkv.data() + (static_cast<size_t>(b) * s.T + j) * ld + s.C + h * D;
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        lse[(static_cast<size_t>(b) * s.H + h) * s.T + i] = mx + std::log(sum);
      }
    }
  }
  return lse;
}

// The CPU kernel's forward: out [B,T,C] and lse [B,H,T] (the same saved state as CUDA's).
void CpuAttentionForward(const std::vector<float>& qkv, const AttnShape& s, std::vector<float>& out,
                         std::vector<float>& lse) {
  out.assign(static_cast<size_t>(s.B) * s.T * s.C, 0.0f);
  lse.assign(static_cast<size_t>(s.B) * s.H * s.T, 0.0f);
  std::vector<float> scratch(cpu::AttentionForwardScratchFloats(s.T, s.C, s.H));
  cpu::AttentionForward(qkv.data(), out.data(), lse.data(), s.T, s.C, s.H, 0, s.B * s.H,
                        scratch.data());
}

TEST(CudaAttention, ForwardMatchesCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  uint32_t seed = 50;
  for (const auto& s : kAttnShapes) {
    const size_t nqkv = static_cast<size_t>(s.B) * s.T * 3 * s.C;
    const size_t nout = static_cast<size_t>(s.B) * s.T * s.C;
    const size_t nlse = static_cast<size_t>(s.B) * s.H * s.T;
    auto qkv = RandomVec(nqkv, seed++, -1.5f, 1.5f);
    std::vector<float> out, lse;
    CpuAttentionForward(qkv, s, out, lse);
    DeviceArray<float> dqkv(qkv), dout(nout), dlse(nlse);
    dout.Poison();
    dlse.Poison();
    PW_ASSERT_OK(
        AttentionForward(stream.get(), dqkv.get(), dout.get(), dlse.get(), s.B, s.T, s.C, s.H));
    stream.Sync();
    const auto got_lse = dlse.Download();
    ExpectRelErr(dout.Download(), out, 1e-5, "attention out " + AttnName(s));
    ExpectRelErr(got_lse, ReferenceLse(qkv, s), 1e-5, "attention lse " + AttnName(s));
    ExpectRelErr(got_lse, lse, 1e-5, "attention lse vs cpu " + AttnName(s));
  }
}

// Incremental decoding's attention (generate --device cuda): the same rows as the CPU's decode
// kernel to fp32 rounding, for a prefix of cached positions and a few new rows, each head dim.
TEST(CudaAttention, DecodeMatchesCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  uint32_t seed = 90;
  struct Case {
    int start, n, C, H;
  };
  for (const Case c : {Case{0, 1, 8, 2}, Case{5, 1, 64, 2}, Case{37, 3, 96, 3},
                       Case{300, 2, 256, 2}, Case{11, 4, 48, 4}}) {
    const int keys = c.start + c.n;
    const auto q = RandomVec(static_cast<size_t>(c.n) * 3 * c.C, seed++, -1.5f, 1.5f);
    const auto kv = RandomVec(static_cast<size_t>(keys) * 2 * c.C, seed++, -1.5f, 1.5f);
    std::vector<float> want(static_cast<size_t>(c.n) * c.C),
        scratch(cpu::AttentionDecodeScratchFloats(keys, c.C, c.H));
    cpu::AttentionDecode(q.data(), 3 * c.C, kv.data(), 2 * c.C, want.data(), c.C, c.start, c.n, c.C,
                         c.H, 0, c.H, scratch.data());
    DeviceArray<float> dq(q), dkv(kv), dout(want.size());
    dout.Poison();
    PW_ASSERT_OK(AttentionDecode(stream.get(), dq.get(), 3 * c.C, dkv.get(), 2 * c.C, dout.get(),
                                 c.C, c.start, c.n, c.C, c.H));
    stream.Sync();
    ExpectRelErr(dout.Download(), want, 1e-5,
                 "decode start " + std::to_string(c.start) + " C " + std::to_string(c.C));
  }
  EXPECT_FALSE(
      AttentionDecode(stream.get(), nullptr, 3 * 8, nullptr, 16, nullptr, 8, 0, 1, 8, 3).ok())
      << "C % H != 0";
  EXPECT_FALSE(
      AttentionDecode(stream.get(), nullptr, 300, nullptr, 200, nullptr, 100, 20000, 1, 100, 1)
          .ok())
      << "more positions than the kernel holds";
}

// The Llama family's kernels against the CPU ops (runtime/ops/llama_ops.cc), each on random
// inputs: RMSNorm (both halves of its backward), the rotary turn and its inverse, SwiGLU, the
// GQA expansion and reduction, the token embedding and its gradient.
TEST(CudaLlama, KernelsMatchTheCpuOps) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const int rows = 37, cols = 96, T = 5, heads = 6, kv = 2, D = 16, F = 40, V = 50;
  const int C = heads * D, K = kv * D;
  auto host = [](const std::vector<float>& v, std::vector<int64_t> shape) {
    return Tensor::FromVector(std::move(shape), v);
  };
  const ops::Exec cpu{};
  // RMSNorm.
  const auto x = RandomVec(rows * cols, 101), w = RandomVec(cols, 102),
             dy = RandomVec(rows * cols, 103);
  Tensor y = Tensor::Empty({rows, cols}), rstd = Tensor::Empty({rows}),
         dx = Tensor::Empty({rows, cols});
  Tensor dw = Tensor::Zeros({cols});
  PW_ASSERT_OK(
      ops::RmsNormForward(cpu, host(x, {rows, cols}), host(w, {cols}), y, rstd, rows, cols, 1e-5f));
  PW_ASSERT_OK(ops::RmsNormBackwardInput(cpu, host(x, {rows, cols}), host(w, {cols}), rstd,
                                         host(dy, {rows, cols}), dx, rows, cols));
  PW_ASSERT_OK(ops::RmsNormBackwardWeight(cpu, host(x, {rows, cols}), rstd, host(dy, {rows, cols}),
                                          dw, rows, cols));
  DeviceArray<float> gx(x), gw(w), gdy(dy), gy(rows * cols), grs(rows), gdx(rows * cols),
      gdw(std::vector<float>(cols, 0.0f));
  PW_ASSERT_OK(
      RmsNormForward(stream.get(), gx.get(), gw.get(), gy.get(), grs.get(), rows, cols, 1e-5f));
  PW_ASSERT_OK(RmsNormBackwardInput(stream.get(), gx.get(), gw.get(), grs.get(), gdy.get(),
                                    gdx.get(), rows, cols));
  PW_ASSERT_OK(
      RmsNormBackwardWeight(stream.get(), gx.get(), grs.get(), gdy.get(), gdw.get(), rows, cols));
  stream.Sync();
  ExpectRelErr(gy.Download(), y.ToVector(), 1e-5, "rmsnorm");
  ExpectRelErr(gdx.Download(), dx.ToVector(), 1e-5, "rmsnorm backward");
  ExpectRelErr(gdw.Download(), dw.ToVector(), 1e-5, "rmsnorm weight backward");
  // Rope, forward and inverse, on a row layout with a leading column.
  const int ld = 2 * C + 3;
  const auto r = RandomVec(rows * ld, 104);
  for (bool inverse : {false, true}) {
    Tensor rc = host(r, {rows, ld});
    PW_ASSERT_OK(ops::Rope(cpu, rc, rows, T, ld, 3, 2 * heads, D, 500000.0, inverse));
    DeviceArray<float> gr(r);
    PW_ASSERT_OK(Rope(stream.get(), gr.get(), rows, T, ld, 3, 2 * heads, D, 500000.0, inverse));
    stream.Sync();
    ExpectRelErr(gr.Download(), rc.ToVector(), 1e-5, inverse ? "rope inverse" : "rope");
  }
  {  // rows of later positions (incremental decoding's `first`)
    Tensor rc = host(r, {rows, ld});
    PW_ASSERT_OK(ops::Rope(cpu, rc, rows, rows, ld, 3, 2 * heads, D, 500000.0, false, 77));
    DeviceArray<float> gr(r);
    PW_ASSERT_OK(
        Rope(stream.get(), gr.get(), rows, rows, ld, 3, 2 * heads, D, 500000.0, false, 77));
    stream.Sync();
    ExpectRelErr(gr.Download(), rc.ToVector(), 1e-5, "rope from position 77");
  }
  // SwiGLU.
  const auto gu = RandomVec(rows * 2 * F, 105), dout = RandomVec(rows * F, 106);
  Tensor so = Tensor::Empty({rows, F}), sd = Tensor::Empty({rows, 2 * F});
  PW_ASSERT_OK(ops::SwiGluForward(cpu, host(gu, {rows, 2 * F}), so, rows, F));
  PW_ASSERT_OK(
      ops::SwiGluBackward(cpu, host(gu, {rows, 2 * F}), host(dout, {rows, F}), sd, rows, F));
  DeviceArray<float> ggu(gu), gdo(dout), gso(rows * F), gsd(rows * 2 * F);
  PW_ASSERT_OK(SwiGluForward(stream.get(), ggu.get(), gso.get(), rows, F));
  PW_ASSERT_OK(SwiGluBackward(stream.get(), ggu.get(), gdo.get(), gsd.get(), rows, F));
  stream.Sync();
  ExpectRelErr(gso.Download(), so.ToVector(), 1e-5, "swiglu");
  ExpectRelErr(gsd.Download(), sd.ToVector(), 1e-5, "swiglu backward");
  // GQA expansion and reduction.
  const auto xq = RandomVec(rows * (C + 2 * K), 107), dq = RandomVec(rows * 3 * C, 108);
  Tensor ex = Tensor::Empty({rows, 3 * C}), rd = Tensor::Empty({rows, C + 2 * K});
  PW_ASSERT_OK(ops::ExpandKv(cpu, host(xq, {rows, C + 2 * K}), ex, rows, heads, kv, D));
  PW_ASSERT_OK(ops::ReduceKv(cpu, host(dq, {rows, 3 * C}), rd, rows, heads, kv, D));
  DeviceArray<float> gxq(xq), gdq(dq), gex(rows * 3 * C), grd(rows * (C + 2 * K));
  PW_ASSERT_OK(ExpandKv(stream.get(), gxq.get(), gex.get(), rows, heads, kv, D));
  PW_ASSERT_OK(ReduceKv(stream.get(), gdq.get(), grd.get(), rows, heads, kv, D));
  stream.Sync();
  EXPECT_EQ(gex.Download(), ex.ToVector()) << "expand kv copies";
  ExpectRelErr(grd.Download(), rd.ToVector(), 1e-6, "reduce kv");
  // Token embedding, with repeated tokens in the gradient.
  std::vector<int32_t> tok(rows);
  for (int i = 0; i < rows; ++i) tok[i] = (i * 7) % V;
  const auto table = RandomVec(V * cols, 109);
  Tensor tt = Tensor::Empty({rows}, DType::kI32);
  std::copy(tok.begin(), tok.end(), tt.data<int32_t>());
  Tensor eo = Tensor::Empty({rows, cols}), et = Tensor::Zeros({V, cols});
  PW_ASSERT_OK(ops::TokenEmbeddingForward(cpu, tt, host(table, {V, cols}), eo, rows, cols));
  PW_ASSERT_OK(ops::TokenEmbeddingBackward(cpu, tt, host(dy, {rows, cols}), et, rows, cols));
  DeviceArray<int32_t> gtok(tok);
  DeviceArray<float> gtab(table), geo(rows * cols), get(std::vector<float>(V * cols, 0.0f));
  PW_ASSERT_OK(TokenEmbeddingForward(stream.get(), gtok.get(), gtab.get(), geo.get(), rows, cols));
  PW_ASSERT_OK(TokenEmbeddingBackward(stream.get(), gtok.get(), gdy.get(), get.get(), rows, cols));
  stream.Sync();
  EXPECT_EQ(geo.Download(), eo.ToVector());
  EXPECT_EQ(get.Download(), et.ToVector()) << "the same adds in token order";
}

TEST(CudaAttention, BackwardMatchesCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  uint32_t seed = 60;
  for (const auto& s : kAttnShapes) {
    const size_t nqkv = static_cast<size_t>(s.B) * s.T * 3 * s.C;
    const size_t nout = static_cast<size_t>(s.B) * s.T * s.C;
    const size_t nlse = static_cast<size_t>(s.B) * s.H * s.T;
    auto qkv = RandomVec(nqkv, seed++, -1.5f, 1.5f);
    auto dout = RandomVec(nout, seed++);
    std::vector<float> out, lse, dqkv(nqkv),
        scratch(cpu::AttentionBackwardScratchFloats(s.T, s.C, s.H));
    CpuAttentionForward(qkv, s, out, lse);
    cpu::AttentionBackward(dout.data(), qkv.data(), out.data(), lse.data(), dqkv.data(), s.T, s.C,
                           s.H, 0, s.B * s.H, scratch.data());

    DeviceArray<float> d_qkv(qkv), d_dout(dout), d_out(nout), d_lse(nlse), d_dqkv(nqkv),
        d_scratch(nlse);
    PW_ASSERT_OK(
        AttentionForward(stream.get(), d_qkv.get(), d_out.get(), d_lse.get(), s.B, s.T, s.C, s.H));
    // Twice: from the CUDA forward's out and lse, then from the CPU forward's (the two devices
    // save the same state, so either backward accepts either forward's).
    for (const bool from_cpu : {false, true}) {
      if (from_cpu) {
        d_out.Upload(out);
        d_lse.Upload(lse);
      }
      d_dqkv.Poison();
      d_scratch.Poison();
      PW_ASSERT_OK(AttentionBackward(stream.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                                     d_lse.get(), d_dqkv.get(), d_scratch.get(), s.B, s.T, s.C,
                                     s.H));
      stream.Sync();
      const auto got = d_dqkv.Download();
      const std::string name = AttnName(s) + (from_cpu ? " (cpu out, lse)" : "");
      ExpectRelErr(got, dqkv, 2e-5, "attention dqkv " + name);
      // Each third separately, so a wrong dq cannot hide behind accurate dk/dv.
      for (int part = 0; part < 3; ++part) {
        std::vector<float> g, w;
        for (size_t row = 0; row < static_cast<size_t>(s.B) * s.T; ++row) {
          for (int c = 0; c < s.C; ++c) {
            const size_t idx = row * 3 * s.C + static_cast<size_t>(part) * s.C + c;
            g.push_back(got[idx]);
            w.push_back(dqkv[idx]);
          }
        }
        ExpectRelErr(g, w, 2e-5, std::string("attention ") + "qkv"[part] + " grad " + name);
      }
    }
  }
}

TEST(CudaAttention, RejectsBadShapes) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  EXPECT_EQ(AttentionForward(stream.get(), nullptr, nullptr, nullptr, 1, 4, 258, 1).code(),
            absl::StatusCode::kInvalidArgument);  // D = 258 > 128
  EXPECT_EQ(AttentionForward(stream.get(), nullptr, nullptr, nullptr, 1, 4, 10, 3).code(),
            absl::StatusCode::kInvalidArgument);  // C % H != 0
}

// ---------------------------------------------------------------- embedding

TEST(CudaEmbedding, ForwardAndBackwardBitwiseEqualCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const int B = 3, T = 37, C = 300, V = 200;  // V > 64 partitions; tokens repeat often
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
  std::mt19937 gen(70);
  for (auto& t : tokens) t = static_cast<int32_t>(gen() % V);
  tokens[0] = tokens[1] = tokens[5] = 7;  // guaranteed repeats
  auto wte = RandomVec(static_cast<size_t>(V) * C, 71),
       wpe = RandomVec(static_cast<size_t>(T) * C, 72);
  auto dout = RandomVec(static_cast<size_t>(B) * T * C, 73);
  auto dwte0 = RandomVec(wte.size(), 74), dwpe0 = RandomVec(wpe.size(), 75);

  std::vector<float> out(dout.size()), dwte = dwte0, dwpe = dwpe0;
  cpu::EmbeddingForward(tokens.data(), wte.data(), wpe.data(), out.data(), B, T, C);
  cpu::EmbeddingBackward(dout.data(), tokens.data(), dwte.data(), dwpe.data(), B, T, C);

  DeviceArray<int32_t> dtok(tokens);
  DeviceArray<float> dwte_d(wte), dwpe_d(wpe), dout_d(dout), out_d(dout.size()), gte(dwte0),
      gpe(dwpe0);
  out_d.Poison();
  PW_ASSERT_OK(
      EmbeddingForward(stream.get(), dtok.get(), dwte_d.get(), dwpe_d.get(), out_d.get(), B, T, C));
  EXPECT_TRUE(SameBits(out_d.Download(), out)) << "EmbeddingForward";
  PW_ASSERT_OK(
      EmbeddingBackward(stream.get(), dout_d.get(), dtok.get(), gte.get(), gpe.get(), B, T, C));
  const auto got_te = gte.Download(), got_pe = gpe.Download();
  ExpectRelErr(got_te, dwte, 1e-6, "dwte");
  ExpectRelErr(got_pe, dwpe, 1e-6, "dwpe");
  EXPECT_TRUE(SameBits(got_te, dwte)) << "dwte differs from the CPU bits";
  EXPECT_TRUE(SameBits(got_pe, dwpe)) << "dwpe differs from the CPU bits";
}

// Tensor parallelism's vocab-parallel kernels (ops::EmbeddingPart*, RowMax,
// CrossEntropyPart*): two parts of the vocabulary, their collectives done by hand (rows summed
// in rank order, maxima concatenated), against the whole-vocabulary CPU kernels.
TEST(CudaVocabParallel, TwoPartsMatchTheWholeEmbeddingAndLoss) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const int B = 3, T = 37, C = 96, V = 200, P = V / 2;
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
  std::mt19937 gen(80);
  for (auto& t : tokens) t = static_cast<int32_t>(gen() % V);
  const auto wte = RandomVec(static_cast<size_t>(V) * C, 81),
             wpe = RandomVec(static_cast<size_t>(T) * C, 82),
             dout = RandomVec(static_cast<size_t>(B) * T * C, 83);
  std::vector<float> out(dout.size()), dwte(wte.size(), 0.0f), dwpe(wpe.size(), 0.0f);
  cpu::EmbeddingForward(tokens.data(), wte.data(), wpe.data(), out.data(), B, T, C);
  cpu::EmbeddingBackward(dout.data(), tokens.data(), dwte.data(), dwpe.data(), B, T, C);
  DeviceArray<int32_t> dtok(tokens);
  DeviceArray<float> dwpe_d(wpe), dout_d(dout);
  std::vector<float> sum(out.size(), 0.0f);
  for (int r = 0; r < 2; ++r) {
    const std::vector<float> part(wte.begin() + static_cast<size_t>(r) * P * C,
                                  wte.begin() + static_cast<size_t>(r + 1) * P * C);
    DeviceArray<float> dpart(part), dout_part(out.size()), gte(part.size()), gpe(wpe.size());
    gte.Upload(std::vector<float>(part.size(), 0.0f));
    gpe.Upload(std::vector<float>(wpe.size(), 0.0f));
    dout_part.Poison();
    PW_ASSERT_OK(EmbeddingPartForward(stream.get(), dtok.get(), dpart.get(), r * P, P,
                                      r == 0 ? dwpe_d.get() : nullptr, dout_part.get(), B, T, C));
    const auto rows = dout_part.Download();
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = r == 0 ? rows[i] : sum[i] + rows[i];
    PW_ASSERT_OK(EmbeddingPartBackward(stream.get(), dout_d.get(), dtok.get(), r * P, P, gte.get(),
                                       gpe.get(), B, T, C));
    const std::vector<float> want(dwte.begin() + static_cast<size_t>(r) * P * C,
                                  dwte.begin() + static_cast<size_t>(r + 1) * P * C);
    EXPECT_TRUE(SameBits(gte.Download(), want)) << "dwte part " << r;
    EXPECT_TRUE(SameBits(gpe.Download(), dwpe)) << "dwpe on part " << r;
  }
  EXPECT_TRUE(SameBits(sum, out)) << "the parts' rank-order sum is the whole embedding";

  // The loss: rows of logits over V, two parts of P columns.
  const int rows = 29;
  const auto logits = RandomVec(static_cast<size_t>(rows) * V, 84, -4.0f, 4.0f);
  std::vector<int32_t> targets(rows);
  for (auto& t : targets) t = static_cast<int32_t>(gen() % V);
  targets[3] = -1;  // an ignored row
  int64_t count = 0;
  const double want_loss =
      cpu::SoftmaxCrossEntropyForward(logits.data(), targets.data(), rows, V, &count);
  std::vector<float> want_grad(logits.size());
  cpu::SoftmaxCrossEntropyBackward(logits.data(), targets.data(), rows, V, 0.5f, want_grad.data());
  DeviceArray<int32_t> dtargets(targets);
  std::vector<std::vector<float>> parts(2);
  std::vector<float> maxima;
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < rows; ++i) {
      const float* row = logits.data() + static_cast<size_t>(i) * V + r * P;
      parts[r].insert(parts[r].end(), row, row + P);
    }
    DeviceArray<float> dl(parts[r]), dmax(rows);
    PW_ASSERT_OK(RowMax(stream.get(), dl.get(), rows, P, dmax.get()));
    const auto m = dmax.Download();
    maxima.insert(maxima.end(), m.begin(), m.end());
  }
  DeviceArray<float> dmaxima(maxima);
  std::vector<double> reduced(2 * rows, 0.0), m_row;
  DeviceArray<double> s0(3 * rows), s1(3 * rows);
  DeviceArray<float> l0(parts[0]), l1(parts[1]);
  for (int r = 0; r < 2; ++r) {
    DeviceArray<double>& st = r == 0 ? s0 : s1;
    st.Poison();
    PW_ASSERT_OK(CrossEntropyPartStats(stream.get(), (r == 0 ? l0 : l1).get(), dtargets.get(),
                                       r * P, dmaxima.get(), 2, rows, P, st.get()));
    const auto h = st.Download();
    for (int i = 0; i < 2 * rows; ++i) reduced[i] = r == 0 ? h[i] : reduced[i] + h[i];
    m_row.assign(h.begin() + 2 * rows, h.end());
  }
  double loss = 0;
  for (int i = 0; i < rows; ++i) {
    if (targets[i] >= 0) loss += std::log(reduced[i]) + m_row[i] - reduced[rows + i];
  }
  EXPECT_NEAR(loss, want_loss, 1e-5 * std::abs(want_loss));
  std::vector<double> whole(reduced);
  whole.insert(whole.end(), m_row.begin(), m_row.end());
  DeviceArray<double> dstats(whole);
  std::vector<float> got_grad(logits.size());
  for (int r = 0; r < 2; ++r) {
    DeviceArray<float> dg(parts[r].size());
    dg.Poison();
    PW_ASSERT_OK(CrossEntropyPartBackward(stream.get(), (r == 0 ? l0 : l1).get(), dtargets.get(),
                                          r * P, dstats.get(), rows, P, 0.5f, dg.get()));
    const auto g = dg.Download();
    for (int i = 0; i < rows; ++i) {
      std::copy(g.begin() + static_cast<size_t>(i) * P, g.begin() + static_cast<size_t>(i + 1) * P,
                got_grad.begin() + static_cast<size_t>(i) * V + r * P);
    }
  }
  ExpectRelErr(got_grad, want_grad, 1e-5, "vocab-parallel dlogits");
}

// ---------------------------------------------------------------- AdamW

TEST(CudaOptimizer, AdamWMultiMatchesCpu) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  // 70 tensors: more than one launch's worth of kernel parameters; sizes around the chunk size.
  std::vector<int64_t> sizes;
  for (int i = 0; i < 70; ++i) sizes.push_back((i * 977) % 9000 + (i % 7 == 0 ? 0 : 1));
  sizes[3] = 100003;
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  struct Host {
    std::vector<float> p, m, v;
  };
  std::vector<Host> host(sizes.size());
  std::vector<std::unique_ptr<DeviceArray<float>>> dp, dg, dm, dv;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t n = static_cast<size_t>(sizes[i]);
    host[i].p = RandomVec(n, 1000 + i);
    host[i].m = RandomVec(n, 2000 + i, -0.1f, 0.1f);
    host[i].v = RandomVec(n, 3000 + i, 0.0f, 0.01f);
    dp.push_back(std::make_unique<DeviceArray<float>>(host[i].p));
    dm.push_back(std::make_unique<DeviceArray<float>>(host[i].m));
    dv.push_back(std::make_unique<DeviceArray<float>>(host[i].v));
    dg.push_back(std::make_unique<DeviceArray<float>>(n));
  }
  for (int64_t t = 1; t <= 3; ++t) {
    std::vector<AdamWTensor> list;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t n = static_cast<size_t>(sizes[i]);
      const float wd = (i % 3 == 0) ? 0.0f : 0.1f;
      auto g = RandomVec(n, 4000 + 100 * t + i);
      dg[i]->Upload(g);
      cpu::AdamWUpdate(host[i].p.data(), g.data(), host[i].m.data(), host[i].v.data(), n, lr, beta1,
                       beta2, eps, wd, t);
      list.push_back({dp[i]->get(), dg[i]->get(), dm[i]->get(), dv[i]->get(), sizes[i], wd});
    }
    PW_ASSERT_OK(AdamWMulti(stream.get(), list.data(), static_cast<int>(list.size()), lr, beta1,
                            beta2, eps, t));
    stream.Sync();
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;
    const std::string what = "tensor " + std::to_string(i);
    ExpectRelErr(dp[i]->Download(), host[i].p, 1e-6, what + " param");
    ExpectRelErr(dm[i]->Download(), host[i].m, 1e-6, what + " m");
    ExpectRelErr(dv[i]->Download(), host[i].v, 1e-6, what + " v");
  }
  EXPECT_EQ(AdamWMulti(stream.get(), nullptr, 0, lr, beta1, beta2, eps, 0).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- conversion

TEST(CudaConvert, MatchesCpuBits) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> in = {0.0f,
                           -0.0f,
                           1.0f,
                           -2.5f,
                           inf,
                           -inf,
                           std::numeric_limits<float>::quiet_NaN(),
                           65504.0f,
                           65519.0f,
                           65520.0f,
                           1e6f,
                           std::ldexp(1.0f, -24),
                           std::ldexp(1.0f, -25),
                           3 * std::ldexp(1.0f, -26),
                           std::ldexp(1.0f, -14),
                           1.0f + std::ldexp(1.0f, -8),
                           1.0f + 3 * std::ldexp(1.0f, -8),
                           1.0f + std::ldexp(1.0f, -11),
                           std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::min()};
  std::mt19937 gen(80);
  std::uniform_real_distribution<float> frac(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-30, 20);
  for (int i = 0; i < 10000; ++i) {
    const float v = std::ldexp(frac(gen), expo(gen));
    in.push_back(i % 2 ? v : -v);
  }
  const size_t n = in.size();
  DeviceArray<float> din(in), dback(65536);
  DeviceArray<uint16_t> d16(n);
  std::vector<uint16_t> want16(n);
  for (int is_bf16 = 0; is_bf16 < 2; ++is_bf16) {
    const char* name = is_bf16 ? "bf16" : "fp16";
    d16.Poison();
    if (is_bf16) {
      PW_ASSERT_OK(FloatToBf16(stream.get(), din.get(), d16.get(), n));
      cpu::FloatToBf16(in.data(), want16.data(), n);
    } else {
      PW_ASSERT_OK(FloatToHalf(stream.get(), din.get(), d16.get(), n));
      cpu::FloatToHalf(in.data(), want16.data(), n);
    }
    const auto got16 = d16.Download();
    for (size_t i = 0; i < n; ++i) {
      if (std::isnan(in[i])) {
        const float back = is_bf16 ? cpu::Bf16ToFloat(got16[i]) : cpu::HalfToFloat(got16[i]);
        EXPECT_TRUE(std::isnan(back)) << name << " NaN not preserved";
      } else {
        EXPECT_EQ(got16[i], want16[i]) << name << " of " << in[i] << " (index " << i << ")";
      }
    }
    // Every 16-bit pattern back to float.
    std::vector<uint16_t> all(65536);
    for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
    DeviceArray<uint16_t> dall(all);
    dback.Poison();
    std::vector<float> want(65536);
    if (is_bf16) {
      PW_ASSERT_OK(Bf16ToFloat(stream.get(), dall.get(), dback.get(), all.size()));
      cpu::Bf16ToFloat(all.data(), want.data(), all.size());
    } else {
      PW_ASSERT_OK(HalfToFloat(stream.get(), dall.get(), dback.get(), all.size()));
      cpu::HalfToFloat(all.data(), want.data(), all.size());
    }
    const auto back = dback.Download();
    for (int i = 0; i < 65536; ++i) {
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(back[i])) << name << " pattern " << i;
      } else {
        EXPECT_EQ(FloatBits(back[i]), FloatBits(want[i])) << name << " pattern " << i;
      }
    }
  }
}

// ---------------------------------------------------------------- reductions

TEST(CudaReduce, AllFiniteAndSumSquaresMulti) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  std::vector<int64_t> sizes;
  for (int i = 0; i < 70; ++i) sizes.push_back((i * 4999) % 20000 + 1);
  sizes[5] = 0;
  sizes[9] = 1000003;  // more than the per-tensor block cap covers in one pass
  std::vector<std::vector<float>> host;
  std::vector<std::unique_ptr<DeviceArray<float>>> dev;
  std::vector<const float*> ptrs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    host.push_back(RandomVec(static_cast<size_t>(sizes[i]), 500 + i, -3.0f, 3.0f));
    dev.push_back(std::make_unique<DeviceArray<float>>(host.back()));
    ptrs.push_back(dev.back()->get());
  }
  const int count = static_cast<int>(sizes.size());
  DeviceArray<int> flag(1);
  DeviceArray<double> sums(sizes.size());
  flag.Poison();
  sums.Poison();
  PW_ASSERT_OK(AllFiniteMulti(stream.get(), ptrs.data(), sizes.data(), count, flag.get()));
  EXPECT_EQ(flag.Download()[0], 1);
  PW_ASSERT_OK(SumSquaresMulti(stream.get(), ptrs.data(), sizes.data(), count, sums.get()));
  const auto got = sums.Download();
  for (int i = 0; i < count; ++i) {
    const double want = cpu::SumSquares(host[i].data(), host[i].size());
    EXPECT_NEAR(got[i], want, 1e-12 * want + 1e-300) << "tensor " << i;
  }
  // Determinism.
  PW_ASSERT_OK(SumSquaresMulti(stream.get(), ptrs.data(), sizes.data(), count, sums.get()));
  EXPECT_TRUE(SameBits(sums.Download(), got));

  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> poisoned = host[67];
    poisoned.back() = bad;
    dev[67]->Upload(poisoned);
    flag.Poison();
    PW_ASSERT_OK(AllFiniteMulti(stream.get(), ptrs.data(), sizes.data(), count, flag.get()));
    EXPECT_EQ(flag.Download()[0], 0) << bad;
    dev[67]->Upload(host[67]);
  }
  flag.Poison();
  PW_ASSERT_OK(AllFiniteMulti(stream.get(), nullptr, nullptr, 0, flag.get()));
  EXPECT_EQ(flag.Download()[0], 1);
}

// ---------------------------------------------------------------- determinism

TEST(CudaDeterminism, BackwardKernelsAreBitReproducible) {
  if (pipewright::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Stream stream;
  const int rows = 1031, cols = 777;
  const size_t n = static_cast<size_t>(rows) * cols;
  auto x = RandomVec(n, 90), dy = RandomVec(n, 91);
  auto mean = RandomVec(rows, 92), rstd = RandomVec(rows, 93, 0.5f, 2.0f);
  DeviceArray<float> dx(x), ddy(dy), dmean(mean), drstd(rstd);

  auto run_twice = [&](auto&& launch, DeviceArray<float>& buf, const std::vector<float>& init,
                       const char* what) {
    buf.Upload(init);
    launch();
    const auto first = buf.Download();
    buf.Upload(init);
    launch();
    EXPECT_TRUE(SameBits(first, buf.Download())) << what << " is not bit-reproducible";
  };

  const auto zeros = std::vector<float>(cols, 0.0f);
  DeviceArray<float> dbias(cols), dgamma(cols), dbeta(cols);
  run_twice(
      [&] { EXPECT_TRUE(BiasBackward(stream.get(), ddy.get(), dbias.get(), rows, cols).ok()); },
      dbias, zeros, "BiasBackward");
  run_twice(
      [&] {
        dbeta.Upload(zeros);
        EXPECT_TRUE(LayerNormBackwardWeight(stream.get(), dx.get(), dmean.get(), drstd.get(),
                                            ddy.get(), dgamma.get(), dbeta.get(), rows, cols)
                        .ok());
      },
      dgamma, zeros, "LayerNormBackwardWeight");

  // Embedding backward.
  const int B = 4, T = 129, C = 96, V = 50;
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
  std::mt19937 gen(94);
  for (auto& t : tokens) t = static_cast<int32_t>(gen() % V);
  DeviceArray<int32_t> dtok(tokens);
  DeviceArray<float> demb(RandomVec(static_cast<size_t>(B) * T * C, 95));
  DeviceArray<float> dwte(static_cast<size_t>(V) * C), dwpe(static_cast<size_t>(T) * C);
  const std::vector<float> wte0(dwte.size(), 0.0f), wpe0(dwpe.size(), 0.0f);
  run_twice(
      [&] {
        dwpe.Upload(wpe0);
        EXPECT_TRUE(
            EmbeddingBackward(stream.get(), demb.get(), dtok.get(), dwte.get(), dwpe.get(), B, T, C)
                .ok());
      },
      dwte, wte0, "EmbeddingBackward");

  // Attention backward.
  const AttnShape s{2, 200, 256, 4};
  const size_t nqkv = static_cast<size_t>(s.B) * s.T * 3 * s.C;
  const size_t nout = static_cast<size_t>(s.B) * s.T * s.C;
  const size_t nlse = static_cast<size_t>(s.B) * s.H * s.T;
  DeviceArray<float> qkv(RandomVec(nqkv, 96)), dout(RandomVec(nout, 97)), out(nout), lse(nlse),
      dqkv(nqkv), scratch(nlse);
  PW_ASSERT_OK(AttentionForward(stream.get(), qkv.get(), out.get(), lse.get(), s.B, s.T, s.C, s.H));
  const std::vector<float> nan_init(nqkv, std::numeric_limits<float>::quiet_NaN());
  run_twice(
      [&] {
        EXPECT_TRUE(AttentionBackward(stream.get(), dout.get(), qkv.get(), out.get(), lse.get(),
                                      dqkv.get(), scratch.get(), s.B, s.T, s.C, s.H)
                        .ok());
      },
      dqkv, nan_init, "AttentionBackward");
}

}  // namespace
}  // namespace pipewright::cuda
