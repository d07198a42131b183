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

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/parallel.h"
#include "runtime/ops/ops_cuda.h"
#include "runtime/ops/ops_internal.h"

namespace pipewright::ops {
namespace {

std::atomic<bool> allow_tf32{false};

bool IsHalf(DType d) { return d == DType::kBF16 || d == DType::kF16; }

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

absl::StatusOr<Tensor> GemmBias(const Exec& e, bool trans_a, bool trans_b, int64_t m, int64_t n,
                                int64_t k, const Tensor& a, int64_t lda, const Tensor& b,
                                int64_t ldb, const Tensor& bias, Tensor& c, bool gelu,
                                const Tensor* residual) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "gemm bias", {&a, &b, &bias, &c, residual}));
  PW_RETURN_IF_ERROR(Need(bias.dtype() == DType::kF32 && bias.numel() == n &&
                              c.dtype() == DType::kF32 && c.numel() == m * n,
                          "gemm bias", "bias must be f32 [n] and C f32 [m, n]"));
  PW_RETURN_IF_ERROR(Need(residual == nullptr || (!gelu && residual->dtype() == DType::kF32 &&
                                                  residual->numel() == m * n),
                          "gemm bias", "a residual must be f32 [m, n], without gelu"));
  const bool fused = !e.device().is_cuda() && a.dtype() == DType::kF32 &&
                     b.dtype() == DType::kF32 && k > 0 && cpu::OwnF32Gemm();
  if (!fused) {
    PW_RETURN_IF_ERROR(Gemm(e, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, n));
    if (gelu) return BiasGeluForward(e, c, bias, m, n);
    PW_RETURN_IF_ERROR(BiasAdd(e, c, bias, m, n));
    if (residual != nullptr) PW_RETURN_IF_ERROR(AddInPlace(e, c, *residual));
    return c;
  }
  cpu::GemmEpilogue epilogue{bias.data<float>(), nullptr, static_cast<int>(n)};
  if (residual != nullptr) epilogue.residual = residual->data<float>();
  Tensor y = c;
  if (gelu) {
    y = Tensor::Empty(c.shape(), DType::kF32, e.allocator());
    epilogue.act = y.data<float>();
  }
  cpu::GemmFused(trans_a, trans_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                 a.data<float>(), static_cast<int>(lda), b.data<float>(), static_cast<int>(ldb),
                 c.data<float>(), static_cast<int>(n), epilogue);
  return y;
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
  OnThreads(x.numel(), kMinChunk, [&](int64_t i, int64_t n) {
    if (dtype == DType::kBF16) {
      cpu::FloatToBf16(x.data<float>() + i, y.data<uint16_t>() + i, n);
    } else if (dtype == DType::kF16) {
      cpu::FloatToHalf(x.data<float>() + i, y.data<uint16_t>() + i, n);
    } else if (x.dtype() == DType::kBF16) {
      cpu::Bf16ToFloat(x.data<uint16_t>() + i, y.data<float>() + i, n);
    } else {
      cpu::HalfToFloat(x.data<uint16_t>() + i, y.data<float>() + i, n);
    }
  });
  return y;
}

absl::Status BiasAdd(const Exec& e, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "bias add", {&y, &bias}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::BiasAdd(e, y, bias, rows, cols);
  }
  OnThreads(rows, RowGrain(cols), [&](int64_t r, int64_t n) {
    cpu::BiasAdd(y.data<float>() + r * cols, bias.data<float>(), n, cols);
  });
  return absl::OkStatus();
}

absl::Status BiasBackward(const Exec& e, const Tensor& dy, Tensor& dbias, int64_t rows,
                          int64_t cols) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "bias backward", {&dy, &dbias}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::BiasBackward(e, dy, dbias, rows, cols);
  }
  OnThreads(cols, ColumnGrain(rows), [&](int64_t c, int64_t n) {
    cpu::BiasBackward(dy.data<float>() + c, static_cast<int>(cols), dbias.data<float>() + c, rows,
                      n);
  });
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
  OnThreads(a.numel(), kMinChunk, [&](int64_t i, int64_t n) {
    cpu::Add(a.data<float>() + i, b.data<float>() + i, out.data<float>() + i, n);
  });
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
  OnThreads(y.numel(), kMinChunk, [&](int64_t i, int64_t n) {
    cpu::AddInPlace(y.data<float>() + i, x.data<float>() + i, n);
  });
  return absl::OkStatus();
}

