// Linear, GELU, LayerNorm, Embedding, LM head, cross-entropy loss and the synthetic Delay.
#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/cpu_kernels.h"
#include "runtime/layers/layer_util.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright {

int64_t Saved::bytes() const {
  int64_t total = 0;
  for (const Tensor& t : tensors) total += static_cast<int64_t>(t.nbytes());
  for (const Saved& c : children) total += c.bytes();
  return total;
}

absl::StatusOr<Tensor> Layer::Backward(const Tensor& dy, const LayerContext& ctx, Saved* saved) {
  PW_ASSIGN_OR_RETURN(Tensor dx, BackwardInput(dy, ctx, saved));
  PW_RETURN_IF_ERROR(BackwardWeight(ctx, saved));
  return dx;
}

namespace internal {

Parameter MakeParameter(const InitContext& init, const std::string& local,
                        std::vector<int64_t> shape, bool weight_decay) {
  Parameter p;
  p.name = init.name.empty() ? local : absl::StrCat(init.name, ".", local);
  p.value = Tensor::Empty(shape, DType::kF32, init.allocator);
  p.grad = Tensor::Zeros(shape, DType::kF32, init.allocator);
  p.weight_decay = weight_decay;
  return p;
}

void InitNormal(Parameter& p, const InitContext& init, float std) {
  // Keyed by the seed and the parameter's global name, so the value is independent of which
  // stage creates it and of creation order.
  uint64_t key = HashCombine(init.seed, 0x5057ull);
  for (char c : p.name) key = HashCombine(key, static_cast<uint8_t>(c));
  float* v = p.value.data<float>();
  for (int64_t i = 0; i < p.value.numel(); ++i) v[i] = std * NormalAt(key, i);
}

void InitConstant(Parameter& p, float value) { p.value.Fill(value); }

absl::StatusOr<int64_t> CheckRows(const Tensor& x, int64_t cols, absl::string_view what) {
  if (!x.defined() || x.dtype() != DType::kF32 || x.dim(-1) != cols) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: expected an f32 input with last dimension %d, got %s", what, cols,
                        x.defined() ? x.ShapeString() : std::string("no tensor")));
  }
  return x.numel() / cols;
}

absl::Status CheckGradShape(const Tensor& dy, const std::vector<int64_t>& expected,
                            absl::string_view what) {
  // Same element count and last dimension (a reshaped gradient is fine; a smaller one would
  // make the weight-gradient kernels read past its end).
  if (!dy.defined() || dy.dtype() != DType::kF32 || dy.numel() != NumElements(expected) ||
      dy.dim(-1) != expected.back()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: expected an f32 gradient like the output [%s], got %s", what,
        absl::StrJoin(expected, ", "), dy.defined() ? dy.ShapeString() : std::string("no tensor")));
  }
  return absl::OkStatus();
}

std::vector<int64_t> WithLastDim(const std::vector<int64_t>& shape, int64_t last) {
  std::vector<int64_t> s = shape;
  s.back() = last;
  return s;
}

// ---------------------------------------------------------------------------------------------
LinearLayer::LinearLayer(const InitContext& init, int64_t in, int64_t out, bool bias, float std)
    : in_(in), out_(out), has_bias_(bias) {
  weight_ = MakeParameter(init, "weight", {out, in}, true);
  InitNormal(weight_, init, std);
  if (has_bias_) {
    bias_ = MakeParameter(init, "bias", {out}, false);
    InitConstant(bias_, 0.0f);
  }
}

namespace {

bool IsHalf(DType d) { return d == DType::kBF16 || d == DType::kF16; }

// x rounded to the 16-bit dtype `d` (round-to-nearest-even), in a new tensor.
Tensor ToHalf(const Tensor& x, DType d, Allocator* allocator) {
  Tensor h = Tensor::Empty(x.shape(), d, allocator);
  if (d == DType::kBF16) {
    cpu::FloatToBf16(x.data<float>(), h.data<uint16_t>(), x.numel());
  } else {
    cpu::FloatToHalf(x.data<float>(), h.data<uint16_t>(), x.numel());
  }
  return h;
}

}  // namespace

