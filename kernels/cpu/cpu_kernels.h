// CPU reference kernels. One function per op; all are synchronous on the calling thread and
// single-threaded unless noted (OpenBLAS threading is process-wide and set by the caller).
//
// Invariants shared by every kernel here:
//  - Tensors are dense, row-major, float32 unless the name says otherwise.
//  - "rows" is the flattened leading dimensions (batch * sequence), "cols" the last one.
//  - Functions named *Backward* that produce a weight gradient ACCUMULATE into it (+=), so that
//    gradients sum across micro-batches; functions that produce an input gradient OVERWRITE it.
//  - No function allocates on the heap except where noted (attention scratch is caller-owned).
//  - Kernels that take an `Isa` run the variant compiled for it (vec.h, isa.h); it must be one
//    this CPU runs (KernelIsa(), the default, or narrower). The variants may round differently
//    (vector reductions, fused multiply-adds), so a process passes one ISA throughout. Within a
//    variant an element's bits do not depend on the range a call covers (Note [Same bits for
//    every chunking] in vec.h), so rows (or, for column sums, columns) may be split over threads.
#ifndef PIPEWRIGHT_KERNELS_CPU_CPU_KERNELS_H_
#define PIPEWRIGHT_KERNELS_CPU_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/isa.h"

namespace pipewright::cpu {

// ---- dtype conversion (round-to-nearest-even; NaN preserved) ----
// The array versions compute the same bits as the scalar ones on every ISA (integer arithmetic).
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
void FloatToBf16(const float* in, uint16_t* out, size_t n, Isa isa = KernelIsa());
void Bf16ToFloat(const uint16_t* in, float* out, size_t n, Isa isa = KernelIsa());
void FloatToHalf(const float* in, uint16_t* out, size_t n, Isa isa = KernelIsa());
void HalfToFloat(const uint16_t* in, float* out, size_t n, Isa isa = KernelIsa());

// ---- GEMM ----
// C[m,n] = alpha * op(A) * op(B) + beta * C, row-major; op(X) = X or X^T.
// A is m x k after op, B is k x n after op. lda/ldb/ldc are row strides of the stored matrices.
// Big products run as blocks of C on the calling thread's pool (parallel.h), cut by the shape
// only, so the bits do not depend on the thread count (Note [GEMM split] in gemm.cc).
// The products are pipewright's own fp32 GEMM (Note [fp32 GEMM] in gemm_bf16.cc) where
// OwnF32Gemm(), else OpenBLAS's sgemm, or its sgemv for one row of C (m = 1; Note [One-row
// products] in gemm.cc).
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc);
// Whether Gemm runs pipewright's fp32 GEMM: AVX-512 kernels (KernelIsa()) and
// PIPEWRIGHT_GEMM not "openblas". Fixed for the process.
bool OwnF32Gemm();
// One OpenBLAS cblas_sgemm call on the calling thread (benchmarks' reference).
void BlasSgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
               int lda, const float* b, int ldb, float beta, float* c, int ldc);
// Same with 16-bit inputs (is_bf16: bfloat16, else IEEE half), fp32 accumulation, f32 output.
// When `isa` is kAvx512 this is GemmHalfBlock over all of C (bf16 with Bf16GemmKernel()), else
// the inputs are widened to f32 for Gemm. `isa` must be one this CPU runs (KernelIsa() or
// narrower); the two paths round differently.
void GemmHalf(bool is_bf16, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
              const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc,
              Isa isa = KernelIsa());

