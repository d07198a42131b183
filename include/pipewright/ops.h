// Tensor-level ops: what the built-in layers, the optimizer and the engine call, and what a
// custom layer calls to run on whatever device its stage lives on (docs/custom_layers.md).
//
// Dispatch. Every op runs on the device of its Exec (the allocator of the layer's context, see
// ExecOf): the CPU reference kernels run synchronously on the calling thread; on CUDA the
// kernels are enqueued on the allocator's stream. A layer written against these ops has no
// device code and no `#if`: the same Forward runs on CPU and CUDA tensors.
//
// Devices. Every op but Copy and CopyRange (which move data between devices) first checks that
// each defined tensor lives on the executing device and returns InvalidArgument naming the op
// and the operand otherwise (never a silent host read of device memory). In a build without
// CUDA no CUDA tensor or allocator can exist; an Exec that claims a CUDA device there gets
// FailedPrecondition.
//
// Blocking. On the CPU every op is complete on return. On CUDA an op returns once its work is
// queued, except where it returns a host value (CrossEntropyForward, SumSquares) or copies into
// host memory (Copy, CopyRange), which wait for the stream. A tensor allocated from the
// executing (stream-ordered) allocator may be dropped as soon as the call returns: its memory is
// reused only by work queued after the op.
//
// Ownership. Ops never keep a reference to their arguments. Ops that return a Tensor allocate
// it from the Exec's allocator and the caller owns it; ops that take a `Tensor&` output write
// into caller-owned memory. Functions whose name ends in Backward and produce a weight
// gradient (BiasBackward, LayerNormBackwardWeight, EmbeddingBackward) ACCUMULATE (+=) into it,
// so gradients sum across micro-batches; input-gradient outputs are overwritten.
//
// Shapes. Tensors are dense and row-major; "rows" is the product of the leading dimensions
// (batch * sequence) and "cols" the last one. Unless stated, an op checks devices (and the
// dtypes it names) but not that rows and cols fit the tensors: the caller checks its inputs
// first (CheckRows, CheckGradShape in pipewright/init.h). All floating-point tensors are f32
// unless stated; token and target tensors are i32.
//
// Thread safety: ops on different Execs may run concurrently; one Exec (one stream) is driven
// from one thread at a time.
#ifndef PIPEWRIGHT_OPS_H_
#define PIPEWRIGHT_OPS_H_

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/device.h"
#include "pipewright/layer.h"
#include "pipewright/tensor.h"