absl::Status Scale(const Exec& e, Tensor& x, float s) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "scale", {&x}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::Scale(e, x, s);
  }
  OnThreads(x.numel(), kMinChunk,
            [&](int64_t i, int64_t n) { cpu::Scale(x.data<float>() + i, n, s); });
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
  OnThreads(x.numel(), kMinChunk, [&](int64_t i, int64_t n) {
    cpu::GeluForward(x.data<float>() + i, y.data<float>() + i, n);
  });
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
  OnThreads(dy.numel(), kMinChunk, [&](int64_t i, int64_t n) {
    cpu::GeluBackward(x.data<float>() + i, dy.data<float>() + i, dx.data<float>() + i, n);
  });
  return dx;
}

absl::StatusOr<Tensor> BiasGeluForward(const Exec& e, Tensor& x, const Tensor& bias, int64_t rows,
                                       int64_t cols) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "bias gelu", {&x, &bias}));
  Tensor y = Tensor::Empty(x.shape(), DType::kF32, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::BiasGeluForward(e, x, bias, y, rows, cols));
      return y;
    }
  }
  OnThreads(rows, RowGrain(cols), [&](int64_t r, int64_t n) {
    cpu::BiasGeluForward(x.data<float>() + r * cols, bias.data<float>(), x.data<float>() + r * cols,
                         y.data<float>() + r * cols, n, cols);
  });
  return y;
}

absl::StatusOr<Tensor> BiasGeluBackward(const Exec& e, const Tensor& pre, const Tensor& dy,
                                        Tensor& dbias, int64_t rows, int64_t cols) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "bias gelu backward", {&pre, &dy, &dbias}));
  Tensor dpre = Tensor::Empty(dy.shape(), DType::kF32, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::GeluBackward(e, pre, dy, dpre));
      PW_RETURN_IF_ERROR(cuda_impl::BiasBackward(e, dpre, dbias, rows, cols));
      return dpre;
    }
  }
  // Column ranges on the threads, each a fused pass over its columns of every row.
  OnThreads(cols, ColumnGrain(rows), [&](int64_t c, int64_t n) {
    cpu::BiasGeluBackward(pre.data<float>() + c, dy.data<float>() + c, dpre.data<float>() + c,
                          dbias.data<float>() + c, rows, n, static_cast<int>(cols));
  });
  return dpre;
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
  OnThreads(rows, RowGrain(cols), [&](int64_t r, int64_t n) {
    cpu::LayerNormForward(x.data<float>() + r * cols, gamma.data<float>(), beta.data<float>(),
                          y.data<float>() + r * cols, mean.data<float>() + r,
                          rstd.data<float>() + r, n, cols, eps);
  });
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
  OnThreads(rows, RowGrain(cols), [&](int64_t r, int64_t n) {
    cpu::LayerNormBackwardInput(x.data<float>() + r * cols, gamma.data<float>(),
                                mean.data<float>() + r, rstd.data<float>() + r,
                                dy.data<float>() + r * cols, dx.data<float>() + r * cols, n, cols);
  });
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
  OnThreads(cols, ColumnGrain(rows), [&](int64_t c, int64_t n) {
    cpu::LayerNormBackwardWeight(x.data<float>() + c, mean.data<float>(), rstd.data<float>(),
                                 dy.data<float>() + c, static_cast<int>(cols),
                                 dgamma.data<float>() + c, dbeta.data<float>() + c, rows, n);
  });
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
  const float* lg = logits.data<float>();
  const int32_t* tg = targets.data<int32_t>();
  if (cpu::ParallelParts(rows * vocab, kMinChunk, cpu::CurrentThreads()) <= 1) {
    return cpu::SoftmaxCrossEntropyForward(lg, tg, rows, vocab, count);
  }
  // Each row's loss on the threads, then their sum in row order: the kernel's total, to the bit
  // (a one-row call returns 0.0 + that row's loss).
  std::vector<double> loss(rows);
  std::vector<int64_t> counted(rows);
  OnThreads(rows, RowGrain(vocab), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      loss[r] = cpu::SoftmaxCrossEntropyForward(lg + r * vocab, tg + r, 1, vocab, &counted[r]);
    }
  });
  double total = 0.0;
  int64_t rows_counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (counted[r] == 0) continue;
    total += loss[r];
    ++rows_counted;
  }
  if (count != nullptr) *count = rows_counted;
  return total;
}

absl::Status CrossEntropyBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                  int64_t rows, int64_t vocab, float scale, Tensor& dlogits) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "cross-entropy backward", {&logits, &targets, &dlogits}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::CrossEntropyBackward(e, logits, targets, rows, vocab, scale, dlogits);
    }
  }
  OnThreads(rows, RowGrain(vocab), [&](int64_t r, int64_t n) {
    cpu::SoftmaxCrossEntropyBackward(logits.data<float>() + r * vocab, targets.data<int32_t>() + r,
                                     n, vocab, scale, dlogits.data<float>() + r * vocab);
  });
  return absl::OkStatus();
}

