// Multi-tensor AdamW (see optimizer.cuh).
#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/optimizer.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 4096;  // elements per block (16 per thread)
constexpr int64_t kMaxBlocksPerLaunch = int64_t{1} << 30;

struct AdamWBatch {
  AdamWTensor tensors[kAdamWTensorsPerLaunch];
  // Blocks [block_start[i], block_start[i + 1]) update tensor i.
  int block_start[kAdamWTensorsPerLaunch + 1];
  int count;
};
static_assert(sizeof(AdamWBatch) <= 4000, "kernel parameters must stay under 4 KB");

struct AdamWScalars {
  float lr, beta1, beta2, eps, one_minus_b1, one_minus_b2, inv_bc1, inv_bc2;
};

__global__ void __launch_bounds__(kThreads)
    AdamWMultiKernel(const AdamWBatch batch, const AdamWScalars s) {
  const int block = blockIdx.x;
  // Binary search for the tensor whose block range holds this block.
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.block_start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const AdamWTensor& tn = batch.tensors[lo];
  const int64_t begin = static_cast<int64_t>(block - batch.block_start[lo]) * kChunk;
  const int64_t end = begin + kChunk < tn.n ? begin + kChunk : tn.n;
  const float wd = tn.weight_decay;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    // Same operations, in the same order, as cpu::AdamWUpdate; each rounded separately.
    const float g = tn.grad[i];
    const float mi = __fadd_rn(__fmul_rn(s.beta1, tn.m[i]), __fmul_rn(s.one_minus_b1, g));
    const float vi =
        __fadd_rn(__fmul_rn(s.beta2, tn.v[i]), __fmul_rn(__fmul_rn(s.one_minus_b2, g), g));
    tn.m[i] = mi;
    tn.v[i] = vi;
    const float mhat = __fmul_rn(mi, s.inv_bc1);
    const float vhat = __fmul_rn(vi, s.inv_bc2);
    const float p = tn.param[i];
    const float update =
        __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), s.eps)), __fmul_rn(wd, p));
    tn.param[i] = __fsub_rn(p, __fmul_rn(s.lr, update));
  }
}

}  // namespace

absl::Status AdamWMulti(cudaStream_t stream, const AdamWTensor* host_list, int count, float lr,
                        float beta1, float beta2, float eps, int64_t t) {
  if (t < 1) return absl::InvalidArgumentError(absl::StrFormat("AdamWMulti: step t=%d < 1", t));
  if (count < 0 || (count > 0 && host_list == nullptr)) {
    return absl::InvalidArgumentError("AdamWMulti: bad tensor list");
  }
  // Bias corrections exactly as cpu::AdamWUpdate computes them.
  const double td = static_cast<double>(t);
  AdamWScalars s;
  s.lr = lr;
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.eps = eps;
  s.one_minus_b1 = 1.0f - beta1;
  s.one_minus_b2 = 1.0f - beta2;
  s.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(beta1), td)));
  s.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(beta2), td)));

  AdamWBatch batch;
  int64_t blocks = 0;
  batch.count = 0;
  auto flush = [&]() -> absl::Status {
    if (batch.count == 0 || blocks == 0) {
      batch.count = 0;
      blocks = 0;
      return absl::OkStatus();
    }
    batch.block_start[batch.count] = static_cast<int>(blocks);
    AdamWMultiKernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(batch, s);
    PW_CUDA_LAUNCH_CHECK("AdamWMultiKernel");
    batch.count = 0;
    blocks = 0;
    return absl::OkStatus();
  };
  for (int i = 0; i < count; ++i) {
    const AdamWTensor& tn = host_list[i];
    if (tn.n < 0) return absl::InvalidArgumentError("AdamWMulti: negative tensor size");
    if (tn.n == 0) continue;
    const int64_t need = (tn.n + kChunk - 1) / kChunk;
    if (need > kMaxBlocksPerLaunch) {
      return absl::InvalidArgumentError("AdamWMulti: tensor too large for one launch");
    }
    if (batch.count == kAdamWTensorsPerLaunch || blocks + need > kMaxBlocksPerLaunch) {
      PW_RETURN_IF_ERROR(flush());
    }
    batch.tensors[batch.count] = tn;
    batch.block_start[batch.count] = static_cast<int>(blocks);
    ++batch.count;
    blocks += need;
  }
  return flush();
}

}  // namespace pipewright::cuda