// ---- 16-bit GEMM on AVX-512 (Note [16-bit GEMM] in gemm_bf16.cc) ----
// The micro-kernel's product instruction. kFma and kBf16Dot compute the same summation, to the
// bit; kAmx its own order (Note [AMX GEMM] in gemm_amx.cc), within the same rounding bound.
enum class HalfGemmKernel {
  kFma,      // vfmadd231ps on inputs widened to fp32 while packing (bf16 or half; AVX-512 F)
  kBf16Dot,  // vdpbf16ps on bf16 pairs (bf16 only; AVX512_BF16)
  kAmx,      // TDPBF16PS on AMX tiles (bf16 only; AMX-TILE and AMX-BF16, granted by the OS)
};
const char* HalfGemmKernelName(HalfGemmKernel kernel);  // "fma", "vdpbf16ps", "amx"
// Whether this CPU has AMX-TILE, AMX-BF16 and the AVX-512 subset, and Linux let this process
// use the tile state (asked once, on the first call).
bool AmxAvailable();
// GemmHalfBlock's bf16 product on AMX (Note [AMX GEMM]): rows [m0, m1) x columns [n0, n1) of C,
// k > 0 and alpha != 0. Requires AmxAvailable().
void GemmAmxBlock(bool trans_a, bool trans_b, int k, float alpha, const uint16_t* a, int lda,
                  const uint16_t* b, int ldb, float beta, float* c, int ldc, int m0, int m1, int n0,
                  int n1);
// True when this CPU has the AVX-512 subset the kernels use (F, BW, VL, DQ).
bool HaveGemmHalfAvx512();
bool CanRunHalfGemmKernel(HalfGemmKernel kernel);
// The kernel GemmHalf uses for bf16: kAmx where AmxAvailable(), else the faster of the other two
// on this CPU, timed once per process on first use (their bits do not depend on it); or the one
// PIPEWRIGHT_BF16_GEMM=fma|dot|amx forces (if this CPU runs it); kFma without AVX512_BF16.
HalfGemmKernel Bf16GemmKernel();
// Rows [m_begin, m_end) x columns [n_begin, n_end) of GemmHalf's C; the rest of C is not
// touched. One fp32 running sum per element, in a fixed order: beta * C (when alpha == 1), then
// the k in increasing pairs, odd k first (kAmx: Note [AMX GEMM]'s order); denormals flushed. The
// bits do not depend on the range (nor, between kFma and kBf16Dot, on the kernel), so callers
// may split C by rows or columns across threads. k == 0 or alpha == 0
// only scales C (A and B are not read). Requires CanRunHalfGemmKernel(kernel), and kFma for
// half. Single-threaded; packing scratch is per thread, allocated on first use.
void GemmHalfBlock(bool is_bf16, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                   const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                   int ldc, int m_begin, int m_end, int n_begin, int n_end, HalfGemmKernel kernel);

// A fused epilogue for the fp32 GEMM (Note [GEMM epilogue] in gemm_bf16.cc): after an element's
// sum is final, C += bias[column] (bias: n floats, or null) and, with act, act = GELU(C) (act:
// m x n, row stride ld_act; C keeps the pre-activation). The same bits as the GEMM followed by
// BiasAdd and BiasGeluForward on the AVX-512 kernels. With residual (m x n, row stride ld_act;
// act null), C = (sum + bias) + residual[i, j]: the same bits as then adding the residual
// (Add, AddInPlace).
struct GemmEpilogue {
  const float* bias = nullptr;
  float* act = nullptr;
  int ld_act = 0;
  const float* residual = nullptr;
};

// fp32 GEMM on AVX-512 with the same blocking and micro-kernel (Note [fp32 GEMM] in
// gemm_bf16.cc): rows [m_begin, m_end) x columns [n_begin, n_end) of C. Each element is one fp32
// running sum over k in increasing order (fused multiply-adds), starting from beta * C when
// alpha == 1, so the bits do not depend on the range computed. Requires HaveGemmHalfAvx512(), and
// k > 0 and alpha != 0 with an epilogue.
void GemmF32Block(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                  int lda, const float* b, int ldb, float beta, float* c, int ldc, int m_begin,
                  int m_end, int n_begin, int n_end, const GemmEpilogue& epilogue = {});
// Gemm with alpha = 1, beta = 0 and an epilogue (GemmEpilogue), split over the calling thread's
// pool like Gemm. Requires OwnF32Gemm() and k > 0.
void GemmFused(bool trans_a, bool trans_b, int m, int n, int k, const float* a, int lda,
               const float* b, int ldb, float* c, int ldc, const GemmEpilogue& epilogue);