std::vector<int64_t> AttentionLseShape(int64_t B, int64_t T, int64_t H) { return {B, H, T}; }

absl::Status AttentionForward(const Exec& e, const Tensor& qkv, Tensor& out, Tensor& lse, int64_t B,
                              int64_t T, int64_t C, int64_t H) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "attention", {&qkv, &out, &lse}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::AttentionForward(e, qkv, out, lse, B, T, C, H);
  }
  // (batch, head) pairs on the threads, each part with its own scratch.
  const int64_t per = static_cast<int64_t>(cpu::AttentionForwardScratchFloats(T, C, H));
  const int parts = std::max(1, cpu::ParallelParts(B * H, 1, cpu::CurrentThreads()));
  Tensor scratch = Tensor::Empty({parts * per}, DType::kF32, e.allocator());
  cpu::ParallelForParts(B * H, 1, [&](int part, int64_t begin, int64_t end) {
    cpu::AttentionForward(qkv.data<float>(), out.data<float>(), lse.data<float>(), T, C, H, begin,
                          end, scratch.data<float>() + part * per);
  });
  return absl::OkStatus();
}

absl::StatusOr<Tensor> AttentionBackward(const Exec& e, const Tensor& dout, const Tensor& qkv,
                                         const Tensor& out, const Tensor& lse, int64_t B, int64_t T,
                                         int64_t C, int64_t H) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "attention backward", {&dout, &qkv, &out, &lse}));
  Tensor dqkv = Tensor::Empty(qkv.shape(), DType::kF32, e.allocator());
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      PW_RETURN_IF_ERROR(cuda_impl::AttentionBackward(e, dout, qkv, out, lse, dqkv, B, T, C, H));
      return dqkv;
    }
  }
  const int64_t per = static_cast<int64_t>(cpu::AttentionBackwardScratchFloats(T, C, H));
  const int parts = std::max(1, cpu::ParallelParts(B * H, 1, cpu::CurrentThreads()));
  Tensor scratch = Tensor::Empty({parts * per}, DType::kF32, e.allocator());
  cpu::ParallelForParts(B * H, 1, [&](int part, int64_t begin, int64_t end) {
    cpu::AttentionBackward(dout.data<float>(), qkv.data<float>(), out.data<float>(),
                           lse.data<float>(), dqkv.data<float>(), T, C, H, begin, end,
                           scratch.data<float>() + part * per);
  });
  return dqkv;
}

absl::Status AttentionDecode(const Exec& e, const Tensor& qkv, const Tensor& kv, Tensor& out,
                             int64_t start, int64_t n, int64_t C, int64_t H) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "attention decode", {&qkv, &kv, &out}));
  const bool f32 =
      qkv.dtype() == DType::kF32 && kv.dtype() == DType::kF32 && out.dtype() == DType::kF32;
  PW_RETURN_IF_ERROR(
      Need(f32 && start >= 0 && n >= 1 && H >= 1 && C % H == 0 && qkv.numel() >= n * 3 * C &&
               kv.numel() >= (start + n) * 2 * C && out.numel() >= n * C,
           "attention decode",
           absl::StrCat("qkv ", qkv.ShapeString(), ", kv ", kv.ShapeString(), ", out ",
                        out.ShapeString(), " do not hold ", n, " rows at position ", start,
                        " of width ", C, " (", H, " heads) in f32")));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::AttentionDecode(e, qkv, kv, out, start, n, C, H);
  }
  // Heads on the threads, each part with its own scratch.
  const int64_t per = static_cast<int64_t>(cpu::AttentionDecodeScratchFloats(
      static_cast<int>(start + n), static_cast<int>(C), static_cast<int>(H)));
  const int parts = std::max(1, cpu::ParallelParts(H, 1, cpu::CurrentThreads()));
  Tensor scratch = Tensor::Empty({parts * per}, DType::kF32, e.allocator());
  cpu::ParallelForParts(H, 1, [&](int part, int64_t begin, int64_t end) {
    cpu::AttentionDecode(qkv.data<float>(), static_cast<int>(3 * C), kv.data<float>(),
                         static_cast<int>(2 * C), out.data<float>(), static_cast<int>(C),
                         static_cast<int>(start), static_cast<int>(n), static_cast<int>(C),
                         static_cast<int>(H), static_cast<int>(begin), static_cast<int>(end),
                         scratch.data<float>() + part * per);
  });
  return absl::OkStatus();
}

