// Error handling for CUDA, cuBLAS and NCCL: one ToStatus per foreign error type, carrying the
// failed expression, file:line and the library's own message, and the PW_* macros that return
// it. Every kernel launch is followed by PW_CUDA_LAUNCH_CHECK so a bad launch configuration is
// reported where it happened, not at the next synchronisation.
//
// Only .cu/.cc files of the CUDA build include this header (it needs the CUDA toolkit).
#ifndef PIPEWRIGHT_KERNELS_CUDA_CUDA_CHECK_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_CUDA_CHECK_CUH_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "pipewright/status.h"

namespace pipewright::cuda {

// OK for cudaSuccess; otherwise Internal (Unavailable for "no device"/"no driver" errors)
// with "<expr> at <file>:<line>: <cudaGetErrorName>: <cudaGetErrorString>".
absl::Status ToStatus(cudaError_t err, const char* expr, const char* file, int line);
absl::Status ToStatus(cublasStatus_t err, const char* expr, const char* file, int line);

// Makes `device` current on the calling thread for the scope and restores the previous device
// afterwards (CUDA's current device is per thread). A device that cannot be made current is
// left for the next CUDA call to report.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (current == device) return;
    if (cudaSetDevice(device) == cudaSuccess) {
      previous_ = current;
    } else {
      (void)cudaGetLastError();  // the call that follows reports the device's problem
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace pipewright::cuda

#define PW_CUDA_RETURN_IF_ERROR(expr) \
  PW_RETURN_IF_ERROR(::pipewright::cuda::ToStatus((expr), #expr, __FILE__, __LINE__))

#define PW_CUBLAS_RETURN_IF_ERROR(expr) \
  PW_RETURN_IF_ERROR(::pipewright::cuda::ToStatus((expr), #expr, __FILE__, __LINE__))

// After every <<<...>>> launch: returns the launch error (bad configuration, no device).
#define PW_CUDA_LAUNCH_CHECK(kernel_name)                                                       \
  PW_RETURN_IF_ERROR(::pipewright::cuda::ToStatus(cudaGetLastError(), "launch of " kernel_name, \
                                                  __FILE__, __LINE__))

#endif  // PIPEWRIGHT_KERNELS_CUDA_CUDA_CHECK_CUH_
