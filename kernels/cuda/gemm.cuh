// GEMM on the GPU through cuBLASLt (tensor cores for TF32 / bf16 / fp16), with the row-major
// semantics of cpu::Gemm / cpu::GemmHalf:
//
//   C[m,n] = alpha * op(A) * op(B) + beta * C        op(X) = X or X^T, all matrices row-major;
//   A is m x k after op, B is k x n after op; lda/ldb/ldc are the row strides of the STORED
//   matrices (lda >= stored columns). Columns of C beyond n (ldc > n) are never touched.
//   beta == 0 overwrites C (stale NaNs in C do not survive); k == 0 or alpha == 0 only scales C.
//
// cuBLAS is column-major, so each call computes C^T = op(B)^T op(A)^T: the row-major C with
// stride ldc is exactly a column-major n x m matrix with leading dimension ldc.
//
// Accumulation is always fp32 (CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 when Gemm is
// asked for TF32). Results are deterministic for a fixed shape/alignment/device/library version:
// the algorithm chosen for a problem is cached, and in-place split-K reduction (which adds
// partial products into C in arbitrary order) is excluded from the heuristic. A problem the
// cuBLASLt heuristic has no algorithm for goes through cublasGemmEx with the same types.
#ifndef PIPEWRIGHT_KERNELS_CUDA_GEMM_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_GEMM_CUH_

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pipewright::cuda {
namespace internal {
class AlgoCache;  // defined in gemm.cu
}  // namespace internal

// Owns the cuBLAS and cuBLASLt handles of one device and the cuBLASLt workspace.
//
// Thread/stream contract: a Blas may be used from one host thread at a time, and calls issued
// on different streams must not run concurrently on the device (they share one workspace).
// Give each concurrently running stream its own Blas. The algorithm cache is internally locked.
class Blas {
 public:
  // Workspace handed to cuBLASLt (32 MiB: the size NVIDIA recommends for Hopper).
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  // Creates the handles and workspace on `device` (the caller's current device is restored).
  // Unavailable when there is no GPU/driver; Internal/ResourceExhausted on other failures.
  static absl::StatusOr<std::unique_ptr<Blas>> Create(int device);

  ~Blas() noexcept;
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  int device() const { return device_; }
  cublasHandle_t handle() const { return handle_; }
  cublasLtHandle_t lt_handle() const { return lt_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

  // Implementation detail of the launchers below: the per-shape cuBLASLt algorithm cache.
  internal::AlgoCache& algo_cache() const { return *algos_; }

 private:
  Blas() = default;

  int device_ = 0;
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::unique_ptr<internal::AlgoCache> algos_;
};

// fp32 GEMM. allow_tf32: inputs rounded to TF32 on tensor cores (~1e-3 relative error), fp32
// accumulation; otherwise full fp32 (CUDA cores). Enqueued on `stream`; returns launch errors.
absl::Status Gemm(cudaStream_t stream, Blas& blas, bool trans_a, bool trans_b, int m, int n, int k,
                  float alpha, const float* a, int lda, const float* b, int ldb, float beta,
                  float* c, int ldc, bool allow_tf32);

// 16-bit inputs (is_bf16: bfloat16, else IEEE half; raw bits in uint16_t), fp32 accumulation,
// fp32 C. Same semantics as cpu::GemmHalf.
absl::Status GemmHalf(cudaStream_t stream, Blas& blas, bool is_bf16, bool trans_a, bool trans_b,
                      int m, int n, int k, float alpha, const uint16_t* a, int lda,
                      const uint16_t* b, int ldb, float beta, float* c, int ldc);

// As GemmHalf but C is 16-bit of the same type as A and B (fp32 accumulation and epilogue,
// rounded once to 16 bits when stored; beta * C reads the 16-bit C).
absl::Status GemmHalfOut(cudaStream_t stream, Blas& blas, bool is_bf16, bool trans_a, bool trans_b,
                         int m, int n, int k, float alpha, const uint16_t* a, int lda,
                         const uint16_t* b, int ldb, float beta, uint16_t* c, int ldc);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_GEMM_CUH_