// ---- elementwise ----
// y[r, c] += bias[c]
void BiasAdd(float* y, const float* bias, int rows, int cols, Isa isa = KernelIsa());
// dbias[c] += sum_r dy[r, c], adding the rows onto dbias in row order (the same bits on every
// ISA).
void BiasBackward(const float* dy, float* dbias, int rows, int cols, Isa isa = KernelIsa());
// The same over columns [0, cols) of rows `ld` floats apart (a column range of a wider matrix:
// a column's bits do not depend on which columns one call covers).
void BiasBackward(const float* dy, int ld, float* dbias, int rows, int cols, Isa isa = KernelIsa());
// out = a + b (out may alias a or b)
void Add(const float* a, const float* b, float* out, size_t n, Isa isa = KernelIsa());
// y += x
void AddInPlace(float* y, const float* x, size_t n, Isa isa = KernelIsa());
// x *= s
void Scale(float* x, size_t n, float s, Isa isa = KernelIsa());
// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed as
// x / (1 + exp(-2 sqrt(2/pi) (x + 0.044715 x^3))) (Note [GELU as a sigmoid] in elementwise.cc).
void GeluForward(const float* x, float* y, size_t n, Isa isa = KernelIsa());
// dx = dy * gelu'(x)  (dx may alias dy)
void GeluBackward(const float* x, const float* dy, float* dx, size_t n, Isa isa = KernelIsa());
// The MLP's bias + GELU in one pass over x [rows, cols]: pre = x + bias (row-broadcast; not
// stored when pre is null), y = GeluForward(pre). pre and y may alias x. The same bits as BiasAdd
// then GeluForward.
void BiasGeluForward(const float* x, const float* bias, float* pre, float* y, int rows, int cols,
                     Isa isa = KernelIsa());
// Its backward in one pass: dpre = dy * gelu'(pre) (overwritten; may alias dy) and
// dbias[c] += sum_r dpre[r, c] (accumulates). The same bits as GeluBackward then BiasBackward.
void BiasGeluBackward(const float* pre, const float* dy, float* dpre, float* dbias, int rows,
                      int cols, Isa isa = KernelIsa());
// The same over columns [0, cols) of rows `ld` floats apart (a column range).
void BiasGeluBackward(const float* pre, const float* dy, float* dpre, float* dbias, int rows,
                      int cols, int ld, Isa isa = KernelIsa());

// ---- LayerNorm over the last dimension ----
// y = (x - mean) * rstd * gamma + beta; mean/rstd (length rows) are saved for backward.
void LayerNormForward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                      float* rstd, int rows, int cols, float eps, Isa isa = KernelIsa());
// dx = dL/dx (overwritten).
void LayerNormBackwardInput(const float* x, const float* gamma, const float* mean,
                            const float* rstd, const float* dy, float* dx, int rows, int cols,
                            Isa isa = KernelIsa());
// dgamma += sum_r dy * xhat, dbeta += sum_r dy.
void LayerNormBackwardWeight(const float* x, const float* mean, const float* rstd, const float* dy,
                             float* dgamma, float* dbeta, int rows, int cols,
                             Isa isa = KernelIsa());
// The same over columns [0, cols) of x and dy, whose rows are `ld` floats apart (a column range).
void LayerNormBackwardWeight(const float* x, const float* mean, const float* rstd, const float* dy,
                             int ld, float* dgamma, float* dbeta, int rows, int cols,
                             Isa isa = KernelIsa());

// ---- fused softmax cross-entropy (numerically stable: max-subtracted, log-sum-exp) ----
// targets[r] in [0, vocab) or negative to ignore the row. Returns the SUM of per-row losses over
// non-ignored rows; *count receives the number of non-ignored rows.
double SoftmaxCrossEntropyForward(const float* logits, const int32_t* targets, int rows, int vocab,
                                  int64_t* count, Isa isa = KernelIsa());
// dlogits[r, :] = scale * (softmax(logits[r]) - onehot(targets[r])); zero for ignored rows.
void SoftmaxCrossEntropyBackward(const float* logits, const int32_t* targets, int rows, int vocab,
                                 float scale, float* dlogits, Isa isa = KernelIsa());

