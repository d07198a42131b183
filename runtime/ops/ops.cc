// Dispatch of pipewright/ops.h: the checks shared by both devices, the CPU branch (the reference
// kernels, exactly as the layers called them) and, in CUDA builds, the call into the CUDA branch
// (runtime/ops/ops_cuda.h, implemented in ops_cuda.cu).
//
// Note [CUDA branch without stubs]: each op reaches the CUDA branch inside
// `if constexpr (kWithCuda)`. Without CUDA the branch is a discarded statement: it is still
// type-checked against ops_cuda.h, but its functions are not odr-used, so ops_cuda.cu is not
// compiled and nothing stands in for it. A CUDA tensor cannot exist in such a build, and
// CheckDevice, which every op runs first, refuses an Exec that claims a CUDA device.
#include "pipewright/ops.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_kernels.h"
#include "runtime/ops/ops_cuda.h"

namespace pipewright::ops {
namespace {

#if PIPEWRIGHT_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

std::atomic<bool> allow_tf32{false};

bool IsHalf(DType d) { return d == DType::kBF16 || d == DType::kF16; }

absl::Status Need(bool ok, const char* op, const std::string& what) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// Host to host is a memcpy on the calling thread; anything touching a GPU is ordered on the
// executing stream, and a copy into host memory is complete on return.
absl::Status CopyBytesOn(const Exec& e, void* dst, Device dst_device, const void* src,
                         Device src_device, size_t bytes) {
  const Stream stream = e.allocator()->stream();
  PW_RETURN_IF_ERROR(CopyBytes(dst, dst_device, src, src_device, bytes, stream));
  if (bytes == 0 || src_device.is_cpu() || dst_device.is_cuda()) return absl::OkStatus();
  return SynchronizeStream(stream);
}

}  // namespace

Allocator* Exec::allocator() const { return alloc != nullptr ? alloc : DefaultCpuAllocator(); }
Device Exec::device() const { return allocator()->device(); }

absl::Status CheckDevice(const Exec& e, const char* op, std::initializer_list<const Tensor*> ts) {
  const Device d = e.device();
  if constexpr (!kWithCuda) {
    if (d.is_cuda()) {
      return absl::FailedPreconditionError(
          absl::StrCat(op, ": runs on ", d.ToString(), ", but pipewright was built without CUDA"));
    }
  }
  int i = 0;
  for (const Tensor* t : ts) {
    if (t != nullptr && t->defined() && t->device() != d) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": operand ", i, " ", t->ShapeString(),
                                                     " is on ", t->device().ToString(),
                                                     ", but the op runs on ", d.ToString()));
    }
    ++i;
  }
  return absl::OkStatus();
}

void SetAllowTf32(bool allow) { allow_tf32.store(allow); }

absl::Status Gemm(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  float alpha, const Tensor& a, int64_t lda, const Tensor& b, int64_t ldb,
                  float beta, Tensor& c, int64_t ldc) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "gemm", {&a, &b, &c}));
  const bool half = IsHalf(a.dtype());
  PW_RETURN_IF_ERROR(
      Need(a.dtype() == b.dtype() && (half || a.dtype() == DType::kF32) && c.dtype() == DType::kF32,
           "gemm", "A and B must both be f32, bf16 or f16 and C f32"));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::Gemm(e, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                             allow_tf32.load());
    }
  }
  if (half) {
    cpu::GemmHalf(a.dtype() == DType::kBF16, trans_a, trans_b, m, n, k, alpha, a.data<uint16_t>(),
                  lda, b.data<uint16_t>(), ldb, beta, c.data<float>(), ldc);
  } else {
    cpu::Gemm(trans_a, trans_b, m, n, k, alpha, a.data<float>(), lda, b.data<float>(), ldb, beta,
              c.data<float>(), ldc);
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Cast(const Exec& e, const Tensor& x, DType dtype) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "cast", {&x}));
  PW_RETURN_IF_ERROR(Need(
      (x.dtype() == DType::kF32 && IsHalf(dtype)) || (IsHalf(x.dtype()) && dtype == DType::kF32),
      "cast", absl::StrCat("cannot convert ", DTypeName(x.dtype()), " to ", DTypeName(dtype))));
  Tensor y = Tensor::Empty(x.shape(), dtype, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::Cast(e, x, y));
      return y;
    }
  }
  const size_t n = x.numel();
  if (dtype == DType::kBF16) {
    cpu::FloatToBf16(x.data<float>(), y.data<uint16_t>(), n);
  } else if (dtype == DType::kF16) {
    cpu::FloatToHalf(x.data<float>(), y.data<uint16_t>(), n);
  } else if (x.dtype() == DType::kBF16) {
    cpu::Bf16ToFloat(x.data<uint16_t>(), y.data<float>(), n);
  } else {
    cpu::HalfToFloat(x.data<uint16_t>(), y.data<float>(), n);
  }
  return y;
}

