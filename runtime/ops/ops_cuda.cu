// The CUDA branch of pipewright/ops.h (runtime/ops/ops_cuda.h), compiled only in CUDA builds:
// every op enqueues the kernels/cuda launcher on the stream of the executing allocator. Ops that
// return a host value (a loss sum, a squared norm) copy it back and wait for the stream;
// everything else stays asynchronous.
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/cuda_kernels.cuh"
#include "runtime/ops/ops_cuda.h"

namespace pipewright::ops {
namespace {

cudaStream_t StreamOf(const Exec& e) {
  return static_cast<cudaStream_t>(e.allocator()->stream().handle);
}

// One cuBLAS/cuBLASLt context per (device, stream): a Blas may serve one stream at a time, and
// each rank drives its own stream from one thread at a time. Created on first use, released by
// ReleaseStream when the stream's owner goes away.
std::mutex blas_mu;
std::map<std::pair<int, void*>, std::unique_ptr<cuda::Blas>>& BlasRegistry() {
  static auto* registry = new std::map<std::pair<int, void*>, std::unique_ptr<cuda::Blas>>();
  return *registry;
}

absl::StatusOr<cuda::Blas*> BlasFor(const Exec& e) {
  const int device = e.device().index;
  const std::pair<int, void*> key{device, e.allocator()->stream().handle};
  std::lock_guard<std::mutex> lock(blas_mu);
  auto& reg = BlasRegistry();
  auto it = reg.find(key);
  if (it != reg.end()) return it->second.get();
  PW_ASSIGN_OR_RETURN(std::unique_ptr<cuda::Blas> blas, cuda::Blas::Create(device));
  cuda::Blas* raw = blas.get();
  reg.emplace(key, std::move(blas));
  return raw;
}

int I(int64_t v) { return static_cast<int>(v); }

}  // namespace

namespace cuda_impl {

void ReleaseStream(Stream stream) {
  std::lock_guard<std::mutex> lock(blas_mu);
  BlasRegistry().erase({stream.device.index, stream.handle});
}

absl::Status Gemm(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const Tensor& a, int64_t lda, const Tensor& b, int64_t ldb,
                  float beta, Tensor& c, int64_t ldc, bool allow_tf32) {
  PW_ASSIGN_OR_RETURN(cuda::Blas * blas, BlasFor(e));
  if (a.dtype() == DType::kF32) {
    return cuda::Gemm(StreamOf(e), *blas, trans_a, trans_b, I(m), I(n), I(k), alpha,
                      a.data<float>(), I(lda), b.data<float>(), I(ldb), beta, c.data<float>(),
                      I(ldc), allow_tf32);
  }
  return cuda::GemmHalf(StreamOf(e), *blas, a.dtype() == DType::kBF16, trans_a, trans_b, I(m), I(n),
                        I(k), alpha, a.data<uint16_t>(), I(lda), b.data<uint16_t>(), I(ldb), beta,
                        c.data<float>(), I(ldc));
}

absl::Status Cast(const Exec& e, const Tensor& x, Tensor& y) {
  const size_t n = x.numel();
  if (y.dtype() == DType::kBF16) {
    return cuda::FloatToBf16(StreamOf(e), x.data<float>(), y.data<uint16_t>(), n);
  }
  if (y.dtype() == DType::kF16) {
    return cuda::FloatToHalf(StreamOf(e), x.data<float>(), y.data<uint16_t>(), n);
  }
  if (x.dtype() == DType::kBF16) {
    return cuda::Bf16ToFloat(StreamOf(e), x.data<uint16_t>(), y.data<float>(), n);
  }
  return cuda::HalfToFloat(StreamOf(e), x.data<uint16_t>(), y.data<float>(), n);
}

absl::Status BiasAdd(const Exec& e, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols) {
  return cuda::BiasAdd(StreamOf(e), y.data<float>(), bias.data<float>(), I(rows), I(cols));
}

absl::Status BiasBackward(const Exec& e, const Tensor& dy, Tensor& dbias, int64_t rows,
                          int64_t cols) {
  return cuda::BiasBackward(StreamOf(e), dy.data<float>(), dbias.data<float>(), I(rows), I(cols));
}

absl::Status Add(const Exec& e, const Tensor& a, const Tensor& b, Tensor& out) {
  return cuda::Add(StreamOf(e), a.data<float>(), b.data<float>(), out.data<float>(), a.numel());
}

absl::Status AddInPlace(const Exec& e, Tensor& y, const Tensor& x) {
  return cuda::AddInPlace(StreamOf(e), y.data<float>(), x.data<float>(), y.numel());
}

absl::Status Scale(const Exec& e, Tensor& x, float s) {
  return cuda::Scale(StreamOf(e), x.data<float>(), x.numel(), s);
}

absl::Status GeluForward(const Exec& e, const Tensor& x, Tensor& y) {
  return cuda::GeluForward(StreamOf(e), x.data<float>(), y.data<float>(), x.numel());
}

absl::Status GeluBackward(const Exec& e, const Tensor& x, const Tensor& dy, Tensor& dx) {
  return cuda::GeluBackward(StreamOf(e), x.data<float>(), dy.data<float>(), dx.data<float>(),
                            dy.numel());
}

absl::Status BiasGeluForward(const Exec& e, Tensor& x, const Tensor& bias, Tensor& y, int64_t rows,
                             int64_t cols) {
  return cuda::BiasGeluForward(StreamOf(e), x.data<float>(), bias.data<float>(), x.data<float>(),
                               y.data<float>(), I(rows), I(cols));
}

absl::Status LayerNormForward(const Exec& e, const Tensor& x, const Tensor& gamma,
                              const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                              int64_t rows, int64_t cols, float eps) {
  return cuda::LayerNormForward(StreamOf(e), x.data<float>(), gamma.data<float>(),
                                beta.data<float>(), y.data<float>(), mean.data<float>(),
                                rstd.data<float>(), I(rows), I(cols), eps);
}

absl::Status LayerNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& gamma,
                                    const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, int64_t rows, int64_t cols) {
  return cuda::LayerNormBackwardInput(StreamOf(e), x.data<float>(), gamma.data<float>(),
                                      mean.data<float>(), rstd.data<float>(), dy.data<float>(),
                                      dx.data<float>(), I(rows), I(cols));
}

absl::Status LayerNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dy, Tensor& dgamma,
                                     Tensor& dbeta, int64_t rows, int64_t cols) {
  return cuda::LayerNormBackwardWeight(StreamOf(e), x.data<float>(), mean.data<float>(),
                                       rstd.data<float>(), dy.data<float>(), dgamma.data<float>(),
                                       dbeta.data<float>(), I(rows), I(cols));
}

