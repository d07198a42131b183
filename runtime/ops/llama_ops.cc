// The Llama family's ops on the CPU (pipewright/ops.h, "The Llama family's pieces").
//
// Note [Llama layers]. Llama-shaped models (Llama 3, Mistral, Qwen, SmolLM) differ from GPT-2 in
// four pieces, each an op here and a layer in runtime/layers/llama.cc: RMSNorm instead of
// LayerNorm (no mean, no bias), rotary position embeddings on the queries and keys instead of
// learned positions, a SwiGLU MLP (silu(x W_gate) * (x W_up), then W_down) instead of GELU, and
// grouped-query attention, where each key/value head serves heads / kv_heads query heads. The
// attention itself is the flash-style kernel of the GPT blocks (ops::AttentionForward and
// Backward, CPU and CUDA): ExpandKv gives it every query head's keys and values, and ReduceKv
// sums their gradients back per kv head. Conventions are transformers' (LlamaRMSNorm,
// rotate_half with inv_freq = theta^(-2i/D) computed in float, repeat_kv), so its
// LlamaForCausalLM computes the same functions. Every op is deterministic: rows (or columns,
// for the weight gradient's sums over rows) are split over the rank's threads, and each value is
// one thread's sum in a fixed order (Note [CPU ops on the rank's threads] in ops.cc). The CUDA
// twins are kernels/cuda/llama.cu (the same order of operations; sums within rounding).
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/ops.h"
#include "runtime/ops/ops_cuda.h"
#include "runtime/ops/ops_internal.h"

namespace pipewright::ops {
namespace {

// The operands on the op's device, f32 (tokens i32).
absl::Status Check(const Exec& e, const char* op, std::initializer_list<const Tensor*> ts) {
  PW_RETURN_IF_ERROR(CheckDevice(e, op, ts));
  for (const Tensor* t : ts) {
    if (t->dtype() != DType::kF32 && t->dtype() != DType::kI32) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": f32 tensors only"));
    }
  }
  return absl::OkStatus();
}

float Silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace

absl::Status RmsNormForward(const Exec& e, const Tensor& x, const Tensor& w, Tensor& y,
                            Tensor& rstd, int64_t rows, int64_t cols, float eps) {
  PW_RETURN_IF_ERROR(Check(e, "rmsnorm", {&x, &w, &y, &rstd}));
  PW_RETURN_IF_ERROR(Need(x.numel() >= rows * cols && y.numel() >= rows * cols &&
                              w.numel() >= cols && rstd.numel() >= rows,
                          "rmsnorm", "tensors smaller than [rows, cols]"));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::RmsNormForward(e, x, w, y, rstd, rows, cols, eps);
  }
  const float* px = x.data<float>();
  const float* pw = w.data<float>();
  float* py = y.data<float>();
  float* pr = rstd.data<float>();
  OnThreads(rows, RowGrain(cols), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* xr = px + r * cols;
      double ss = 0;
      for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(xr[c]) * xr[c];
      const float rs = 1.0f / std::sqrt(static_cast<float>(ss / cols) + eps);
      pr[r] = rs;
      float* yr = py + r * cols;
      for (int64_t c = 0; c < cols; ++c) yr[c] = pw[c] * (xr[c] * rs);
    }
  });
  return absl::OkStatus();
}

absl::Status RmsNormBackwardInput(const Exec& e, const Tensor& x, const Tensor& w,
                                  const Tensor& rstd, const Tensor& dy, Tensor& dx, int64_t rows,
                                  int64_t cols) {
  PW_RETURN_IF_ERROR(Check(e, "rmsnorm backward", {&x, &w, &rstd, &dy, &dx}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda())
      return cuda_impl::RmsNormBackwardInput(e, x, w, rstd, dy, dx, rows, cols);
  }
  const float* px = x.data<float>();
  const float* pw = w.data<float>();
  const float* pr = rstd.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  OnThreads(rows, RowGrain(cols), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* xr = px + r * cols;
      const float* dyr = pdy + r * cols;
      const float rs = pr[r];
      // dx = rstd (g - xhat mean(g xhat)), g = dy w, xhat = x rstd.
      double dot = 0;
      for (int64_t c = 0; c < cols; ++c) {
        dot += static_cast<double>(dyr[c] * pw[c]) * (xr[c] * rs);
      }
      const float m = static_cast<float>(dot / cols);
      float* dxr = pdx + r * cols;
      for (int64_t c = 0; c < cols; ++c) dxr[c] = rs * (dyr[c] * pw[c] - xr[c] * rs * m);
    }
  });
  return absl::OkStatus();
}