absl::Status BiasAdd(const Exec& e, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "bias add", {&y, &bias}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::BiasAdd(e, y, bias, rows, cols);
  }
  cpu::BiasAdd(y.data<float>(), bias.data<float>(), rows, cols);
  return absl::OkStatus();
}

absl::Status BiasBackward(const Exec& e, const Tensor& dy, Tensor& dbias, int64_t rows,
                          int64_t cols) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "bias backward", {&dy, &dbias}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::BiasBackward(e, dy, dbias, rows, cols);
  }
  cpu::BiasBackward(dy.data<float>(), dbias.data<float>(), rows, cols);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Add(const Exec& e, const Tensor& a, const Tensor& b) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "add", {&a, &b}));
  PW_RETURN_IF_ERROR(
      Need(a.numel() == b.numel() && a.dtype() == DType::kF32 && b.dtype() == DType::kF32, "add",
           absl::StrCat(a.ShapeString(), " + ", b.ShapeString())));
  Tensor out = Tensor::Empty(a.shape(), DType::kF32, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::Add(e, a, b, out));
      return out;
    }
  }
  cpu::Add(a.data<float>(), b.data<float>(), out.data<float>(), a.numel());
  return out;
}

absl::Status AddInPlace(const Exec& e, Tensor& y, const Tensor& x) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "add in place", {&y, &x}));
  PW_RETURN_IF_ERROR(
      Need(y.numel() == x.numel() && y.dtype() == DType::kF32 && x.dtype() == DType::kF32,
           "add in place", absl::StrCat(y.ShapeString(), " += ", x.ShapeString())));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::AddInPlace(e, y, x);
  }
  cpu::AddInPlace(y.data<float>(), x.data<float>(), y.numel());
  return absl::OkStatus();
}

absl::Status Scale(const Exec& e, Tensor& x, float s) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "scale", {&x}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::Scale(e, x, s);
  }
  cpu::Scale(x.data<float>(), x.numel(), s);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> GeluForward(const Exec& e, const Tensor& x) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "gelu", {&x}));
  Tensor y = Tensor::Empty(x.shape(), DType::kF32, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::GeluForward(e, x, y));
      return y;
    }
  }
  cpu::GeluForward(x.data<float>(), y.data<float>(), x.numel());
  return y;
}

absl::StatusOr<Tensor> GeluBackward(const Exec& e, const Tensor& x, const Tensor& dy) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "gelu backward", {&x, &dy}));
  Tensor dx = Tensor::Empty(dy.shape(), DType::kF32, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::GeluBackward(e, x, dy, dx));
      return dx;
    }
  }
  cpu::GeluBackward(x.data<float>(), dy.data<float>(), dx.data<float>(), dy.numel());
  return dx;
}

absl::Status LayerNormForward(const Exec& e, const Tensor& x, const Tensor& gamma,
                              const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd,
                              int64_t rows, int64_t cols, float eps) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "layernorm", {&x, &gamma, &beta, &y, &mean, &rstd}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::LayerNormForward(e, x, gamma, beta, y, mean, rstd, rows, cols, eps);
    }
  }
  cpu::LayerNormForward(x.data<float>(), gamma.data<float>(), beta.data<float>(), y.data<float>(),
                        mean.data<float>(), rstd.data<float>(), rows, cols, eps);
  return absl::OkStatus();
}