// ---- multi-head causal self-attention (flash-style; Note [CPU attention tiling]) ----
// qkv: [B, T, 3C] laid out as (q | k | v), each C = H * D with head h at columns [h*D, (h+1)*D);
// out: [B, T, C]; scale 1/sqrt(D); key j attends to query i iff j <= i. lse: [B, H, T], the
// log-sum-exp of each query row's scaled scores, from which the backward recomputes the
// probabilities (the CUDA kernel's layout; memory is O(T D) per head, never O(T^2)).
// The functions compute the (batch, head) pairs p = b * H + h in [begin, end) (all of them:
// [0, B * H)). A pair's results do not depend on the range, so callers may split [0, B * H)
// across threads, each with its own scratch. `isa` must be one this CPU runs (KernelIsa() or
// narrower); the ISAs may round differently.
//
// Caller-owned scratch of one call, in floats (for any range of pairs).
size_t AttentionForwardScratchFloats(int T, int C, int H);
size_t AttentionBackwardScratchFloats(int T, int C, int H);
// out and lse (overwritten) for pairs [begin, end).
void AttentionForward(const float* qkv, float* out, float* lse, int T, int C, int H, int begin,
                      int end, float* scratch, Isa isa = KernelIsa());
// The q, k and v gradients of pairs [begin, end) in dqkv [B, T, 3C] (overwritten) from dout
// [B, T, C] and the forward's qkv, out and lse.
void AttentionBackward(const float* dout, const float* qkv, const float* out, const float* lse,
                       float* dqkv, int T, int C, int H, int begin, int end, float* scratch,
                       Isa isa = KernelIsa());

// Incremental decoding's attention (Note [Decoding attention] in attention_decode.cc): for n
// query rows of one sequence at positions [start, start + n), row i of q at q + i * ldq (head h
// at columns [h D, (h+1) D), D = C / H), and the keys and values of positions [0, start + n),
// row j at kv + j * ldkv (k at columns [0, C), v at [C, 2C)): out row i (at out + i * ldo) =
// softmax(q_i k_j^T / sqrt(D) over keys j <= start + i) v, for heads [begin, end) (all:
// [0, H)). A head's results do not depend on the range. scratch: AttentionDecodeScratchFloats(
// start + n, C, H) floats, caller-owned, one per concurrent call.
size_t AttentionDecodeScratchFloats(int keys, int C, int H);
void AttentionDecode(const float* q, int ldq, const float* kv, int ldkv, float* out, int ldo,
                     int start, int n, int C, int H, int begin, int end, float* scratch,
                     Isa isa = KernelIsa());

// ---- embedding: token + learned position ----
// out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]. Tokens must be in [0, V) (caller checks).
void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* out, int B,
                      int T, int C);
// dwte[tokens[b,t], :] += dout[b,t,:]; dwpe[t, :] += sum_b dout[b,t,:]
void EmbeddingBackward(const float* dout, const int32_t* tokens, float* dwte, float* dwpe, int B,
                       int T, int C);

// ---- optimizers (one parameter tensor; step t >= 1) ----
// Decoupled weight decay (Loshchilov & Hutter): p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p).
// The gradient used is grad[i] * grad_scale (the value a separate Scale would have stored).
void AdamWUpdate(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                 float beta1, float beta2, float eps, float weight_decay, int64_t t,
                 float grad_scale = 1.0f, Isa isa = KernelIsa());
// buf = momentum * buf + (grad + wd * p); p -= lr * buf   (PyTorch SGD semantics, no dampening)
void SgdMomentumUpdate(float* param, const float* grad, float* buf, size_t n, float lr,
                       float momentum, float weight_decay, Isa isa = KernelIsa());

// ---- reductions ----
// sum of squares in double (for global gradient norms)
double SumSquares(const float* x, size_t n, Isa isa = KernelIsa());
// true when every element is finite (exact on every ISA)
bool AllFinite(const float* x, size_t n, Isa isa = KernelIsa());

}  // namespace pipewright::cpu

#endif  // PIPEWRIGHT_KERNELS_CPU_CPU_KERNELS_H_