absl::StatusOr<double> CrossEntropyForward(const Exec& e, const Tensor& logits,
                                           const Tensor& targets, int64_t rows, int64_t vocab,
                                           int64_t* count) {
  // Per-row losses, then the sum and the count (device scratch from the rank's allocator).
  Tensor row_loss = Tensor::Empty({rows}, DType::kF64, e.allocator());
  Tensor sum = Tensor::Empty({1}, DType::kF64, e.allocator());
  Tensor n = Tensor::Empty({1}, DType::kF64, e.allocator());  // 8 bytes for the int64 count
  PW_RETURN_IF_ERROR(cuda::SoftmaxCrossEntropyForward(
      StreamOf(e), logits.data<float>(), targets.data<int32_t>(), I(rows), I(vocab),
      row_loss.data<double>(), sum.data<double>(), static_cast<int64_t*>(n.raw())));
  double host_sum = 0;
  int64_t host_count = 0;
  cudaStream_t s = StreamOf(e);
  PW_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&host_sum, sum.raw(), sizeof(double), cudaMemcpyDeviceToHost, s));
  PW_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&host_count, n.raw(), sizeof(int64_t), cudaMemcpyDeviceToHost, s));
  PW_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  *count = host_count;
  return host_sum;
}

absl::Status CrossEntropyBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                  int64_t rows, int64_t vocab, float scale, Tensor& dlogits) {
  return cuda::SoftmaxCrossEntropyBackward(StreamOf(e), logits.data<float>(),
                                           targets.data<int32_t>(), I(rows), I(vocab), scale,
                                           dlogits.data<float>());
}

absl::Status AttentionForward(const Exec& e, const Tensor& qkv, Tensor& out, Tensor& lse, int64_t B,
                              int64_t T, int64_t C, int64_t H) {
  return cuda::AttentionForward(StreamOf(e), qkv.data<float>(), out.data<float>(),
                                lse.data<float>(), I(B), I(T), I(C), I(H));
}