namespace pipewright::ops {

// Where an op runs: the allocator's device (and, on CUDA, its stream). Outputs and scratch are
// allocated from it. Non-owning; the allocator must outlive the ops' work.
struct Exec {
  Allocator* alloc = nullptr;  // nullptr = DefaultCpuAllocator()
  // `alloc`, or DefaultCpuAllocator() when it is null.
  Allocator* allocator() const;
  Device device() const;
};
// The Exec of a layer call: the context's allocator (the rank's device and stream).
inline Exec ExecOf(const LayerContext& ctx) { return Exec{ctx.allocator}; }

// OK when every defined tensor in `ts` (null pointers and undefined tensors are skipped) is on
// the executing device; otherwise InvalidArgument "<op>: operand <i> <shape> is on <device>, but
// the op runs on <device>". Every op below calls it; a custom op may too.
absl::Status CheckDevice(const Exec& e, const char* op, std::initializer_list<const Tensor*> ts);

// ---- matrix product ----

// C[m, n] = alpha op(A) op(B) + beta C, row-major, op(X) = X or X^T; A is m x k and B is k x n
// after op; lda, ldb, ldc are the row strides of the stored matrices. A and B are both f32 (on
// CUDA TF32 when SetAllowTf32(true)) or both bf16 or both f16, with fp32 accumulation; C is
// f32. beta = 1 accumulates into C (weight gradients); beta = 0 overwrites it.
absl::Status Gemm(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const Tensor& a, int64_t lda, const Tensor& b, int64_t ldb,
                  float beta, Tensor& c, int64_t ldc);
// A Linear layer's product and bias: C [m, n] (dense, ldc = n) = op(A) op(B) + bias[column]
// (alpha 1, beta 0; A, B and C as for Gemm, bias f32 [n]). Returns C, or with `gelu` a new tensor
// GELU(C), C then holding the pre-activation (as BiasGeluForward leaves it). The same values as
// Gemm then BiasAdd or BiasGeluForward, on the CPU the same bits; with pipewright's fp32 GEMM
// (cpu::OwnF32Gemm()) in one pass (Note [GEMM epilogue] in kernels/cpu/gemm_bf16.cc). With a
// `residual` (f32, m x n elements; not with gelu) C = op(A) op(B) + bias + residual: the same
// values as then AddInPlace(C, residual) (a residual connection's add).
absl::StatusOr<Tensor> GemmBias(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n,
                                int64_t k, const Tensor& a, int64_t lda, const Tensor& b,
                                int64_t ldb, const Tensor& bias, Tensor& c, bool gelu,
                                const Tensor* residual = nullptr);
// Process-wide: let CUDA f32 GEMMs use TF32 tensor cores (default off: fp32 stays fp32). The CPU
// ignores it.
void SetAllowTf32(bool allow);

// ---- conversion ----

// A new tensor of `x`'s shape: `x` converted to `dtype`, f32 -> bf16/f16 (round-to-nearest-even,
// NaN kept) or bf16/f16 -> f32 (exact). Other pairs are InvalidArgument.
absl::StatusOr<Tensor> Cast(const Exec& e, const Tensor& x, DType dtype);

// ---- elementwise ----

// y[r, c] += bias[c] for y [rows, cols], bias [cols].
absl::Status BiasAdd(const Exec& e, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols);
// dbias[c] += sum over r of dy[r, c] (accumulates).
absl::Status BiasBackward(const Exec& e, const Tensor& dy, Tensor& dbias, int64_t rows,
                          int64_t cols);
// A new tensor of `a`'s shape: a + b. Both f32 with the same element count (InvalidArgument
// otherwise).
absl::StatusOr<Tensor> Add(const Exec& e, const Tensor& a, const Tensor& b);
// y += x, both f32 with the same element count (InvalidArgument otherwise).
absl::Status AddInPlace(const Exec& e, Tensor& y, const Tensor& x);
// x *= s, in place.
absl::Status Scale(const Exec& e, Tensor& x, float s);
// A new tensor: GELU(x), tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
absl::StatusOr<Tensor> GeluForward(const Exec& e, const Tensor& x);
// A new tensor of dy's shape: dx = dy * GELU'(x) (x and dy have the same element count).
absl::StatusOr<Tensor> GeluBackward(const Exec& e, const Tensor& x, const Tensor& dy);
// Bias + GELU in one pass (a Linear layer's output, e.g. the MLP's first projection): for x
// [rows, cols] and bias [cols], x += bias in place (x becomes the pre-activation that
// BiasGeluBackward needs) and a new tensor GELU(x) is returned. The same values as BiasAdd then
// GeluForward (on the CPU the same bits).
absl::StatusOr<Tensor> BiasGeluForward(const Exec& e, Tensor& x, const Tensor& bias, int64_t rows,
                                       int64_t cols);
// Its backward: a new tensor dpre = dy * GELU'(pre) for pre and dy [rows, cols], and
// dbias[c] += sum over r of dpre[r, c] (accumulates), in one pass on the CPU. The same values as
// GeluBackward then BiasBackward (on the CPU the same bits).
absl::StatusOr<Tensor> BiasGeluBackward(const Exec& e, const Tensor& pre, const Tensor& dy,
                                        Tensor& dbias, int64_t rows, int64_t cols);

// ---- LayerNorm over the last dimension ----

// y = (x - mean) * rstd * gamma + beta for x, y [rows, cols], gamma, beta [cols]; writes mean
// and rstd = 1 / sqrt(var + eps) (each [rows]) for the backward.
absl::Status LayerNormForward(const Exec& e, const Tensor& x, const Tensor& gamma,
                              const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                              int64_t rows, int64_t cols, float eps);
// dx = dL/dx (overwritten) from the forward's x, mean, rstd and the output gradient dy.
absl::Status LayerNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& gamma,
                                    const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, int64_t rows, int64_t cols);