absl::Status RmsNormBackwardWeight(const Exec& e, const Tensor& x, const Tensor& rstd,
                                   const Tensor& dy, Tensor& dw, int64_t rows, int64_t cols) {
  PW_RETURN_IF_ERROR(Check(e, "rmsnorm weight backward", {&x, &rstd, &dy, &dw}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda())
      return cuda_impl::RmsNormBackwardWeight(e, x, rstd, dy, dw, rows, cols);
  }
  const float* px = x.data<float>();
  const float* pr = rstd.data<float>();
  const float* pdy = dy.data<float>();
  float* pdw = dw.data<float>();
  OnThreads(cols, ColumnGrain(rows), [&](int64_t c0, int64_t n) {
    for (int64_t c = c0; c < c0 + n; ++c) {
      float acc = 0;
      for (int64_t r = 0; r < rows; ++r) acc += pdy[r * cols + c] * (px[r * cols + c] * pr[r]);
      pdw[c] += acc;
    }
  });
  return absl::OkStatus();
}

absl::Status Rope(const Exec& e, Tensor& x, int64_t rows, int64_t T, int64_t ld, int64_t col,
                  int64_t heads, int64_t D, double theta, bool inverse, int64_t first) {
  PW_RETURN_IF_ERROR(Check(e, "rope", {&x}));
  PW_RETURN_IF_ERROR(Need(D >= 2 && D % 2 == 0 && T >= 1 && theta > 0 && col >= 0 &&
                              col + heads * D <= ld && x.numel() >= rows * ld && first >= 0 &&
                              first <= (int64_t{1} << 24) - T,
                          "rope",
                          "head dim must be even, the heads inside each row and the positions "
                          "below 2^24 (exact in float)"));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda())
      return cuda_impl::Rope(e, x, rows, T, ld, col, heads, D, theta, inverse, first);
  }
  const int64_t half = D / 2;
  // transformers: inv_freq = 1 / theta^(arange(0, D, 2) / D) in float; angle = pos * inv_freq in
  // float; cos and sin of that.
  std::vector<float> cs(static_cast<size_t>(T * half)), sn(cs.size());
  for (int64_t i = 0; i < half; ++i) {
    const float inv = 1.0f / std::pow(static_cast<float>(theta),
                                      static_cast<float>(2 * i) / static_cast<float>(D));
    for (int64_t t = 0; t < T; ++t) {
      const float a = static_cast<float>(first + t) * inv;
      cs[t * half + i] = std::cos(a);
      sn[t * half + i] = inverse ? -std::sin(a) : std::sin(a);
    }
  }
  float* p = x.data<float>();
  OnThreads(rows, RowGrain(heads * D), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      const int64_t t = r % T;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = p + r * ld + col + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half], c = cs[t * half + i], s = sn[t * half + i];
          v[i] = a * c - b * s;
          v[i + half] = b * c + a * s;
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status SwiGluForward(const Exec& e, const Tensor& gu, Tensor& out, int64_t rows, int64_t F) {
  PW_RETURN_IF_ERROR(Check(e, "swiglu", {&gu, &out}));
  PW_RETURN_IF_ERROR(Need(gu.numel() >= rows * 2 * F && out.numel() >= rows * F, "swiglu",
                          "tensors smaller than [rows, 2F] and [rows, F]"));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::SwiGluForward(e, gu, out, rows, F);
  }
  const float* pg = gu.data<float>();
  float* po = out.data<float>();
  OnThreads(rows, RowGrain(F), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* g = pg + r * 2 * F;
      for (int64_t i = 0; i < F; ++i) po[r * F + i] = Silu(g[i]) * g[F + i];
    }
  });
  return absl::OkStatus();
}

absl::Status SwiGluBackward(const Exec& e, const Tensor& gu, const Tensor& dout, Tensor& dgu,
                            int64_t rows, int64_t F) {
  PW_RETURN_IF_ERROR(Check(e, "swiglu backward", {&gu, &dout, &dgu}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::SwiGluBackward(e, gu, dout, dgu, rows, F);
  }
  const float* pg = gu.data<float>();
  const float* pd = dout.data<float>();
  float* px = dgu.data<float>();
  OnThreads(rows, RowGrain(F), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* g = pg + r * 2 * F;
      float* d = px + r * 2 * F;
      for (int64_t i = 0; i < F; ++i) {
        const float s = 1.0f / (1.0f + std::exp(-g[i]));
        const float dy = pd[r * F + i];
        d[F + i] = dy * g[i] * s;                               // d/du
        d[i] = dy * g[F + i] * s * (1.0f + g[i] * (1.0f - s));  // d/dg of g s(g)
      }
    }
  });
  return absl::OkStatus();
}