// ---- The Llama family ----
absl::Status RmsNormForward(const Exec& e, const Tensor& x, const Tensor& w, Tensor& y,
                            Tensor& rstd, int64_t rows, int64_t cols, float eps) {
  return cuda::RmsNormForward(StreamOf(e), x.data<float>(), w.data<float>(), y.data<float>(),
                              rstd.data<float>(), I(rows), I(cols), eps);
}
absl::Status RmsNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& w,
                                  const Tensor& rstd, const Tensor& dy, Tensor& dx, int64_t rows,
                                  int64_t cols) {
  return cuda::RmsNormBackwardInput(StreamOf(e), x.data<float>(), w.data<float>(),
                                    rstd.data<float>(), dy.data<float>(), dx.data<float>(), I(rows),
                                    I(cols));
}
absl::Status RmsNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& rstd,
                                   const Tensor& dy, Tensor& dw, int64_t rows, int64_t cols) {
  return cuda::RmsNormBackwardWeight(StreamOf(e), x.data<float>(), rstd.data<float>(),
                                     dy.data<float>(), dw.data<float>(), I(rows), I(cols));
}
absl::Status Rope(const Exec& e, Tensor& x, int64_t rows, int64_t T, int64_t ld, int64_t col,
                  int64_t heads, int64_t D, double theta, bool inverse, int64_t first) {
  return cuda::Rope(StreamOf(e), x.data<float>(), I(rows), I(T), I(ld), I(col), I(heads), I(D),
                    theta, inverse, I(first));
}
absl::Status SwiGluForward(const Exec& e, const Tensor& gu, Tensor& out, int64_t rows, int64_t F) {
  return cuda::SwiGluForward(StreamOf(e), gu.data<float>(), out.data<float>(), I(rows), I(F));
}
absl::Status SwiGluBackward(const Exec& e, const Tensor& gu, const Tensor& dout, Tensor& dgu,
                            int64_t rows, int64_t F) {
  return cuda::SwiGluBackward(StreamOf(e), gu.data<float>(), dout.data<float>(), dgu.data<float>(),
                              I(rows), I(F));
}
absl::Status ExpandKv(const Exec& e, const Tensor& x, Tensor& qkv, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D) {
  return cuda::ExpandKv(StreamOf(e), x.data<float>(), qkv.data<float>(), I(rows), I(heads),
                        I(kv_heads), I(D));
}
absl::Status ReduceKv(const Exec& e, const Tensor& dqkv, Tensor& dx, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D) {
  return cuda::ReduceKv(StreamOf(e), dqkv.data<float>(), dx.data<float>(), I(rows), I(heads),
                        I(kv_heads), I(D));
}
absl::Status TokenEmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& table,
                                   Tensor& out, int64_t n, int64_t C) {
  return cuda::TokenEmbeddingForward(StreamOf(e), tokens.data<int32_t>(), table.data<float>(),
                                     out.data<float>(), I(n), I(C));
}
absl::Status TokenEmbeddingBackward(const Exec& e, const Tensor& tokens, const Tensor& dout,
                                    Tensor& dtable, int64_t n, int64_t C) {
  return cuda::TokenEmbeddingBackward(StreamOf(e), tokens.data<int32_t>(), dout.data<float>(),
                                      dtable.data<float>(), I(n), I(C));
}

absl::Status AttentionDecode(const Exec& e, const Tensor& qkv, const Tensor& kv, Tensor& out,
                             int64_t start, int64_t n, int64_t C, int64_t H) {
  return cuda::AttentionDecode(StreamOf(e), qkv.data<float>(), I(3 * C), kv.data<float>(), I(2 * C),
                               out.data<float>(), I(C), I(start), I(n), I(C), I(H));
}

absl::Status AttentionBackward(const Exec& e, const Tensor& dout, const Tensor& qkv,
                               const Tensor& out, const Tensor& lse, Tensor& dqkv, int64_t B,
                               int64_t T, int64_t C, int64_t H) {
  Tensor scratch = Tensor::Empty({B, H, T}, DType::kF32, e.allocator());
  return cuda::AttentionBackward(StreamOf(e), dout.data<float>(), qkv.data<float>(),
                                 out.data<float>(), lse.data<float>(), dqkv.data<float>(),
                                 scratch.data<float>(), I(B), I(T), I(C), I(H));
}

absl::Status EmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& wte,
                              const Tensor& wpe, Tensor& out, int64_t B, int64_t T, int64_t C) {
  return cuda::EmbeddingForward(StreamOf(e), tokens.data<int32_t>(), wte.data<float>(),
                                wpe.data<float>(), out.data<float>(), I(B), I(T), I(C));
}

absl::Status EmbeddingBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                               Tensor& dwte, Tensor& dwpe, int64_t B, int64_t T, int64_t C) {
  return cuda::EmbeddingBackward(StreamOf(e), dout.data<float>(), tokens.data<int32_t>(),
                                 dwte.data<float>(), dwpe.data<float>(), I(B), I(T), I(C));
}

absl::Status EmbeddingPartForward(const Exec& e, const Tensor& tokens, const Tensor& wte_part,
                                  int64_t begin, const Tensor& wpe, Tensor& out, int64_t B,
                                  int64_t T, int64_t C) {
  return cuda::EmbeddingPartForward(
      StreamOf(e), tokens.data<int32_t>(), wte_part.data<float>(), begin, wte_part.dim(0),
      wpe.defined() ? wpe.data<float>() : nullptr, out.data<float>(), I(B), I(T), I(C));
}