// dgamma += sum over rows of dy * xhat, dbeta += sum over rows of dy (accumulate).
absl::Status LayerNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dy, Tensor& dgamma,
                                     Tensor& dbeta, int64_t rows, int64_t cols);

// ---- softmax cross-entropy (max-subtracted, numerically stable) ----

// The SUM over non-ignored rows of -log softmax(logits[r])[targets[r]], returned to the host
// (on CUDA this waits for the stream); *count = the number of those rows. logits [rows, vocab];
// targets [rows] i32 on the executing device, each in [0, vocab) or negative to ignore the row.
// The caller checks the range (on the host, before copying targets to a device).
absl::StatusOr<double> CrossEntropyForward(const Exec& e, const Tensor& logits,
                                           const Tensor& targets, int64_t rows, int64_t vocab,
                                           int64_t* count);
// dlogits[r, :] = scale * (softmax(logits[r]) - onehot(targets[r])), zero for ignored rows
// (overwritten).
absl::Status CrossEntropyBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                  int64_t rows, int64_t vocab, float scale, Tensor& dlogits);

// ---- causal multi-head self-attention ----

// The shape of AttentionForward's `lse` on every device: [B, H, T], the log-sum-exp of each
// query row's scaled scores, from which the backward recomputes the probabilities tile by tile
// (both devices run a fused, flash-style kernel: no T x T matrix is stored).
std::vector<int64_t> AttentionLseShape(int64_t B, int64_t T, int64_t H);
// out [B, T, C] = softmax(q k^T / sqrt(C / H), causal) v per head, for qkv [B, T, 3C] laid out
// as (q | k | v) with head h at columns [h C/H, (h+1) C/H) of each; writes `lse`
// (AttentionLseShape) for the backward.
absl::Status AttentionForward(const Exec& e, const Tensor& qkv, Tensor& out, Tensor& lse, int64_t B,
                              int64_t T, int64_t C, int64_t H);
// A new tensor dqkv [B, T, 3C] from dout and the forward's qkv, out and lse.
absl::StatusOr<Tensor> AttentionBackward(const Exec& e, const Tensor& dout, const Tensor& qkv,
                                         const Tensor& out, const Tensor& lse, int64_t B, int64_t T,
                                         int64_t C, int64_t H);

// Incremental decoding's attention (Note [Incremental decoding] in layer.h): for the qkv rows
// [n, 3C] of positions [start, start + n) of one sequence (only their q is read) and kv, the
// keys and values of positions [0, start + n) as rows [k | v] of 2C (the cache, those of the new
// rows included), out [n, C] = softmax(q k^T / sqrt(C / H), causal) v per head, the rows
// AttentionForward of the whole sequence gives at those positions up to rounding. All f32;
// InvalidArgument when a tensor is too small for its rows (on CUDA also beyond about 12,000
// positions: kernels/cuda/attention.cuh).
absl::Status AttentionDecode(const Exec& e, const Tensor& qkv, const Tensor& kv, Tensor& out,
                             int64_t start, int64_t n, int64_t C, int64_t H);

// ---- token + learned position embedding ----

// out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :] for tokens [B, T] i32 on the executing device
// (each in [0, vocab): the caller checks, on the host, before copying them to a device).
absl::Status EmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& wte,
                              const Tensor& wpe, Tensor& out, int64_t B, int64_t T, int64_t C);
// dwte[tokens[b, t], :] += dout[b, t, :]; dwpe[t, :] += sum over b of dout[b, t, :] (accumulate).
absl::Status EmbeddingBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                               Tensor& dwte, Tensor& dwpe, int64_t B, int64_t T, int64_t C);

// ---- vocab-parallel embedding and loss (tensor parallelism) ----
// One tensor-parallel rank's part of the vocabulary, [begin, begin + part) (Note [Tensor
// parallelism] in pipewright/tensor_parallel.h). On the CPU the same operations in the same order
// as the loops the layers ran before these ops existed.