absl::Status LayerNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& gamma,
                                    const Tensor& mean, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, int64_t rows, int64_t cols) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "layernorm backward", {&x, &gamma, &mean, &rstd, &dy, &dx}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::LayerNormBackwardInput(e, x, gamma, mean, rstd, dy, dx, rows, cols);
    }
  }
  cpu::LayerNormBackwardInput(x.data<float>(), gamma.data<float>(), mean.data<float>(),
                              rstd.data<float>(), dy.data<float>(), dx.data<float>(), rows, cols);
  return absl::OkStatus();
}

absl::Status LayerNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dy, Tensor& dgamma,
                                     Tensor& dbeta, int64_t rows, int64_t cols) {
  PW_RETURN_IF_ERROR(
      CheckDevice(e, "layernorm weight backward", {&x, &mean, &rstd, &dy, &dgamma, &dbeta}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::LayerNormBackwardWeight(e, x, mean, rstd, dy, dgamma, dbeta, rows, cols);
    }
  }
  cpu::LayerNormBackwardWeight(x.data<float>(), mean.data<float>(), rstd.data<float>(),
                               dy.data<float>(), dgamma.data<float>(), dbeta.data<float>(), rows,
                               cols);
  return absl::OkStatus();
}

absl::StatusOr<double> CrossEntropyForward(const Exec& e, const Tensor& logits,
                                           const Tensor& targets, int64_t rows, int64_t vocab,
                                           int64_t* count) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "cross-entropy", {&logits, &targets}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::CrossEntropyForward(e, logits, targets, rows, vocab, count);
    }
  }
  return cpu::SoftmaxCrossEntropyForward(logits.data<float>(), targets.data<int32_t>(), rows, vocab,
                                         count);
}

absl::Status CrossEntropyBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                  int64_t rows, int64_t vocab, float scale, Tensor& dlogits) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "cross-entropy backward", {&logits, &targets, &dlogits}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::CrossEntropyBackward(e, logits, targets, rows, vocab, scale, dlogits);
    }
  }
  cpu::SoftmaxCrossEntropyBackward(logits.data<float>(), targets.data<int32_t>(), rows, vocab,
                                   scale, dlogits.data<float>());
  return absl::OkStatus();
}

std::vector<int64_t> AttentionAuxShape(Device d, int64_t B, int64_t T, int64_t H) {
  if (d.is_cuda()) return {B, H, T};
  return {B, H, T, T};
}

absl::Status AttentionForward(const Exec& e, const Tensor& qkv, Tensor& out, Tensor& aux, int64_t B,
                              int64_t T, int64_t C, int64_t H) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "attention", {&qkv, &out, &aux}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::AttentionForward(e, qkv, out, aux, B, T, C, H);
  }
  cpu::AttentionForward(qkv.data<float>(), out.data<float>(), aux.data<float>(), B, T, C, H);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> AttentionBackward(const Exec& e, const Tensor& dout, const Tensor& qkv,
                                         const Tensor& out, const Tensor& aux, int64_t B, int64_t T,
                                         int64_t C, int64_t H) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "attention backward", {&dout, &qkv, &out, &aux}));
  Tensor dqkv = Tensor::Empty(qkv.shape(), DType::kF32, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::AttentionBackward(e, dout, qkv, out, aux, dqkv, B, T, C, H));
      return dqkv;
    }
  }
  Tensor scratch = Tensor::Empty({T, T}, DType::kF32, e.allocator());
  cpu::AttentionBackward(dout.data<float>(), qkv.data<float>(), aux.data<float>(),
                         dqkv.data<float>(), scratch.data<float>(), B, T, C, H);
  return dqkv;
}