// fp32: y = x W^T + b with x saved. Mixed precision (ctx.compute_dtype bf16/f16): x, W and dy
// are rounded to 16 bits, the products accumulate in fp32 into fp32 outputs and gradients, and
// the 16-bit x and dy are what is saved (half the bytes of the fp32 ones).
absl::StatusOr<Tensor> LinearLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                            Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(x, in_, "linear"));
  Tensor y = Tensor::Empty(WithLastDim(x.shape(), out_), DType::kF32, Alloc(ctx));
  const DType cd = ctx.compute_dtype;
  if (IsHalf(cd)) {
    Tensor xh = ToHalf(x, cd, Alloc(ctx));
    Tensor wh = ToHalf(weight_.value, cd, Alloc(ctx));
    cpu::GemmHalf(cd == DType::kBF16, false, true, rows, out_, in_, 1.0f, xh.data<uint16_t>(), in_,
                  wh.data<uint16_t>(), in_, 0.0f, y.data<float>(), out_);
    saved->tensors = {std::move(xh)};
  } else {
    cpu::Gemm(false, true, rows, out_, in_, 1.0f, x.data<float>(), in_, weight_.value.data<float>(),
              in_, 0.0f, y.data<float>(), out_);
    saved->tensors = {x};
  }
  if (has_bias_) cpu::BiasAdd(y.data<float>(), bias_.value.data<float>(), rows, out_);
  return y;
}

absl::StatusOr<Tensor> LinearLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                  Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(dy, out_, "linear backward"));
  if (saved->tensors.size() != 1) return absl::FailedPreconditionError("linear: no forward saved");
  PW_RETURN_IF_ERROR(
      CheckGradShape(dy, WithLastDim(saved->tensors[0].shape(), out_), "linear backward"));
  const DType cd = saved->tensors[0].dtype();  // the precision the forward ran in
  Tensor dx = Tensor::Empty(WithLastDim(dy.shape(), in_), DType::kF32, Alloc(ctx));
  if (IsHalf(cd)) {
    Tensor dyh = ToHalf(dy, cd, Alloc(ctx));
    Tensor wh = ToHalf(weight_.value, cd, Alloc(ctx));
    cpu::GemmHalf(cd == DType::kBF16, false, false, rows, in_, out_, 1.0f, dyh.data<uint16_t>(),
                  out_, wh.data<uint16_t>(), in_, 0.0f, dx.data<float>(), in_);
    saved->tensors.push_back(std::move(dyh));
  } else {
    cpu::Gemm(false, false, rows, in_, out_, 1.0f, dy.data<float>(), out_,
              weight_.value.data<float>(), in_, 0.0f, dx.data<float>(), in_);
    saved->tensors.push_back(dy);
  }
  return dx;
}

absl::Status LinearLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 2) {
    return absl::FailedPreconditionError("linear: BackwardWeight before BackwardInput");
  }
  const Tensor& x = saved->tensors[0];
  const Tensor& dy = saved->tensors[1];
  int64_t rows = x.numel() / in_;
  if (IsHalf(x.dtype())) {
    const bool bf16 = x.dtype() == DType::kBF16;
    cpu::GemmHalf(bf16, true, false, out_, in_, rows, 1.0f, dy.data<uint16_t>(), out_,
                  x.data<uint16_t>(), in_, 1.0f, weight_.grad.data<float>(), in_);
    if (has_bias_) {
      // The bias gradient sums the same 16-bit dy the weight gradient used, in fp32.
      Tensor dy32 = Tensor::Empty(dy.shape(), DType::kF32, Alloc(ctx));
      if (bf16) {
        cpu::Bf16ToFloat(dy.data<uint16_t>(), dy32.data<float>(), dy.numel());
      } else {
        cpu::HalfToFloat(dy.data<uint16_t>(), dy32.data<float>(), dy.numel());
      }
      cpu::BiasBackward(dy32.data<float>(), bias_.grad.data<float>(), rows, out_);
    }
  } else {
    cpu::Gemm(true, false, out_, in_, rows, 1.0f, dy.data<float>(), out_, x.data<float>(), in_,
              1.0f, weight_.grad.data<float>(), in_);
    if (has_bias_) cpu::BiasBackward(dy.data<float>(), bias_.grad.data<float>(), rows, out_);
  }
  saved->Clear();
  return absl::OkStatus();
}

std::vector<Parameter*> LinearLayer::Parameters() {
  if (has_bias_) return {&weight_, &bias_};
  return {&weight_};
}

// ---------------------------------------------------------------------------------------------
absl::StatusOr<Tensor> GeluLayer::Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) {
  if (!x.defined() || x.dtype() != DType::kF32) {
    return absl::InvalidArgumentError("gelu: expected an f32 input");
  }
  Tensor y = Tensor::Empty(x.shape(), DType::kF32, Alloc(ctx));
  cpu::GeluForward(x.data<float>(), y.data<float>(), x.numel());
  saved->tensors = {x};
  return y;
}

