// dtype conversion kernels (see convert.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/convert.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/kernel_util.cuh"

namespace pipewright::cuda {
namespace {

#define PW_GRID_STRIDE(i, n)                                                           \
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<size_t>(gridDim.x) * blockDim.x)

__global__ void FloatToBf16Kernel(const float* in, uint16_t* out, size_t n) {
  PW_GRID_STRIDE(i, n) { out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i])); }
}

__global__ void Bf16ToFloatKernel(const uint16_t* in, float* out, size_t n) {
  PW_GRID_STRIDE(i, n) { out[i] = __bfloat162float(__ushort_as_bfloat16(in[i])); }
}

__global__ void FloatToHalfKernel(const float* in, uint16_t* out, size_t n) {
  PW_GRID_STRIDE(i, n) { out[i] = __half_as_ushort(__float2half_rn(in[i])); }
}

__global__ void HalfToFloatKernel(const uint16_t* in, float* out, size_t n) {
  PW_GRID_STRIDE(i, n) { out[i] = __half2float(__ushort_as_half(in[i])); }
}

#undef PW_GRID_STRIDE

}  // namespace

absl::Status FloatToBf16(cudaStream_t stream, const float* in, uint16_t* out, size_t n) {
  if (n == 0) return absl::OkStatus();
  FloatToBf16Kernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(in, out, n);
  PW_CUDA_LAUNCH_CHECK("FloatToBf16Kernel");
  return absl::OkStatus();
}

absl::Status Bf16ToFloat(cudaStream_t stream, const uint16_t* in, float* out, size_t n) {
  if (n == 0) return absl::OkStatus();
  Bf16ToFloatKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(in, out, n);
  PW_CUDA_LAUNCH_CHECK("Bf16ToFloatKernel");
  return absl::OkStatus();
}

absl::Status FloatToHalf(cudaStream_t stream, const float* in, uint16_t* out, size_t n) {
  if (n == 0) return absl::OkStatus();
  FloatToHalfKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(in, out, n);
  PW_CUDA_LAUNCH_CHECK("FloatToHalfKernel");
  return absl::OkStatus();
}

absl::Status HalfToFloat(cudaStream_t stream, const uint16_t* in, float* out, size_t n) {
  if (n == 0) return absl::OkStatus();
  HalfToFloatKernel<<<internal::GridFor(n), internal::kElementwiseThreads, 0, stream>>>(in, out, n);
  PW_CUDA_LAUNCH_CHECK("HalfToFloatKernel");
  return absl::OkStatus();
}

}  // namespace pipewright::cuda
