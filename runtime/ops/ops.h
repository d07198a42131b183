// Tensor-level ops for the layers, the optimizer and the engine, dispatched on the device of
// the tensors: the CPU reference kernels (kernels/cpu) run synchronously on the calling thread;
// the CUDA kernels (kernels/cuda) are enqueued on the stream of the executing allocator, so a
// rank's work stays ordered without host synchronisation except where an op returns a host
// value (the loss sum, a squared norm, a finiteness flag), which waits for the stream.
//
// Every op checks that its tensors live on the executing device and returns InvalidArgument
// naming the op otherwise (never a silent host read of device memory). The CPU branch calls
// exactly the kernels the layers called before, so CPU results are unchanged bit for bit.
#ifndef PIPEWRIGHT_RUNTIME_OPS_OPS_H_
#define PIPEWRIGHT_RUNTIME_OPS_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/device.h"
#include "pipewright/layer.h"
#include "pipewright/tensor.h"

namespace pipewright::ops {

// Where an op runs: the allocator's device (and, on CUDA, its stream); outputs and scratch are
// allocated from it.
struct Exec {
  Allocator* alloc = nullptr;  // nullptr = DefaultCpuAllocator()
  Allocator* allocator() const;
  Device device() const;
};
inline Exec ExecOf(const LayerContext& ctx) { return Exec{ctx.allocator}; }

// Fails with InvalidArgument "<op>: <what> is on <device>, expected <device>" unless every
// defined tensor is on the executing device.
absl::Status CheckDevice(const Exec& e, const char* op, std::initializer_list<const Tensor*> ts);

// C[m,n] = alpha op(A) op(B) + beta C, row-major with row strides. A and B are both f32 (on CUDA
// optionally TF32, see SetAllowTf32) or both bf16/f16 with fp32 accumulation; C is f32.
absl::Status Gemm(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const Tensor& a, int64_t lda, const Tensor& b, int64_t ldb,
                  float beta, Tensor& c, int64_t ldc);
// Process-wide: let CUDA f32 GEMMs use TF32 tensor cores (default off: fp32 stays fp32).
void SetAllowTf32(bool allow);

// New tensor: `x` converted to `dtype` (f32 <-> bf16/f16, round-to-nearest-even).
absl::StatusOr<Tensor> Cast(const Exec& e, const Tensor& x, DType dtype);

// y[r, :] += bias
absl::Status BiasAdd(const Exec& e, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols);
// dbias += sum over rows of dy
absl::Status BiasBackward(const Exec& e, const Tensor& dy, Tensor& dbias, int64_t rows,
                          int64_t cols);
absl::StatusOr<Tensor> Add(const Exec& e, const Tensor& a, const Tensor& b);
// y += x
absl::Status AddInPlace(const Exec& e, Tensor& y, const Tensor& x);
absl::Status Scale(const Exec& e, Tensor& x, float s);
absl::StatusOr<Tensor> GeluForward(const Exec& e, const Tensor& x);
absl::StatusOr<Tensor> GeluBackward(const Exec& e, const Tensor& x, const Tensor& dy);

absl::Status LayerNormForward(const Exec& e, const Tensor& x, const Tensor& gamma,
                              const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                              int64_t rows, int64_t cols, float eps);
absl::Status LayerNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& gamma,
                                    const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, int64_t rows, int64_t cols);
absl::Status LayerNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dy, Tensor& dgamma,
                                     Tensor& dbeta, int64_t rows, int64_t cols);

// Sum over non-ignored rows (targets < 0 are ignored) of the softmax cross-entropy, returned to
// the host; *count = those rows. `targets` [rows] i32 is on the executing device; the caller
// checked its range (on the host, before a device copy).
absl::StatusOr<double> CrossEntropyForward(const Exec& e, const Tensor& logits,
                                           const Tensor& targets, int64_t rows, int64_t vocab,
                                           int64_t* count);
absl::Status CrossEntropyBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                  int64_t rows, int64_t vocab, float scale, Tensor& dlogits);

// Causal self-attention over qkv [B, T, 3C]. `aux` is what the backward needs besides qkv and
// out: on the CPU the probabilities [B, H, T, T]; on CUDA (fused, flash-style) the row
// log-sum-exp [B, H, T]. AttentionAuxShape says which.
std::vector<int64_t> AttentionAuxShape(Device d, int64_t B, int64_t T, int64_t H);
absl::Status AttentionForward(const Exec& e, const Tensor& qkv, Tensor& out, Tensor& aux, int64_t B,
                              int64_t T, int64_t C, int64_t H);
absl::StatusOr<Tensor> AttentionBackward(const Exec& e, const Tensor& dout, const Tensor& qkv,
                                         const Tensor& out, const Tensor& aux, int64_t B, int64_t T,
                                         int64_t C, int64_t H);

// tokens [B, T] i32 on the executing device (range already checked on the host).
absl::Status EmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& wte,
                              const Tensor& wpe, Tensor& out, int64_t B, int64_t T, int64_t C);
absl::Status EmbeddingBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                               Tensor& dwte, Tensor& dwpe, int64_t B, int64_t T, int64_t C);

// One AdamW update of many tensors (a single multi-tensor launch on CUDA).
struct AdamWItem {
  Tensor* param;
  const Tensor* grad;
  Tensor* m;
  Tensor* v;
  float weight_decay;
};
absl::Status AdamW(const Exec& e, const std::vector<AdamWItem>& items, float lr, float beta1,
                   float beta2, float eps, int64_t t);
absl::Status SgdMomentum(const Exec& e, Tensor& param, const Tensor& grad, Tensor& buf, float lr,
                         float momentum, float weight_decay);

// Sum of squares (in double) of all the tensors, returned to the host; the same grouping as
// summing per tensor in order.
absl::StatusOr<double> SumSquares(const Exec& e, const std::vector<const Tensor*>& ts);

// dst = src (same numel and dtype; any devices), ordered on the executing stream and, when the
// destination is on the host, complete on return.
absl::Status Copy(const Exec& e, const Tensor& src, Tensor& dst);
// Copies `n` elements between two f32 tensors at element offsets (bucket packing).
absl::Status CopyRange(const Exec& e, const Tensor& src, int64_t src_offset, Tensor& dst,
                       int64_t dst_offset, int64_t n);

// Frees what the ops keep per CUDA stream (its cuBLAS context); call before destroying a stream
// the ops ran on. No-op for the host.
void ReleaseStream(Stream stream);

}  // namespace pipewright::ops

#endif  // PIPEWRIGHT_RUNTIME_OPS_OPS_H_