// out[b, t, :] = wte_part[tokens[b, t] - begin, :] for a token in the range (a zero row for the
// others), plus wpe[t, :] when `wpe` is defined (one rank adds the positions), computed as
// wte + wpe where both are added. wte_part [part, C]; tokens [B, T] i32 (checked by the caller).
absl::Status EmbeddingPartForward(const Exec& e, const Tensor& tokens, const Tensor& wte_part,
                                  int64_t begin, const Tensor& wpe, Tensor& out, int64_t B,
                                  int64_t T, int64_t C);
// dwte_part[tokens[b, t] - begin, :] += dout[b, t, :] for the tokens in the range, row by row in
// (b, t) order as EmbeddingBackward adds them, and dwpe[t, :] += sum over b of dout[b, t, :]
// when `dwpe` is defined (an embedding without positions passes none).
absl::Status EmbeddingPartBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                                   int64_t begin, Tensor& dwte_part, Tensor& dwpe, int64_t B,
                                   int64_t T, int64_t C);
// max [rows] f32 = the largest logit of each row of logits [rows, cols].
absl::Status RowMax(const Exec& e, const Tensor& logits, int64_t rows, int64_t cols, Tensor& max);
// For the rank's logits [rows, cols] (vocabulary [begin, begin + cols)), every rank's RowMax
// `maxima` [ranks, rows] f32 (all-gathered) and targets [rows] i32 (negative: an ignored row):
// stats [3, rows] f64 = (sum over the rank's columns of exp(logit - M), the target's logit where
// this rank's range holds it else 0, M = the row's largest maximum over the ranks). An ignored
// row gets zero sums. All-reducing the first 2 rows of stats over the group gives each row's
// whole sum and target logit.
absl::Status CrossEntropyPartStats(const Exec& e, const Tensor& logits, const Tensor& targets,
                                   int64_t begin, const Tensor& maxima, int64_t ranks, int64_t rows,
                                   int64_t cols, Tensor& stats);
// dlogits [rows, cols] = scale * (exp(logit - M) / sum - [begin + j is the target]) from the
// all-reduced stats; zero rows for ignored rows.
absl::Status CrossEntropyPartBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                      int64_t begin, const Tensor& stats, int64_t rows,
                                      int64_t cols, float scale, Tensor& dlogits);

// ---- optimizer updates (in place; step t >= 1) ----

// One AdamW update of many tensors (a single multi-tensor launch on CUDA): decoupled weight
// decay, p -= lr (mhat / (sqrt(vhat) + eps) + weight_decay p), with bias-corrected moments.
struct AdamWItem {
  Tensor* param;
  const Tensor* grad;
  Tensor* m;
  Tensor* v;
  float weight_decay;
};
// The gradient used is grad * grad_scale (rounded to f32, as a separate Scale would store it);
// the grads are not written.
absl::Status AdamW(const Exec& e, const std::vector<AdamWItem>& items, float lr, float beta1,
                   float beta2, float eps, int64_t t, float grad_scale = 1.0f);
// buf = momentum buf + (grad + weight_decay param); param -= lr buf (PyTorch SGD, no dampening).
// CPU only: Unimplemented on CUDA.
absl::Status SgdMomentum(const Exec& e, Tensor& param, const Tensor& grad, Tensor& buf, float lr,
                         float momentum, float weight_decay);

// ---- reductions and copies ----

// Sum of squares (in double) of all the f32 tensors, returned to the host (on CUDA this waits
// for the stream); summed per tensor in order, the same grouping on every device.
absl::StatusOr<double> SumSquares(const Exec& e, const std::vector<const Tensor*>& ts);
// Appends to `out` the sum of squares (in double) of each `chunk` elements of the f32 tensor `t`
// from its first (the last chunk may be shorter), returned to the host. A chunk's sum depends
// only on its elements, not on what surrounds them.
absl::Status SquareSumsByChunk(const Exec& e, const Tensor& t, int64_t chunk,
                               std::vector<double>* out);

