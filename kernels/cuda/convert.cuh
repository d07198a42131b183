// dtype conversion between float32 and the 16-bit formats on device arrays, with the hardware
// conversions of cuda_bf16.h / cuda_fp16.h: round to nearest, ties to even; overflow becomes
// Inf; Inf stays Inf; NaN stays NaN. The bit pattern of a converted NaN is the hardware's
// canonical NaN (sign and payload not kept), whereas cpu::FloatToBf16/FloatToHalf keep
// sign and payload — every non-NaN value converts to exactly the CPU's bits. 16-bit values are
// raw bits in uint16_t, as on the CPU. Asynchronous on `stream`; n == 0 is a no-op.
#ifndef PIPEWRIGHT_KERNELS_CUDA_CONVERT_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_CONVERT_CUH_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace pipewright::cuda {

absl::Status FloatToBf16(cudaStream_t stream, const float* in, uint16_t* out, size_t n);
absl::Status Bf16ToFloat(cudaStream_t stream, const uint16_t* in, float* out, size_t n);
absl::Status FloatToHalf(cudaStream_t stream, const float* in, uint16_t* out, size_t n);
absl::Status HalfToFloat(cudaStream_t stream, const uint16_t* in, float* out, size_t n);

}  // namespace pipewright::cuda

#endif  // PIPEWRIGHT_KERNELS_CUDA_CONVERT_CUH_
