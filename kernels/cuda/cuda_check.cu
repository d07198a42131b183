#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.cuh"

namespace pipewright::cuda {

absl::Status ToStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(expr, " at ", file, ":", line, ": ", cudaGetErrorName(err), ": ",
                                 cudaGetErrorString(err));
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
      err == cudaErrorInvalidDevice) {
    return absl::UnavailableError(msg);
  }
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status ToStatus(cublasStatus_t err, const char* expr, const char* file, int line) {
  if (err == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string msg = absl::StrCat(expr, " at ", file, ":", line, ": ", cublasGetStatusName(err),
                                 ": ", cublasGetStatusString(err));
  if (err == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  if (err == CUBLAS_STATUS_NOT_INITIALIZED) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

}  // namespace pipewright::cuda