// dst = src (same element count and dtype, InvalidArgument otherwise; the tensors may be on any
// devices: this is how data moves between host and GPU). Ordered on the executing stream;
// complete on return when `dst` is on the host.
absl::Status Copy(const Exec& e, const Tensor& src, Tensor& dst);
// Copies `n` elements between two f32 tensors at element offsets (gradient bucket packing),
// with Copy's ordering. InvalidArgument when a range falls outside its tensor.
absl::Status CopyRange(const Exec& e, const Tensor& src, int64_t src_offset, Tensor& dst,
                       int64_t dst_offset, int64_t n);

// ---- The Llama family's pieces (runtime/ops/llama_ops.cc; Note [Llama layers] there) ----
// CPU and CUDA (kernels/cuda/llama.cu).

// RMSNorm over the last dimension (transformers' LlamaRMSNorm): y = w * x * rstd with rstd =
// 1 / sqrt(mean(x^2) + eps) per row of x, y [rows, cols], w [cols]; writes rstd [rows].
absl::Status RmsNormForward(const Exec& e, const Tensor& x, const Tensor& w, Tensor& y,
                            Tensor& rstd, int64_t rows, int64_t cols, float eps);
// dx (overwritten) from the forward's x, rstd and dy.
absl::Status RmsNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& w,
                                  const Tensor& rstd, const Tensor& dy, Tensor& dx, int64_t rows,
                                  int64_t cols);
// dw += sum over rows of dy * x * rstd (each column in row order).
absl::Status RmsNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& rstd,
                                   const Tensor& dy, Tensor& dw, int64_t rows, int64_t cols);

// Rotary position embedding (transformers' Llama convention, rotate_half): for each of `rows`
// rows of x and each head of `heads` at column
// offset `col` + h * D within a row of `ld` floats, the pairs (i, i + D/2), i < D/2, turn by the
// angle pos * theta^(-2i/D): (a, b) -> (a cos - b sin, b cos + a sin), in place. The rows are
// [B, T] sequences: row r is at position first + r % T (first > 0: the rows of later positions
// of a sequence being decoded, Note [Incremental decoding]; the same bits as those rows of the
// whole sequence). `inverse` turns by minus the angle (the backward: the transpose of a rotation).
absl::Status Rope(const Exec& e, Tensor& x, int64_t rows, int64_t T, int64_t ld, int64_t col,
                  int64_t heads, int64_t D, double theta, bool inverse, int64_t first = 0);

// SwiGLU: out [rows, F] = silu(g) * u for gu [rows, 2F] = (g | u).
absl::Status SwiGluForward(const Exec& e, const Tensor& gu, Tensor& out, int64_t rows, int64_t F);
// dgu [rows, 2F] (overwritten) from the forward's gu and dout [rows, F].
absl::Status SwiGluBackward(const Exec& e, const Tensor& gu, const Tensor& dout, Tensor& dgu,
                            int64_t rows, int64_t F);

// Grouped-query attention's key and value heads for every query head: from x [rows, C + 2K]
// = (q | k | v) with K = kv_heads * D, qkv [rows, 3C] = (q | k repeated | v repeated), query
// head h reading kv head h / (heads / kv_heads) (transformers' repeat_kv).
absl::Status ExpandKv(const Exec& e, const Tensor& x, Tensor& qkv, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D);
// The transpose: dx [rows, C + 2K] (overwritten) = (dq | each kv head's sum over the query heads
// that read it, in head order) from dqkv [rows, 3C].
absl::Status ReduceKv(const Exec& e, const Tensor& dqkv, Tensor& dx, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D);

// Token embedding without positions: out [B*T, C] = table[tokens]; tokens i32 in [0, V) (the
// caller checks them).
absl::Status TokenEmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& table,
                                   Tensor& out, int64_t n, int64_t C);
// dtable[tokens[i]] += dout[i] for i in order.
absl::Status TokenEmbeddingBackward(const Exec& e, const Tensor& tokens, const Tensor& dout,
                                    Tensor& dtable, int64_t n, int64_t C);

// Frees what the ops keep per CUDA stream (its cuBLAS context); call before destroying a stream
// the ops ran on. No-op for a CPU stream.
void ReleaseStream(Stream stream);

}  // namespace pipewright::ops

#endif  // PIPEWRIGHT_OPS_H_
