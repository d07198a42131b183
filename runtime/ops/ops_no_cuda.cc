// The CUDA branch of ops.h in a build without CUDA: every entry point reports that this build
// has no CUDA (a CUDA tensor cannot exist here, so these are reached only through misuse).
#include "runtime/ops/ops_cuda.h"

namespace pipewright::ops::cuda_impl {
namespace {
absl::Status NoCuda() { return absl::FailedPreconditionError("pipewright was built without CUDA"); }
}  // namespace

absl::Status Gemm(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const Tensor& a, int64_t lda, const Tensor& b, int64_t ldb,
                  float beta, Tensor& c, int64_t ldc, bool allow_tf32) {
  return NoCuda();
}

absl::Status Cast(const Exec& e, const Tensor& x, Tensor& y) { return NoCuda(); }

absl::Status BiasAdd(const Exec& e, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols) {
  return NoCuda();
}

absl::Status BiasBackward(const Exec& e, const Tensor& dy, Tensor& dbias, int64_t rows,
                          int64_t cols) {
  return NoCuda();
}

absl::Status Add(const Exec& e, const Tensor& a, const Tensor& b, Tensor& out) { return NoCuda(); }

absl::Status AddInPlace(const Exec& e, Tensor& y, const Tensor& x) { return NoCuda(); }

absl::Status Scale(const Exec& e, Tensor& x, float s) { return NoCuda(); }

absl::Status GeluForward(const Exec& e, const Tensor& x, Tensor& y) { return NoCuda(); }

absl::Status GeluBackward(const Exec& e, const Tensor& x, const Tensor& dy, Tensor& dx) {
  return NoCuda();
}

absl::Status LayerNormForward(const Exec& e, const Tensor& x, const Tensor& gamma,
                              const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                              int64_t rows, int64_t cols, float eps) {
  return NoCuda();
}

absl::Status LayerNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& gamma,
                                    const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, int64_t rows, int64_t cols) {
  return NoCuda();
}

absl::Status LayerNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dy, Tensor& dgamma,
                                     Tensor& dbeta, int64_t rows, int64_t cols) {
  return NoCuda();
}

absl::StatusOr<double> CrossEntropyForward(const Exec& e, const Tensor& logits,
                                           const Tensor& targets, int64_t rows, int64_t vocab,
                                           int64_t* count) {
  return NoCuda();
}

absl::Status CrossEntropyBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                  int64_t rows, int64_t vocab, float scale, Tensor& dlogits) {
  return NoCuda();
}

absl::Status AttentionForward(const Exec& e, const Tensor& qkv, Tensor& out, Tensor& lse, int64_t B,
                              int64_t T, int64_t C, int64_t H) {
  return NoCuda();
}

absl::Status AttentionBackward(const Exec& e, const Tensor& dout, const Tensor& qkv,
                               const Tensor& out, const Tensor& lse, Tensor& dqkv, int64_t B,
                               int64_t T, int64_t C, int64_t H) {
  return NoCuda();
}

absl::Status EmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& wte,
                              const Tensor& wpe, Tensor& out, int64_t B, int64_t T, int64_t C) {
  return NoCuda();
}

absl::Status EmbeddingBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                               Tensor& dwte, Tensor& dwpe, int64_t B, int64_t T, int64_t C) {
  return NoCuda();
}

absl::Status AdamW(const Exec& e, const std::vector<AdamWItem>& items, float lr, float beta1,
                   float beta2, float eps, int64_t t) {
  return NoCuda();
}

absl::StatusOr<double> SumSquares(const Exec& e, const std::vector<const Tensor*>& ts) {
  return NoCuda();
}

absl::Status CopyBytes(const Exec& e, void* dst, Device dst_device, const void* src,
                       Device src_device, size_t bytes) {
  return NoCuda();
}

}  // namespace pipewright::ops::cuda_impl

namespace pipewright::ops {
void ReleaseStream(Stream) {}
}  // namespace pipewright::ops
