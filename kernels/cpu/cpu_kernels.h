// CPU reference kernels. One function per op; all are synchronous on the calling thread and
// single-threaded unless noted (OpenBLAS threading is process-wide and set by the caller).
//
// Invariants shared by every kernel here:
//  - Tensors are dense, row-major, float32 unless the name says otherwise.
//  - "rows" is the flattened leading dimensions (batch * sequence), "cols" the last one.
//  - Functions named *Backward* that produce a weight gradient ACCUMULATE into it (+=), so that
//    gradients sum across micro-batches; functions that produce an input gradient OVERWRITE it.
//  - No function allocates on the heap except where noted (attention scratch is caller-owned).
#ifndef PIPEWRIGHT_KERNELS_CPU_CPU_KERNELS_H_
#define PIPEWRIGHT_KERNELS_CPU_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace pipewright::cpu {

// ---- dtype conversion (round-to-nearest-even; NaN preserved) ----
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
void FloatToBf16(const float* in, uint16_t* out, size_t n);
void Bf16ToFloat(const uint16_t* in, float* out, size_t n);
void FloatToHalf(const float* in, uint16_t* out, size_t n);
void HalfToFloat(const uint16_t* in, float* out, size_t n);

// ---- GEMM ----
// C[m,n] = alpha * op(A) * op(B) + beta * C, row-major; op(X) = X or X^T.
// A is m x k after op, B is k x n after op. lda/ldb/ldc are row strides of the stored matrices.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc);
// Same with 16-bit inputs (is_bf16: bfloat16, else IEEE half), converted to f32; f32 output.
void GemmHalf(bool is_bf16, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
              const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
              int ldc);

// ---- elementwise ----
// y[r, c] += bias[c]
void BiasAdd(float* y, const float* bias, int rows, int cols);
// dbias[c] += sum_r dy[r, c]
void BiasBackward(const float* dy, float* dbias, int rows, int cols);
// out = a + b (out may alias a or b)
void Add(const float* a, const float* b, float* out, size_t n);
// y += x
void AddInPlace(float* y, const float* x, size_t n);
// x *= s
void Scale(float* x, size_t n, float s);
// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void GeluForward(const float* x, float* y, size_t n);
// dx = dy * gelu'(x)  (dx may alias dy)
void GeluBackward(const float* x, const float* dy, float* dx, size_t n);

// ---- LayerNorm over the last dimension ----
// y = (x - mean) * rstd * gamma + beta; mean/rstd (length rows) are saved for backward.
void LayerNormForward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                      float* rstd, int rows, int cols, float eps);
// dx = dL/dx (overwritten).
void LayerNormBackwardInput(const float* x, const float* gamma, const float* mean,
                            const float* rstd, const float* dy, float* dx, int rows, int cols);
// dgamma += sum_r dy * xhat, dbeta += sum_r dy.
void LayerNormBackwardWeight(const float* x, const float* mean, const float* rstd, const float* dy,
                             float* dgamma, float* dbeta, int rows, int cols);

// ---- fused softmax cross-entropy (numerically stable: max-subtracted, log-sum-exp) ----
// targets[r] in [0, vocab) or negative to ignore the row. Returns the SUM of per-row losses over
// non-ignored rows; *count receives the number of non-ignored rows.
double SoftmaxCrossEntropyForward(const float* logits, const int32_t* targets, int rows, int vocab,
                                  int64_t* count);
// dlogits[r, :] = scale * (softmax(logits[r]) - onehot(targets[r])); zero for ignored rows.
void SoftmaxCrossEntropyBackward(const float* logits, const int32_t* targets, int rows, int vocab,
                                 float scale, float* dlogits);

// ---- multi-head causal self-attention ----
// qkv: [B, T, 3C] laid out as (q | k | v), each C = H * D with head h at columns [h*D, (h+1)*D).
// out: [B, T, C]. probs: [B, H, T, T] softmax probabilities saved for backward (upper triangle
// written as zero). Scale 1/sqrt(D).
void AttentionForward(const float* qkv, float* out, float* probs, int B, int T, int C, int H);
// dqkv (overwritten) from dout, qkv and saved probs. scratch: at least T*T floats.
void AttentionBackward(const float* dout, const float* qkv, const float* probs, float* dqkv,
                       float* scratch, int B, int T, int C, int H);

// ---- embedding: token + learned position ----
// out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]. Tokens must be in [0, V) (caller checks).
void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* out, int B,
                      int T, int C);
// dwte[tokens[b,t], :] += dout[b,t,:]; dwpe[t, :] += sum_b dout[b,t,:]
void EmbeddingBackward(const float* dout, const int32_t* tokens, float* dwte, float* dwpe, int B,
                       int T, int C);

// ---- optimizers (one parameter tensor; step t >= 1) ----
// Decoupled weight decay (Loshchilov & Hutter): p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p).
void AdamWUpdate(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                 float beta1, float beta2, float eps, float weight_decay, int64_t t);
// buf = momentum * buf + (grad + wd * p); p -= lr * buf   (PyTorch SGD semantics, no dampening)
void SgdMomentumUpdate(float* param, const float* grad, float* buf, size_t n, float lr,
                       float momentum, float weight_decay);

// ---- reductions ----
// sum of squares in double (for global gradient norms)
double SumSquares(const float* x, size_t n);
// true when every element is finite
bool AllFinite(const float* x, size_t n);

}  // namespace pipewright::cpu

#endif  // PIPEWRIGHT_KERNELS_CPU_CPU_KERNELS_H_