absl::StatusOr<Tensor> GeluLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                Saved* saved) {
  if (saved->tensors.size() != 1 || saved->tensors[0].numel() != dy.numel()) {
    return absl::FailedPreconditionError("gelu: backward without a matching forward");
  }
  Tensor dx = Tensor::Empty(dy.shape(), DType::kF32, Alloc(ctx));
  cpu::GeluBackward(saved->tensors[0].data<float>(), dy.data<float>(), dx.data<float>(),
                    dy.numel());
  saved->Clear();
  return dx;
}

// ---------------------------------------------------------------------------------------------
LayerNormLayer::LayerNormLayer(const InitContext& init, int64_t dim, float eps)
    : dim_(dim), eps_(eps) {
  gamma_ = MakeParameter(init, "weight", {dim}, false);
  beta_ = MakeParameter(init, "bias", {dim}, false);
  InitConstant(gamma_, 1.0f);
  InitConstant(beta_, 0.0f);
}

absl::StatusOr<Tensor> LayerNormLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                               Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(x, dim_, "layernorm"));
  Tensor y = Tensor::Empty(x.shape(), DType::kF32, Alloc(ctx));
  Tensor mean = Tensor::Empty({rows}, DType::kF32, Alloc(ctx));
  Tensor rstd = Tensor::Empty({rows}, DType::kF32, Alloc(ctx));
  cpu::LayerNormForward(x.data<float>(), gamma_.value.data<float>(), beta_.value.data<float>(),
                        y.data<float>(), mean.data<float>(), rstd.data<float>(), rows, dim_, eps_);
  saved->tensors = {x, mean, rstd};
  return y;
}

absl::StatusOr<Tensor> LayerNormLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                     Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(dy, dim_, "layernorm backward"));
  if (saved->tensors.size() != 3) return absl::FailedPreconditionError("layernorm: no forward");
  PW_RETURN_IF_ERROR(CheckGradShape(dy, saved->tensors[0].shape(), "layernorm backward"));
  Tensor dx = Tensor::Empty(dy.shape(), DType::kF32, Alloc(ctx));
  cpu::LayerNormBackwardInput(saved->tensors[0].data<float>(), gamma_.value.data<float>(),
                              saved->tensors[1].data<float>(), saved->tensors[2].data<float>(),
                              dy.data<float>(), dx.data<float>(), rows, dim_);
  saved->tensors.push_back(dy);
  return dx;
}

absl::Status LayerNormLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 4) {
    return absl::FailedPreconditionError("layernorm: BackwardWeight before BackwardInput");
  }
  const Tensor& x = saved->tensors[0];
  cpu::LayerNormBackwardWeight(x.data<float>(), saved->tensors[1].data<float>(),
                               saved->tensors[2].data<float>(), saved->tensors[3].data<float>(),
                               gamma_.grad.data<float>(), beta_.grad.data<float>(),
                               x.numel() / dim_, dim_);
  saved->Clear();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
EmbeddingLayer::EmbeddingLayer(const InitContext& init, int64_t vocab, int64_t max_seq, int64_t dim)
    : vocab_(vocab), max_seq_(max_seq), dim_(dim) {
  wte_ = MakeParameter(init, "wte.weight", {vocab, dim}, true);
  wpe_ = MakeParameter(init, "wpe.weight", {max_seq, dim}, false);
  InitNormal(wte_, init, 0.02f);
  InitNormal(wpe_, init, 0.01f);
}

absl::StatusOr<Tensor> EmbeddingLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                               Saved* saved) {
  if (!x.defined() || x.dtype() != DType::kI32 || x.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding: expected [batch, seq] i32 tokens, got ",
                     x.defined() ? x.ShapeString() : std::string("no tensor")));
  }
  int64_t B = x.dim(0), T = x.dim(1);
  if (T > max_seq_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("embedding: sequence length %d exceeds the maximum %d", T, max_seq_));
  }
  const int32_t* tok = x.data<int32_t>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (tok[i] < 0 || tok[i] >= vocab_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("embedding: token %d at position %d is outside the vocabulary [0, %d)",
                          tok[i], i, vocab_));
    }
  }
  Tensor y = Tensor::Empty({B, T, dim_}, DType::kF32, Alloc(ctx));
  cpu::EmbeddingForward(tok, wte_.value.data<float>(), wpe_.value.data<float>(), y.data<float>(), B,
                        T, dim_);
  saved->tensors = {x};
  return y;
}

