// CUDA device discovery. Any error (no driver, no device, a stub libcuda) means "no GPU": the
// CPU path must keep working on machines without one.
#include <cuda_runtime.h>

#include "pipewright/device.h"

namespace pipewright {

int CudaDeviceCount() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later queries start clean
    return 0;
  }
  return count;
}

}  // namespace pipewright
