// Row-major GEMM through cuBLASLt (fallback: cublasGemmEx) — see gemm.cuh for the semantics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/kernel_util.cuh"

namespace pipewright::cuda {
namespace internal {

// Cache of cuBLASLt heuristic answers, keyed by everything the heuristic looks at. Asking the
// heuristic costs tens of microseconds of host time; a training step repeats the same shapes.
struct AlgoKey {
  int a_type, c_type, compute;
  bool trans_a, trans_b;
  int m, n, k, lda, ldb, ldc;
  int align_a, align_b, align_c;
  friend bool operator<(const AlgoKey& x, const AlgoKey& y) {
    return std::tie(x.a_type, x.c_type, x.compute, x.trans_a, x.trans_b, x.m, x.n, x.k, x.lda,
                    x.ldb, x.ldc, x.align_a, x.align_b, x.align_c) <
           std::tie(y.a_type, y.c_type, y.compute, y.trans_a, y.trans_b, y.m, y.n, y.k, y.lda,
                    y.ldb, y.ldc, y.align_a, y.align_b, y.align_c);
  }
};

struct CachedAlgo {
  bool has_algo = false;  // false: the heuristic found nothing; use cublasGemmEx instead
  cublasLtMatmulAlgo_t algo{};
};

class AlgoCache {
 public:
  bool Lookup(const AlgoKey& key, CachedAlgo* out) {
    absl::MutexLock lock(&mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return false;
    *out = it->second;
    return true;
  }
  void Store(const AlgoKey& key, const CachedAlgo& algo) {
    absl::MutexLock lock(&mu_);
    map_[key] = algo;
  }

 private:
  absl::Mutex mu_;
  std::map<AlgoKey, CachedAlgo> map_;
};

}  // namespace internal

namespace {

using internal::AlgoKey;
using internal::CachedAlgo;

// Largest power of two (<= 256) dividing the address: what cuBLASLt may assume about it.
uint32_t Alignment(const void* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a >>= 1;
  return a;
}

// RAII for the cuBLASLt descriptors of one call.
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescs() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

// C[i, j] = beta * C[i, j] over the m x n row-major region (beta == 0 writes exact zeros).
template <typename T>
__device__ __forceinline__ float LoadAsFloat(const T* p, bool is_bf16);
template <>
__device__ __forceinline__ float LoadAsFloat<float>(const float* p, bool) {
  return *p;
}
template <>
__device__ __forceinline__ float LoadAsFloat<uint16_t>(const uint16_t* p, bool is_bf16) {
  return is_bf16 ? __bfloat162float(__ushort_as_bfloat16(*p)) : __half2float(__ushort_as_half(*p));
}
__device__ __forceinline__ void StoreFromFloat(float* p, float v, bool) { *p = v; }
__device__ __forceinline__ void StoreFromFloat(uint16_t* p, float v, bool is_bf16) {
  *p =
      is_bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}

template <typename T>
__global__ void ScaleMatrixKernel(T* c, int m, int n, int ldc, float beta, bool is_bf16) {
  const size_t total = static_cast<size_t>(m) * n;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t i = idx / n, j = idx % n;
    T* p = c + i * ldc + j;
    const float v = beta == 0.0f ? 0.0f : beta * LoadAsFloat(p, is_bf16);
    StoreFromFloat(p, v, is_bf16);
  }
}

template <typename T>
absl::Status ScaleMatrix(cudaStream_t stream, T* c, int m, int n, int ldc, float beta,
                         bool is_bf16) {
  if (beta == 1.0f) return absl::OkStatus();
  const size_t total = static_cast<size_t>(m) * n;
  ScaleMatrixKernel<T><<<internal::GridFor(total), internal::kElementwiseThreads, 0, stream>>>(
      c, m, n, ldc, beta, is_bf16);
  PW_CUDA_LAUNCH_CHECK("ScaleMatrixKernel");
  return absl::OkStatus();
}

absl::Status CheckShape(bool trans_a, bool trans_b, int m, int n, int k, int lda, int ldb,
                        int ldc) {
  if (m < 0 || n < 0 || k < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("gemm: negative size m=%d n=%d k=%d", m, n, k));
  }
  const int a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  if (lda < (a_cols > 1 ? a_cols : 1) || ldb < (b_cols > 1 ? b_cols : 1) || ldc < (n > 1 ? n : 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "gemm: leading dimension too small (lda=%d ldb=%d ldc=%d for m=%d n=%d k=%d ta=%d tb=%d)",
        lda, ldb, ldc, m, n, k, trans_a, trans_b));
  }
  return absl::OkStatus();
}

