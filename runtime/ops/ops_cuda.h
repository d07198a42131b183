// The CUDA branch of pipewright/ops.h: the same functions with their checks done, enqueued on
// the allocator's stream. Implemented in ops_cuda.cu, which only CUDA builds compile: ops.cc
// calls these under `if constexpr (kWithCuda)`, so a build without CUDA needs no definitions
// (a CUDA tensor cannot exist there; CheckDevice refuses a CUDA Exec).
#ifndef PIPEWRIGHT_RUNTIME_OPS_OPS_CUDA_H_
#define PIPEWRIGHT_RUNTIME_OPS_OPS_CUDA_H_

#include "pipewright/ops.h"

namespace pipewright::ops::cuda_impl {

absl::Status Gemm(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const Tensor& a, int64_t lda, const Tensor& b, int64_t ldb,
                  float beta, Tensor& c, int64_t ldc, bool allow_tf32);
absl::Status Cast(const Exec& e, const Tensor& x, Tensor& y);
absl::Status BiasAdd(const Exec& e, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols);
absl::Status BiasBackward(const Exec& e, const Tensor& dy, Tensor& dbias, int64_t rows,
                          int64_t cols);
absl::Status Add(const Exec& e, const Tensor& a, const Tensor& b, Tensor& out);
absl::Status AddInPlace(const Exec& e, Tensor& y, const Tensor& x);
absl::Status Scale(const Exec& e, Tensor& x, float s);
absl::Status GeluForward(const Exec& e, const Tensor& x, Tensor& y);
absl::Status GeluBackward(const Exec& e, const Tensor& x, const Tensor& dy, Tensor& dx);
// x += bias in place, y = GELU(x): the fused kernel with pre = x.
absl::Status BiasGeluForward(const Exec& e, Tensor& x, const Tensor& bias, Tensor& y, int64_t rows,
                             int64_t cols);
absl::Status LayerNormForward(const Exec& e, const Tensor& x, const Tensor& gamma,
                              const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                              int64_t rows, int64_t cols, float eps);
absl::Status LayerNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& gamma,
                                    const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, int64_t rows, int64_t cols);
absl::Status LayerNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dy, Tensor& dgamma,
                                     Tensor& dbeta, int64_t rows, int64_t cols);
absl::StatusOr<double> CrossEntropyForward(const Exec& e, const Tensor& logits,
                                           const Tensor& targets, int64_t rows, int64_t vocab,
                                           int64_t* count);
absl::Status CrossEntropyBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                  int64_t rows, int64_t vocab, float scale, Tensor& dlogits);
absl::Status AttentionForward(const Exec& e, const Tensor& qkv, Tensor& out, Tensor& lse, int64_t B,
                              int64_t T, int64_t C, int64_t H);
// The Llama family (runtime/ops/llama_ops.cc; kernels/cuda/llama.cuh).
absl::Status RmsNormForward(const Exec& e, const Tensor& x, const Tensor& w, Tensor& y,
                            Tensor& rstd, int64_t rows, int64_t cols, float eps);
absl::Status RmsNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& w,
                                  const Tensor& rstd, const Tensor& dy, Tensor& dx, int64_t rows,
                                  int64_t cols);
absl::Status RmsNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& rstd,
                                   const Tensor& dy, Tensor& dw, int64_t rows, int64_t cols);
absl::Status Rope(const Exec& e, Tensor& x, int64_t rows, int64_t T, int64_t ld, int64_t col,
                  int64_t heads, int64_t D, double theta, bool inverse, int64_t first);
absl::Status SwiGluForward(const Exec& e, const Tensor& gu, Tensor& out, int64_t rows, int64_t F);
absl::Status SwiGluBackward(const Exec& e, const Tensor& gu, const Tensor& dout, Tensor& dgu,
                            int64_t rows, int64_t F);
absl::Status ExpandKv(const Exec& e, const Tensor& x, Tensor& qkv, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D);
absl::Status ReduceKv(const Exec& e, const Tensor& dqkv, Tensor& dx, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D);
absl::Status TokenEmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& table,
                                   Tensor& out, int64_t n, int64_t C);
absl::Status TokenEmbeddingBackward(const Exec& e, const Tensor& tokens, const Tensor& dout,
                                    Tensor& dtable, int64_t n, int64_t C);

absl::Status AttentionDecode(const Exec& e, const Tensor& qkv, const Tensor& kv, Tensor& out,
                             int64_t start, int64_t n, int64_t C, int64_t H);
absl::Status AttentionBackward(const Exec& e, const Tensor& dout, const Tensor& qkv,
                               const Tensor& out, const Tensor& lse, Tensor& dqkv, int64_t B,
                               int64_t T, int64_t C, int64_t H);
absl::Status EmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& wte,
                              const Tensor& wpe, Tensor& out, int64_t B, int64_t T, int64_t C);
absl::Status EmbeddingBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                               Tensor& dwte, Tensor& dwpe, int64_t B, int64_t T, int64_t C);
absl::Status EmbeddingPartForward(const Exec& e, const Tensor& tokens, const Tensor& wte_part,
                                  int64_t begin, const Tensor& wpe, Tensor& out, int64_t B,
                                  int64_t T, int64_t C);
absl::Status EmbeddingPartBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                                   int64_t begin, Tensor& dwte_part, Tensor& dwpe, int64_t B,
                                   int64_t T, int64_t C);
absl::Status RowMax(const Exec& e, const Tensor& logits, int64_t rows, int64_t cols, Tensor& max);
absl::Status CrossEntropyPartStats(const Exec& e, const Tensor& logits, const Tensor& targets,
                                   int64_t begin, const Tensor& maxima, int64_t ranks, int64_t rows,
                                   int64_t cols, Tensor& stats);
absl::Status CrossEntropyPartBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                      int64_t begin, const Tensor& stats, int64_t rows,
                                      int64_t cols, float scale, Tensor& dlogits);
absl::Status AdamW(const Exec& e, const std::vector<AdamWItem>& items, float lr, float beta1,
                   float beta2, float eps, int64_t t);
absl::StatusOr<double> SumSquares(const Exec& e, const std::vector<const Tensor*>& ts);
absl::Status SquareSumsByChunk(const Exec& e, const Tensor& t, int64_t chunk,
                               std::vector<double>* out);
// Frees the stream's cuBLAS context (ops::ReleaseStream for a CUDA stream).
void ReleaseStream(Stream stream);

}  // namespace pipewright::ops::cuda_impl

#endif  // PIPEWRIGHT_RUNTIME_OPS_OPS_CUDA_H_