absl::Status EmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& wte,
                              const Tensor& wpe, Tensor& out, int64_t B, int64_t T, int64_t C) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "embedding", {&tokens, &wte, &wpe, &out}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::EmbeddingForward(e, tokens, wte, wpe, out, B, T, C);
  }
  OnThreads(B, RowGrain(T * C), [&](int64_t b, int64_t n) {
    cpu::EmbeddingForward(tokens.data<int32_t>() + b * T, wte.data<float>(), wpe.data<float>(),
                          out.data<float>() + b * T * C, n, T, C);
  });
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

absl::Status EmbeddingPartForward(const Exec& e, const Tensor& tokens, const Tensor& wte_part,
                                  int64_t begin, const Tensor& wpe, Tensor& out, int64_t B,
                                  int64_t T, int64_t C) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "embedding part", {&tokens, &wte_part, &wpe, &out}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::EmbeddingPartForward(e, tokens, wte_part, begin, wpe, out, B, T, C);
    }
  }
  const int64_t part = wte_part.dim(0);
  const int32_t* tok = tokens.data<int32_t>();
  const float* wte = wte_part.data<float>();
  const float* pos = wpe.defined() ? wpe.data<float>() : nullptr;
  float* o = out.data<float>();
  OnThreads(B * T, RowGrain(C), [&](int64_t first, int64_t n) {
    for (int64_t bt = first; bt < first + n; ++bt) {
      const int64_t v = tok[bt] - begin;
      const float* w = v >= 0 && v < part ? wte + v * C : nullptr;
      const float* p = pos != nullptr ? pos + (bt % T) * C : nullptr;
      float* row = o + bt * C;
      for (int64_t c = 0; c < C; ++c) {
        row[c] = w != nullptr ? (p != nullptr ? w[c] + p[c] : w[c]) : (p != nullptr ? p[c] : 0.0f);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status EmbeddingPartBackward(const Exec& e, const Tensor& dout, const Tensor& tokens,
                                   int64_t begin, Tensor& dwte_part, Tensor& dwpe, int64_t B,
                                   int64_t T, int64_t C) {
  PW_RETURN_IF_ERROR(
      CheckDevice(e, "embedding part backward", {&dout, &tokens, &dwte_part, &dwpe}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::EmbeddingPartBackward(e, dout, tokens, begin, dwte_part, dwpe, B, T, C);
    }
  }
  const int64_t part = dwte_part.dim(0);
  const int32_t* tok = tokens.data<int32_t>();
  const float* d = dout.data<float>();
  float* dwte = dwte_part.data<float>();
  float* dpos = dwpe.defined() ? dwpe.data<float>() : nullptr;
  for (int64_t bt = 0; bt < B * T; ++bt) {  // one thread: rows may share a token
    const int64_t v = tok[bt] - begin;
    const float* g = d + bt * C;
    if (v >= 0 && v < part) {
      float* w = dwte + v * C;
      for (int64_t c = 0; c < C; ++c) w[c] += g[c];
    }
    if (dpos == nullptr) continue;
    float* p = dpos + (bt % T) * C;
    for (int64_t c = 0; c < C; ++c) p[c] += g[c];
  }
  return absl::OkStatus();
}

absl::Status RowMax(const Exec& e, const Tensor& logits, int64_t rows, int64_t cols, Tensor& max) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "row max", {&logits, &max}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::RowMax(e, logits, rows, cols, max);
  }
  const float* l = logits.data<float>();
  float* m = max.data<float>();
  OnThreads(rows, RowGrain(cols), [&](int64_t first, int64_t n) {
    for (int64_t r = first; r < first + n; ++r) {
      float v = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < cols; ++j) v = std::max(v, l[r * cols + j]);
      m[r] = v;
    }
  });
  return absl::OkStatus();
}

absl::Status CrossEntropyPartStats(const Exec& e, const Tensor& logits, const Tensor& targets,
                                   int64_t begin, const Tensor& maxima, int64_t ranks, int64_t rows,
                                   int64_t cols, Tensor& stats) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "cross-entropy part", {&logits, &targets, &maxima, &stats}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::CrossEntropyPartStats(e, logits, targets, begin, maxima, ranks, rows, cols,
                                              stats);
    }
  }
  const float* l = logits.data<float>();
  const int32_t* t = targets.data<int32_t>();
  const float* all = maxima.data<float>();
  double* st = stats.data<double>();
  OnThreads(rows, RowGrain(cols), [&](int64_t first, int64_t n) {
    for (int64_t i = first; i < first + n; ++i) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t r = 0; r < ranks; ++r) m = std::max(m, all[r * rows + i]);
      st[2 * rows + i] = m;
      st[i] = 0;
      st[rows + i] = 0;
      if (t[i] < 0) continue;  // an ignored row
      double s = 0;
      for (int64_t j = 0; j < cols; ++j) s += std::exp(static_cast<double>(l[i * cols + j]) - m);
      st[i] = s;
      const int64_t v = t[i] - begin;
      if (v >= 0 && v < cols) st[rows + i] = l[i * cols + v];
    }
  });
  return absl::OkStatus();
}