absl::Status ExpandKv(const Exec& e, const Tensor& x, Tensor& qkv, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D) {
  PW_RETURN_IF_ERROR(Check(e, "expand kv", {&x, &qkv}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::ExpandKv(e, x, qkv, rows, heads, kv_heads, D);
  }
  const int64_t C = heads * D, K = kv_heads * D;
  PW_RETURN_IF_ERROR(Need(kv_heads >= 1 && heads % kv_heads == 0 &&
                              x.numel() >= rows * (C + 2 * K) && qkv.numel() >= rows * 3 * C,
                          "expand kv", "heads must be a multiple of kv heads"));
  const int64_t rep = heads / kv_heads;
  const float* px = x.data<float>();
  float* pq = qkv.data<float>();
  OnThreads(rows, RowGrain(3 * C), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* in = px + r * (C + 2 * K);
      float* out = pq + r * 3 * C;
      std::copy(in, in + C, out);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t g = h / rep;
        std::copy(in + C + g * D, in + C + (g + 1) * D, out + C + h * D);
        std::copy(in + C + K + g * D, in + C + K + (g + 1) * D, out + 2 * C + h * D);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status ReduceKv(const Exec& e, const Tensor& dqkv, Tensor& dx, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t D) {
  PW_RETURN_IF_ERROR(Check(e, "reduce kv", {&dqkv, &dx}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::ReduceKv(e, dqkv, dx, rows, heads, kv_heads, D);
  }
  const int64_t C = heads * D, K = kv_heads * D;
  PW_RETURN_IF_ERROR(Need(kv_heads >= 1 && heads % kv_heads == 0 &&
                              dx.numel() >= rows * (C + 2 * K) && dqkv.numel() >= rows * 3 * C,
                          "reduce kv", "heads must be a multiple of kv heads"));
  const int64_t rep = heads / kv_heads;
  const float* pd = dqkv.data<float>();
  float* px = dx.data<float>();
  OnThreads(rows, RowGrain(3 * C), [&](int64_t r0, int64_t n) {
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float* in = pd + r * 3 * C;
      float* out = px + r * (C + 2 * K);
      std::copy(in, in + C, out);
      for (int64_t part = 0; part < 2; ++part) {  // k, then v
        for (int64_t g = 0; g < kv_heads; ++g) {
          float* o = out + C + part * K + g * D;
          const float* first = in + (1 + part) * C + g * rep * D;
          std::copy(first, first + D, o);
          for (int64_t j = 1; j < rep; ++j) {
            const float* src = first + j * D;
            for (int64_t d = 0; d < D; ++d) o[d] += src[d];
          }
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status TokenEmbeddingForward(const Exec& e, const Tensor& tokens, const Tensor& table,
                                   Tensor& out, int64_t n, int64_t C) {
  PW_RETURN_IF_ERROR(Check(e, "token embedding", {&tokens, &table, &out}));
  PW_RETURN_IF_ERROR(Need(tokens.dtype() == DType::kI32 && tokens.numel() >= n &&
                              out.numel() >= n * C && table.numel() % C == 0,
                          "token embedding", "tokens [n] i32, out [n, C]"));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda()) return cuda_impl::TokenEmbeddingForward(e, tokens, table, out, n, C);
  }
  const int32_t* tok = tokens.data<int32_t>();
  const float* w = table.data<float>();
  float* o = out.data<float>();
  OnThreads(n, RowGrain(C), [&](int64_t i0, int64_t k) {
    for (int64_t i = i0; i < i0 + k; ++i) {
      std::copy(w + static_cast<int64_t>(tok[i]) * C, w + (static_cast<int64_t>(tok[i]) + 1) * C,
                o + i * C);
    }
  });
  return absl::OkStatus();
}

absl::Status TokenEmbeddingBackward(const Exec& e, const Tensor& tokens, const Tensor& dout,
                                    Tensor& dtable, int64_t n, int64_t C) {
  PW_RETURN_IF_ERROR(Check(e, "token embedding backward", {&tokens, &dout, &dtable}));
  if constexpr (kWithCuda) {
    if (e.device().is_cuda())
      return cuda_impl::TokenEmbeddingBackward(e, tokens, dout, dtable, n, C);
  }
  const int32_t* tok = tokens.data<int32_t>();
  const float* d = dout.data<float>();
  float* w = dtable.data<float>();
  for (int64_t i = 0; i < n; ++i) {  // one thread, in order: rows may repeat
    float* row = w + static_cast<int64_t>(tok[i]) * C;
    for (int64_t c = 0; c < C; ++c) row[c] += d[i * C + c];
  }
  return absl::OkStatus();
}

}  // namespace pipewright::ops