absl::Status EmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& wte,
                              const Tensor& wpe, Tensor& out, int64_t B, int64_t T, int64_t C) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "embedding", {&tokens, &wte, &wpe, &out}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::EmbeddingForward(e, tokens, wte, wpe, out, B, T, C);
  }
  cpu::EmbeddingForward(tokens.data<int32_t>(), wte.data<float>(), wpe.data<float>(),
                        out.data<float>(), B, T, C);
  return absl::OkStatus();
}

absl::Status EmbeddingBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                               Tensor& dwte, Tensor& dwpe, int64_t B, int64_t T, int64_t C) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "embedding backward", {&dout, &tokens, &dwte, &dwpe}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::EmbeddingBackward(e, dout, tokens, dwte, dwpe, B, T, C);
    }
  }
  cpu::EmbeddingBackward(dout.data<float>(), tokens.data<int32_t>(), dwte.data<float>(),
                         dwpe.data<float>(), B, T, C);
  return absl::OkStatus();
}

absl::Status AdamW(const Exec& e, const std::vector<AdamWItem>& items, float lr, float beta1,
                   float beta2, float eps, int64_t t) {
  for (const AdamWItem& it : items) {
    PW_RETURN_IF_ERROR(CheckDevice(e, "adamw", {it.param, it.grad, it.m, it.v}));
  }
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::AdamW(e, items, lr, beta1, beta2, eps, t);
  }
  for (const AdamWItem& it : items) {
    cpu::AdamWUpdate(it.param->data<float>(), it.grad->data<float>(), it.m->data<float>(),
                     it.v->data<float>(), it.param->numel(), lr, beta1, beta2, eps, it.weight_decay,
                     t);
  }
  return absl::OkStatus();
}

absl::Status SgdMomentum(const Exec& e, Tensor& param, const Tensor& grad, Tensor& buf, float lr,
                         float momentum, float weight_decay) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "sgd", {&param, &grad, &buf}));
  if (e.device().is_cuda()) {
    return absl::UnimplementedError(
        "sgd: the CUDA backend implements AdamW only (--optimizer adamw)");
  }
  cpu::SgdMomentumUpdate(param.data<float>(), grad.data<float>(), buf.data<float>(), param.numel(),
                         lr, momentum, weight_decay);
  return absl::OkStatus();
}

absl::StatusOr<double> SumSquares(const Exec& e, const std::vector<const Tensor*>& ts) {
  for (const Tensor* t : ts) PW_RETURN_IF_ERROR(CheckDevice(e, "sum of squares", {t}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::SumSquares(e, ts);
  }
  double s = 0;
  for (const Tensor* t : ts) s += cpu::SumSquares(t->data<float>(), t->numel());
  return s;
}

absl::Status Copy(const Exec& e, const Tensor& src, Tensor& dst) {
  PW_RETURN_IF_ERROR(Need(src.numel() == dst.numel() && src.dtype() == dst.dtype(), "copy",
                          absl::StrCat(src.ShapeString(), " into ", dst.ShapeString())));
  return CopyBytesOn(e, dst.raw(), dst.device(), src.raw(), src.device(), src.nbytes());
}

absl::Status CopyRange(const Exec& e, const Tensor& src, int64_t src_offset, Tensor& dst,
                       int64_t dst_offset, int64_t n) {
  PW_RETURN_IF_ERROR(Need(src.dtype() == DType::kF32 && dst.dtype() == DType::kF32 &&
                              src_offset >= 0 && dst_offset >= 0 && n >= 0 &&
                              src_offset + n <= src.numel() && dst_offset + n <= dst.numel(),
                          "copy range", "offsets outside the tensors"));
  return CopyBytesOn(e, dst.data<float>() + dst_offset, dst.device(),
                     src.data<float>() + src_offset, src.device(),
                     static_cast<size_t>(n) * sizeof(float));
}

void ReleaseStream(Stream stream) {
  if constexpr (kWithCuda) {
    if (stream.device.is_cuda()) cuda_impl::ReleaseStream(stream);
  }
}

}  // namespace pipewright::ops