// The one code path behind all launchers: row-major C = alpha op(A) op(B) + beta C with the
// given storage types, as the column-major C^T = op(B)^T op(A)^T.
absl::Status Matmul(cudaStream_t stream, Blas& blas, cudaDataType_t ab_type, cudaDataType_t c_type,
                    cublasComputeType_t compute, bool trans_a, bool trans_b, int m, int n, int k,
                    float alpha, const void* a, int lda, const void* b, int ldb, float beta,
                    void* c, int ldc) {
  // Column-major operands: "A" is our B (n x k after op), "B" is our A (k x m after op).
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint64_t first_rows = trans_b ? k : n, first_cols = trans_b ? n : k;
  const uint64_t second_rows = trans_a ? m : k, second_cols = trans_a ? k : m;

  AlgoKey key{static_cast<int>(ab_type),
              static_cast<int>(c_type),
              static_cast<int>(compute),
              trans_a,
              trans_b,
              m,
              n,
              k,
              lda,
              ldb,
              ldc,
              static_cast<int>(Alignment(a)),
              static_cast<int>(Alignment(b)),
              static_cast<int>(Alignment(c))};

  LtDescs d;
  PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&d.op, compute, CUDA_R_32F));
  PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA,
                                                           &op_first, sizeof(op_first)));
  PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB,
                                                           &op_second, sizeof(op_second)));
  PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.a, ab_type, first_rows, first_cols, ldb));
  PW_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&d.b, ab_type, second_rows, second_cols, lda));
  PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&d.c, c_type, n, m, ldc));

  CachedAlgo cached;
  if (!blas.algo_cache().Lookup(key, &cached)) {
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&d.pref));
    const uint64_t ws = blas.workspace_bytes();
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    // In-place split-K reduction accumulates partial results in C in arbitrary order: exclude
    // it so results are bitwise reproducible.
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_INPLACE;
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
    const uint32_t align_first = key.align_b, align_second = key.align_a, align_c = key.align_c;
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_first, sizeof(align_first)));
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_second, sizeof(align_second)));
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(blas.lt_handle(), d.op, d.a, d.b, d.c,
                                                             d.c, d.pref, 1, &result, &returned);
    cached.has_algo =
        hs == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (cached.has_algo) cached.algo = result.algo;
    blas.algo_cache().Store(key, cached);
  }

  if (cached.has_algo) {
    const cublasStatus_t st =
        cublasLtMatmul(blas.lt_handle(), d.op, &alpha, b, d.a, a, d.b, &beta, c, d.c, c, d.c,
                       &cached.algo, blas.workspace(), blas.workspace_bytes(), stream);
    // NOT_SUPPORTED means the cached algorithm cannot run this call after all: fall through to
    // the classic API rather than fail.
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) {
      PW_CUBLAS_RETURN_IF_ERROR(st);
      return absl::OkStatus();
    }
  }
  // No cuBLASLt algorithm for this shape/alignment: the classic API takes everything.
  PW_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas.handle(), stream));
  PW_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(blas.handle(), op_first, op_second, n, m, k, &alpha, b,
                                         ab_type, ldb, a, ab_type, lda, &beta, c, c_type, ldc,
                                         compute, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

template <typename CT>
absl::Status GemmCommon(cudaStream_t stream, Blas& blas, cudaDataType_t ab_type,
                        cudaDataType_t c_type, cublasComputeType_t compute, bool is_bf16,
                        bool trans_a, bool trans_b, int m, int n, int k, float alpha, const void* a,
                        int lda, const void* b, int ldb, float beta, CT* c, int ldc) {
  PW_RETURN_IF_ERROR(CheckShape(trans_a, trans_b, m, n, k, lda, ldb, ldc));
  if (m == 0 || n == 0) return absl::OkStatus();
  if (k == 0 || alpha == 0.0f) return ScaleMatrix<CT>(stream, c, m, n, ldc, beta, is_bf16);
  return Matmul(stream, blas, ab_type, c_type, compute, trans_a, trans_b, m, n, k, alpha, a, lda, b,
                ldb, beta, c, ldc);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Blas>> Blas::Create(int device) {
  int previous = 0;
  PW_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  PW_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  std::unique_ptr<Blas> blas(new Blas());
  blas->device_ = device;
  blas->algos_ = std::make_unique<internal::AlgoCache>();
  absl::Status status = [&]() -> absl::Status {
    PW_CUBLAS_RETURN_IF_ERROR(cublasCreate(&blas->handle_));
    PW_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&blas->lt_));
    PW_CUDA_RETURN_IF_ERROR(cudaMalloc(&blas->workspace_, kWorkspaceBytes));
    blas->workspace_bytes_ = kWorkspaceBytes;
    return absl::OkStatus();
  }();
  cudaSetDevice(previous);  // best effort; the new handles do not depend on it
  if (!status.ok()) return status;
  return blas;
}

Blas::~Blas() noexcept {
  // Teardown never fails loudly: errors here (e.g. a context already destroyed at exit) are
  // cleared and ignored.
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (lt_ != nullptr) cublasLtDestroy(lt_);
  if (handle_ != nullptr) cublasDestroy(handle_);
  cudaGetLastError();
}

absl::Status Gemm(cudaStream_t stream, Blas& blas, bool trans_a, bool trans_b, int m, int n, int k,
                  float alpha, const float* a, int lda, const float* b, int ldb, float beta,
                  float* c, int ldc, bool allow_tf32) {
  return GemmCommon<float>(stream, blas, CUDA_R_32F, CUDA_R_32F,
                           allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                           /*is_bf16=*/false, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb,
                           beta, c, ldc);
}

absl::Status GemmHalf(cudaStream_t stream, Blas& blas, bool is_bf16, bool trans_a, bool trans_b,
                      int m, int n, int k, float alpha, const uint16_t* a, int lda,
                      const uint16_t* b, int ldb, float beta, float* c, int ldc) {
  return GemmCommon<float>(stream, blas, is_bf16 ? CUDA_R_16BF : CUDA_R_16F, CUDA_R_32F,
                           CUBLAS_COMPUTE_32F, is_bf16, trans_a, trans_b, m, n, k, alpha, a, lda, b,
                           ldb, beta, c, ldc);
}

absl::Status GemmHalfOut(cudaStream_t stream, Blas& blas, bool is_bf16, bool trans_a, bool trans_b,
                         int m, int n, int k, float alpha, const uint16_t* a, int lda,
                         const uint16_t* b, int ldb, float beta, uint16_t* c, int ldc) {
  const cudaDataType_t t = is_bf16 ? CUDA_R_16BF : CUDA_R_16F;
  return GemmCommon<uint16_t>(stream, blas, t, t, CUBLAS_COMPUTE_32F, is_bf16, trans_a, trans_b, m,
                              n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace pipewright::cuda