absl::StatusOr<Tensor> EmbeddingLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                     Saved* saved) {
  if (saved->tensors.size() != 1) return absl::FailedPreconditionError("embedding: no forward");
  const Tensor& tokens = saved->tensors[0];
  PW_RETURN_IF_ERROR(
      CheckGradShape(dy, {tokens.dim(0), tokens.dim(1), dim_}, "embedding backward"));
  saved->tensors.push_back(dy);
  return Tensor();  // token inputs have no gradient
}

absl::Status EmbeddingLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 2) {
    return absl::FailedPreconditionError("embedding: BackwardWeight before BackwardInput");
  }
  const Tensor& tok = saved->tensors[0];
  cpu::EmbeddingBackward(saved->tensors[1].data<float>(), tok.data<int32_t>(),
                         wte_.grad.data<float>(), wpe_.grad.data<float>(), tok.dim(0), tok.dim(1),
                         dim_);
  saved->Clear();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
absl::StatusOr<Tensor> CrossEntropyLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                                  Saved* saved) {
  if (ctx.targets == nullptr || !ctx.targets->defined()) {
    return absl::InvalidArgumentError("loss: no targets given to the last stage");
  }
  const Tensor& targets = *ctx.targets;
  if (!x.defined() || x.dtype() != DType::kF32 || targets.dtype() != DType::kI32 ||
      x.numel() / std::max<int64_t>(1, x.dim(-1)) != targets.numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss: logits ", x.defined() ? x.ShapeString() : "none",
                     " do not match targets ", targets.ShapeString()));
  }
  int64_t vocab = x.dim(-1), rows = targets.numel();
  const int32_t* t = targets.data<int32_t>();
  for (int64_t i = 0; i < rows; ++i) {
    if (t[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "loss: target %d at row %d is outside the vocabulary [0, %d)", t[i], i, vocab));
    }
  }
  int64_t count = 0;
  double sum = cpu::SoftmaxCrossEntropyForward(x.data<float>(), t, rows, vocab, &count);
  Tensor loss = Tensor::Empty({1}, DType::kF32, Alloc(ctx));
  loss.data<float>()[0] = count > 0 ? static_cast<float>(sum / count) : 0.0f;
  saved->tensors = {x, targets};
  return loss;
}

absl::StatusOr<Tensor> CrossEntropyLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                        Saved* saved) {
  if (saved->tensors.size() != 2) return absl::FailedPreconditionError("loss: no forward saved");
  if (dy.defined() && (dy.dtype() != DType::kF32 || dy.numel() != 1)) {
    return absl::InvalidArgumentError("loss backward: expected an f32 [1] gradient scale");
  }
  const Tensor& logits = saved->tensors[0];
  const Tensor& targets = saved->tensors[1];
  int64_t vocab = logits.dim(-1), rows = targets.numel();
  int64_t count = 0;
  const int32_t* t = targets.data<int32_t>();
  for (int64_t i = 0; i < rows; ++i) count += t[i] >= 0;
  float g = dy.defined() ? dy.data<float>()[0] : 1.0f;
  Tensor dx = Tensor::Empty(logits.shape(), DType::kF32, Alloc(ctx));
  cpu::SoftmaxCrossEntropyBackward(logits.data<float>(), t, rows, vocab,
                                   count > 0 ? g / static_cast<float>(count) : 0.0f,
                                   dx.data<float>());
  saved->Clear();
  return dx;
}

// ---------------------------------------------------------------------------------------------
namespace {
// Sleeps at least `seconds` (rounded up to whole nanoseconds, so a caller timing the call never
// measures less than configured).
void SleepSeconds(double seconds) {
  if (seconds <= 0) return;
  std::this_thread::sleep_for(
      std::chrono::ceil<std::chrono::nanoseconds>(std::chrono::duration<double>(seconds)));
}
}  // namespace

absl::StatusOr<Tensor> DelayLayer::Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) {
  PW_RETURN_IF_ERROR(CheckRows(x, dim_, "delay").status());
  SleepSeconds(forward_s_);
  saved->Clear();
  return x.Clone(Alloc(ctx));  // a fresh output, so memory accounting resembles a real layer
}

absl::StatusOr<Tensor> DelayLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                 Saved* saved) {
  PW_RETURN_IF_ERROR(CheckRows(dy, dim_, "delay backward").status());
  SleepSeconds(backward_input_s_);
  return dy.Clone(Alloc(ctx));
}

absl::Status DelayLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  SleepSeconds(backward_weight_s_);
  saved->Clear();
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace pipewright