absl::Status CrossEntropyPartBackward(const Exec& e, const Tensor& logits, const Tensor& targets,
                                      int64_t begin, const Tensor& stats, int64_t rows,
                                      int64_t cols, float scale, Tensor& dlogits) {
  PW_RETURN_IF_ERROR(
      CheckDevice(e, "cross-entropy part backward", {&logits, &targets, &stats, &dlogits}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      return cuda_impl::CrossEntropyPartBackward(e, logits, targets, begin, stats, rows, cols,
                                                 scale, dlogits);
    }
  }
  const float* l = logits.data<float>();
  const int32_t* t = targets.data<int32_t>();
  const double* st = stats.data<double>();
  float* d = dlogits.data<float>();
  OnThreads(rows, RowGrain(cols), [&](int64_t first, int64_t n) {
    for (int64_t i = first; i < first + n; ++i) {
      float* row = d + i * cols;
      if (t[i] < 0) {
        for (int64_t j = 0; j < cols; ++j) row[j] = 0.0f;
        continue;
      }
      const double m = st[2 * rows + i], inv = 1.0 / st[i];
      for (int64_t j = 0; j < cols; ++j) {
        const double p = std::exp(static_cast<double>(l[i * cols + j]) - m) * inv;
        row[j] = static_cast<float>(scale * (p - (begin + j == t[i] ? 1.0 : 0.0)));
      }
    }
  });
  return absl::OkStatus();
}

absl::Status AdamW(const Exec& e, const std::vector<AdamWItem>& items, float lr, float beta1,
                   float beta2, float eps, int64_t t, float grad_scale) {
  for (const AdamWItem& it : items) {
    PW_RETURN_IF_ERROR(CheckDevice(e, "adamw", {it.param, it.grad, it.m, it.v}));
  }
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) {
      if (grad_scale != 1.0f) {  // the CUDA kernel takes no scale: a pass of its own
        for (const AdamWItem& it : items) {
          PW_RETURN_IF_ERROR(cuda_impl::Scale(e, const_cast<Tensor&>(*it.grad), grad_scale));
        }
      }
      return cuda_impl::AdamW(e, items, lr, beta1, beta2, eps, t);
    }
  }
  for (const AdamWItem& it : items) {
    OnThreads(it.param->numel(), kMinChunk, [&](int64_t i, int64_t n) {
      cpu::AdamWUpdate(it.param->data<float>() + i, it.grad->data<float>() + i,
                       it.m->data<float>() + i, it.v->data<float>() + i, n, lr, beta1, beta2, eps,
                       it.weight_decay, t, grad_scale);
    });
  }
  return absl::OkStatus();
}

absl::Status SgdMomentum(const Exec& e, Tensor& param, const Tensor& grad, Tensor& buf, float lr,
                         float momentum, float weight_decay) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "sgd", {&param, &grad, &buf}));
  if (e.device().is_cuda()) {
    return absl::UnimplementedError(
        "sgd: the CUDA backend implements AdamW only (OptimizerConfig.kind = adamw)");
  }
  OnThreads(param.numel(), kMinChunk, [&](int64_t i, int64_t n) {
    cpu::SgdMomentumUpdate(param.data<float>() + i, grad.data<float>() + i, buf.data<float>() + i,
                           n, lr, momentum, weight_decay);
  });
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

absl::Status SquareSumsByChunk(const Exec& e, const Tensor& t, int64_t chunk,
                               std::vector<double>* out) {
  PW_RETURN_IF_ERROR(CheckDevice(e, "sums of squares by chunk", {&t}));
  PW_RETURN_IF_ERROR(Need(t.dtype() == DType::kF32 && chunk > 0, "sums of squares by chunk",
                          absl::StrCat(t.ShapeString(), " in chunks of ", chunk)));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::SquareSumsByChunk(e, t, chunk, out);
  }
  const float* x = t.data<float>();
  for (int64_t i = 0; i < t.numel(); i += chunk) {
    out->push_back(cpu::SumSquares(x + i, static_cast<size_t>(std::min(chunk, t.numel() - i))));
  }
  return absl::OkStatus();
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
