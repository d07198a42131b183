// CUDA kernels: the device counterparts of kernels/cpu/cpu_kernels.h, one .cu/.cuh pair per op.
// Include this umbrella header, or a single op header.
//
// Invariants shared by every launcher here:
//  - Namespace pipewright::cuda; every launcher takes the cudaStream_t it enqueues on as its
//    FIRST argument, is asynchronous (returns before the GPU has run the work) and returns an
//    absl::Status that reports invalid arguments and launch errors (PW_CUDA_LAUNCH_CHECK after
//    every launch) — errors of the running kernel surface at the next synchronisation.
//  - All pointers are DEVICE memory unless the name says host_ (tensor lists). Tensors are dense,
//    row-major, float32 unless the name says otherwise; 16-bit tensors are raw uint16_t bits.
//  - Argument meaning, argument order (after the stream) and results are those of the same-named
//    cpu:: function: "rows" is the flattened leading dimensions, "cols" the last one.
//  - Functions named *Backward* that produce a weight gradient ACCUMULATE into it (+=), so that
//    gradients sum across micro-batches; functions producing an input gradient OVERWRITE it.
//  - Deterministic: no floating-point atomics anywhere; running a launcher twice on the same
//    inputs gives the same bits (weight-gradient reductions, attention backward, losses, norms).
//    EmbeddingBackward matches the CPU reference bit for bit; AdamWMulti does too whenever the
//    CPU build does not contract multiply-adds into FMAs.
//  - No launcher allocates device memory except SumSquaresMulti (a stream-ordered scratch of
//    <= 32 KiB) and Blas::Create; caller-owned scratch is named `scratch` / `row_loss`.
//  - Differences from the CPU reference, by design: attention saves lse [B,H,T] instead of the
//    probabilities [B,H,T,T]; SoftmaxCrossEntropyForward writes its sum and count to device
//    memory; out-of-range cross-entropy targets give NaN instead of undefined behaviour; a NaN
//    converted to 16 bits is the hardware's canonical NaN.
#ifndef PIPEWRIGHT_KERNELS_CUDA_CUDA_KERNELS_CUH_
#define PIPEWRIGHT_KERNELS_CUDA_CUDA_KERNELS_CUH_

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/convert.cuh"
#include "kernels/cuda/cross_entropy.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/llama.cuh"
#include "kernels/cuda/optimizer.cuh"
#include "kernels/cuda/reduce.cuh"

#endif  // PIPEWRIGHT_KERNELS_CUDA_CUDA_KERNELS_CUH_
