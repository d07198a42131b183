// Built when PIPEWRIGHT_CUDA=OFF (or AUTO without nvcc): there are no CUDA devices.
#include "pipewright/device.h"

namespace pipewright {
int CudaDeviceCount() { return 0; }
}  // namespace pipewright