absl::Status EmbeddingPartBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                                   int64_t begin, Tensor& dwte_part, Tensor& dwpe, int64_t B,
                                   int64_t T, int64_t C) {
  return cuda::EmbeddingPartBackward(
      StreamOf(e), dout.data<float>(), tokens.data<int32_t>(), begin, dwte_part.dim(0),
      dwte_part.data<float>(), dwpe.defined() ? dwpe.data<float>() : nullptr, I(B), I(T), I(C));
}

absl::Status RowMax(const Exec& e, const Tensor& logits, int64_t rows, int64_t cols, Tensor& max) {
  return cuda::RowMax(StreamOf(e), logits.data<float>(), I(rows), I(cols), max.data<float>());
}

absl::Status CrossEntropyPartStats(const Exec& e, const Tensor& logits, const Tensor& targets,
                                   int64_t begin, const Tensor& maxima, int64_t ranks, int64_t rows,
                                   int64_t cols, Tensor& stats) {
  return cuda::CrossEntropyPartStats(StreamOf(e), logits.data<float>(), targets.data<int32_t>(),
                                     begin, maxima.data<float>(), I(ranks), I(rows), I(cols),
                                     stats.data<double>());
}

absl::Status CrossEntropyPartBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                      int64_t begin, const Tensor& stats, int64_t rows,
                                      int64_t cols, float scale, Tensor& dlogits) {
  return cuda::CrossEntropyPartBackward(StreamOf(e), logits.data<float>(), targets.data<int32_t>(),
                                        begin, stats.data<double>(), I(rows), I(cols), scale,
                                        dlogits.data<float>());
}

absl::Status AdamW(const Exec& e, const std::vector<AdamWItem>& items, float lr, float beta1,
                   float beta2, float eps, int64_t t) {
  std::vector<cuda::AdamWTensor> list;
  list.reserve(items.size());
  for (const AdamWItem& it : items) {
    list.push_back({it.param->data<float>(), it.grad->data<float>(), it.m->data<float>(),
                    it.v->data<float>(), it.param->numel(), it.weight_decay});
  }
  if (list.empty()) return absl::OkStatus();
  return cuda::AdamWMulti(StreamOf(e), list.data(), static_cast<int>(list.size()), lr, beta1, beta2,
                          eps, t);
}

absl::StatusOr<double> SumSquares(const Exec& e, const std::vector<const Tensor*>& ts) {
  if (ts.empty()) return 0.0;
  std::vector<const float*> ptrs;
  std::vector<int64_t> sizes;
  for (const Tensor* t : ts) {
    ptrs.push_back(t->data<float>());
    sizes.push_back(t->numel());
  }
  const int64_t count = static_cast<int64_t>(ts.size());
  Tensor out = Tensor::Empty({count}, DType::kF64, e.allocator());
  cudaStream_t s = StreamOf(e);
  PW_RETURN_IF_ERROR(cuda::SumSquaresMulti(s, ptrs.data(), sizes.data(), static_cast<int>(count),
                                           out.data<double>()));
  std::vector<double> host(count);
  PW_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host.data(), out.raw(), count * sizeof(double), cudaMemcpyDeviceToHost, s));
  PW_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  double sum = 0;  // per tensor, in order: the CPU's grouping
  for (double v : host) sum += v;
  return sum;
}

absl::Status SquareSumsByChunk(const Exec& e, const Tensor& t, int64_t chunk,
                               std::vector<double>* out) {
  // Each chunk is one "tensor" of the multi-tensor reduction, whose blocking depends only on
  // a tensor's size: a chunk's sum depends only on its elements.
  std::vector<const float*> ptrs;
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < t.numel(); i += chunk) {
    ptrs.push_back(t.data<float>() + i);
    sizes.push_back(std::min(chunk, t.numel() - i));
  }
  const int64_t count = static_cast<int64_t>(ptrs.size());
  if (count == 0) return absl::OkStatus();
  Tensor dev = Tensor::Empty({count}, DType::kF64, e.allocator());
  cudaStream_t s = StreamOf(e);
  PW_RETURN_IF_ERROR(cuda::SumSquaresMulti(s, ptrs.data(), sizes.data(), static_cast<int>(count),
                                           dev.data<double>()));
  const size_t first = out->size();
  out->resize(first + count);
  PW_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out->data() + first, dev.raw(), count * sizeof(double),
                                          cudaMemcpyDeviceToHost, s));
  PW_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

}  // namespace cuda_impl
}  // namespace pipewright::ops
