// Linear, GELU, LayerNorm, Embedding, LM head, cross-entropy loss and the synthetic Delay, and
// the helpers of pipewright/init.h that they and custom layers share.
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "pipewright/init.h"
#include "pipewright/ops.h"
#include "pipewright/tensor_parallel.h"
#include "runtime/layers/layers_internal.h"
#include "runtime/random.h"

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

std::vector<std::vector<Parameter*>> Layer::ParameterGroups() {
  std::vector<Parameter*> p = Parameters();
  if (p.empty()) return {};
  return {std::move(p)};
}

absl::StatusOr<Tensor> HalfWeightCache::GetOrMake(
    const Tensor& master, DType dtype, absl::FunctionRef<absl::StatusOr<Tensor>()> make) {
  absl::MutexLock lock(&mu_);
  const Key key{master.raw(), master.numel(), dtype};
  if (auto it = copies_.find(key); it != copies_.end()) return it->second;
  PW_ASSIGN_OR_RETURN(Tensor copy, make());
  copies_.emplace(key, copy);
  return copy;
}

void HalfWeightCache::Clear() {
  absl::MutexLock lock(&mu_);
  copies_.clear();
}

int64_t HalfWeightCache::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(copies_.size());
}

absl::Status ReportGradients(const LayerContext& ctx, Layer& child) {
  if (ctx.gradients == nullptr) return absl::OkStatus();
  const std::vector<Parameter*> p = child.Parameters();
  if (p.empty()) return absl::OkStatus();
  return ctx.gradients->GradientsDone(p);
}

// ---- pipewright/init.h ----
namespace {

// Every random initialiser of `p` draws from this key: the seed and the parameter's global name
// only (its owner's for a tied copy), so the value is independent of which stage creates it and
// of creation order.
uint64_t InitKey(const Parameter& p, const InitContext& init) {
  uint64_t key = HashCombine(init.seed, 0x5057ull);
  for (char c : StoredName(p)) key = HashCombine(key, static_cast<uint8_t>(c));
  return key;
}

float* HostValues(Parameter& p) {
  PW_CHECK(p.value.defined() && p.value.dtype() == DType::kF32 && p.value.device().is_cpu());
  return p.value.data<float>();
}

}  // namespace

InitContext ChildInit(const InitContext& init, absl::string_view local) {
  InitContext c = init;
  c.name = init.name.empty() ? std::string(local) : absl::StrCat(init.name, ".", local);
  return c;
}

Parameter MakeParameter(const InitContext& init, const std::string& local,
                        std::vector<int64_t> shape, bool weight_decay) {
  Parameter p;
  p.name = init.name.empty() ? local : absl::StrCat(init.name, ".", local);
  p.value = Tensor::Empty(shape, DType::kF32, init.allocator);
  p.grad = Tensor::Zeros(shape, DType::kF32, init.allocator);
  p.weight_decay = weight_decay;
  return p;
}

// A part of a tensor-parallel parameter draws the whole tensor's elements (Note
// [Tensor-parallel shards] in pipewright/tensor_parallel.h).
void InitNormal(Parameter& p, const InitContext& init, float std) {
  const uint64_t key = InitKey(p, init);
  float* v = HostValues(p);
  const std::vector<int64_t>& shape = p.value.shape();
  for (int64_t i = 0; i < p.value.numel(); ++i) {
    v[i] = std * NormalAt(key, p.shard.sharded() ? WholeIndex(p.shard, shape, i) : i);
  }
}

void InitUniform(Parameter& p, const InitContext& init, float low, float high) {
  const uint64_t key = InitKey(p, init);
  float* v = HostValues(p);
  const std::vector<int64_t>& shape = p.value.shape();
  for (int64_t i = 0; i < p.value.numel(); ++i) {
    const int64_t at = p.shard.sharded() ? WholeIndex(p.shard, shape, i) : i;
    v[i] = static_cast<float>(low + (static_cast<double>(high) - low) * UniformAt(key, at));
  }
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

namespace internal {

std::vector<int64_t> WithLastDim(const std::vector<int64_t>& shape, int64_t last) {
  std::vector<int64_t> s = shape;
  s.back() = last;
  return s;
}

// ---------------------------------------------------------------------------------------------
absl::Status LinearLayer::CheckSplit(const InitContext& init, int64_t in, int64_t out,
                                     Parallel parallel, const std::vector<int64_t>& sections,
                                     absl::string_view what) {
  if (parallel == Parallel::kNone || init.tp_size == 1) return absl::OkStatus();
  const bool column = parallel == Parallel::kColumn;
  return ShardOf(init, {out, in}, column ? 0 : 1, column ? sections : std::vector<int64_t>{}, what)
      .status();
}

LinearLayer::LinearLayer(const InitContext& init, int64_t in, int64_t out, bool bias, float std,
                         Activation activation, const std::string& tied_weight, Parallel parallel,
                         const std::vector<int64_t>& sections)
    : in_(in),
      out_(out),
      has_bias_(bias),
      activation_(activation),
      parallel_(init.tp_size > 1 ? parallel : Parallel::kNone),
      tp_rank_(init.tp_rank),
      tp_size_(init.tp_size) {
  TensorShard w_shard, b_shard;
  if (parallel_ != Parallel::kNone) {
    const bool column = parallel_ == Parallel::kColumn;
    absl::StatusOr<TensorShard> s = ShardOf(init, {out, in}, column ? 0 : 1,
                                            column ? sections : std::vector<int64_t>{}, init.name);
    PW_CHECK(s.ok());  // the spec ran CheckSplit
    w_shard = *s;
    if (column) b_shard = w_shard;  // a row-parallel layer's bias is whole
    (column ? out_ : in_) /= init.tp_size;
  }
  weight_ = MakeShardedParameter(init, "weight", {out, in}, true, w_shard);
  weight_.tied_to = tied_weight;
  InitNormal(weight_, init, std);
  if (has_bias_) {
    bias_ = MakeShardedParameter(init, "bias", {out}, false, b_shard);
    InitConstant(bias_, 0.0f);
  }
}

namespace {
bool IsHalf(DType d) { return d == DType::kBF16 || d == DType::kF16; }

// The weight rounded to `cd`: the step's copy where the engine keeps them (Note [16-bit weights
// once a step] in layer.h), else a fresh cast.
absl::StatusOr<Tensor> HalfWeight(const LayerContext& ctx, const Tensor& master, DType cd) {
  auto cast = [&] { return ops::Cast(ops::ExecOf(ctx), master, cd); };
  if (ctx.half_weights == nullptr) return cast();
  return ctx.half_weights->GetOrMake(master, cd, cast);
}
}  // namespace

// fp32: y = x W^T + b with x saved. Mixed precision (ctx.compute_dtype bf16/f16): x, W and dy
// are rounded to 16 bits, the products accumulate in fp32 into fp32 outputs and gradients, and
// the 16-bit x and dy are what is saved (half the bytes of the fp32 ones).
//
// With GELU the fp32 pre-activation x W^T + b is saved too, as the GELU layer saved it; the
// backward turns dy into the pre-activation's gradient g first, and g is what the products use.
// In fp32 the bias gradient of g comes out of the same pass (ops::BiasGeluBackward) into a
// per-call partial sum that BackwardWeight adds, so BackwardInput still touches no gradient; in
// 16 bits it sums the rounded g, as without GELU.
absl::StatusOr<Tensor> LinearLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                            Saved* saved) {
  return ForwardImpl(x, nullptr, ctx, saved);
}

absl::StatusOr<Tensor> LinearLayer::ForwardWithResidual(const Tensor& x, const Tensor& residual,
                                                        const LayerContext& ctx, Saved* saved) {
  return ForwardImpl(x, &residual, ctx, saved);
}

// act(x W^T + b), plus `residual` when not null.
absl::StatusOr<Tensor> LinearLayer::ForwardImpl(const Tensor& x, const Tensor* residual,
                                                const LayerContext& ctx, Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(x, in_, "linear"));
  if (parallel_ == Parallel::kNone) return ForwardPart(x, rows, residual, has_bias_, ctx, saved);
  PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "linear"));
  const bool sp = SequenceParallel(ctx);
  if (parallel_ == Parallel::kColumn) {
    if (!sp) return ForwardPart(x, rows, residual, has_bias_, ctx, saved);
    // Note [Sequence parallelism]: the whole sequences in, this rank's rows kept.
    PW_ASSIGN_OR_RETURN(Tensor whole, SequenceAllGather(ctx, x, "column-parallel linear's input"));
    PW_ASSIGN_OR_RETURN(Tensor y,
                        ForwardPart(whole, whole.numel() / in_, residual, has_bias_, ctx, saved));
    if (IsHalf(ctx.compute_dtype)) {
      PW_ASSIGN_OR_RETURN(saved->tensors[0], ops::Cast(ops::ExecOf(ctx), x, ctx.compute_dtype));
    } else {
      saved->tensors[0] = x;
    }
    return y;
  }
  if (sp) {
    // Each rank's rows of the sum, then the bias and its rows of the residual.
    PW_ASSIGN_OR_RETURN(Tensor partial, ForwardPart(x, rows, nullptr, false, ctx, saved));
    PW_ASSIGN_OR_RETURN(Tensor y,
                        SequenceReduceScatter(ctx, partial, "row-parallel linear's output"));
    const ops::Exec e = ops::ExecOf(ctx);
    if (has_bias_) PW_RETURN_IF_ERROR(ops::BiasAdd(e, y, bias_.value, y.numel() / out_, out_));
    if (residual != nullptr) PW_RETURN_IF_ERROR(ops::AddInPlace(e, y, *residual));
    return y;
  }
  // Row-parallel: the partial products summed over the group, the bias and the residual counted
  // once (rank 0's part carries them).
  const bool first = tp_rank_ == 0;
  PW_ASSIGN_OR_RETURN(
      Tensor y, ForwardPart(x, rows, first ? residual : nullptr, has_bias_ && first, ctx, saved));
  PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, y, "row-parallel linear's output"));
  return y;
}

// act(x W^T (+ b when `bias`)), plus `residual` when not null: this rank's part.
absl::StatusOr<Tensor> LinearLayer::ForwardPart(const Tensor& x, int64_t rows,
                                                const Tensor* residual, bool bias,
                                                const LayerContext& ctx, Saved* saved) {
  const ops::Exec e = ops::ExecOf(ctx);
  Tensor y = Tensor::Empty(WithLastDim(x.shape(), out_), DType::kF32, AllocatorOf(ctx));
  const DType cd = ctx.compute_dtype;
  if (IsHalf(cd)) {
    PW_ASSIGN_OR_RETURN(Tensor xh, ops::Cast(e, x, cd));
    PW_ASSIGN_OR_RETURN(Tensor wh, HalfWeight(ctx, weight_.value, cd));
    PW_RETURN_IF_ERROR(
        ops::Gemm(e, false, true, rows, out_, in_, 1.0f, xh, in_, wh, in_, 0.0f, y, out_));
    saved->tensors = {std::move(xh)};
  } else if (bias) {
    // Product, bias and GELU, or product, bias and residual, in one pass where the CPU's GEMM
    // can (ops::GemmBias).
    const bool gelu = activation_ == Activation::kGelu;
    const Tensor* fused_residual = gelu ? nullptr : residual;
    PW_ASSIGN_OR_RETURN(Tensor out,
                        ops::GemmBias(e, false, true, rows, out_, in_, x, in_, weight_.value, in_,
                                      bias_.value, y, gelu, fused_residual));
    saved->tensors = {x};
    if (gelu) saved->tensors.push_back(y);  // the pre-activation
    if (residual != nullptr && fused_residual == nullptr) {
      PW_RETURN_IF_ERROR(ops::AddInPlace(e, out, *residual));
    }
    return out;
  } else {
    PW_RETURN_IF_ERROR(ops::Gemm(e, false, true, rows, out_, in_, 1.0f, x, in_, weight_.value, in_,
                                 0.0f, y, out_));
    saved->tensors = {x};
  }
  Tensor out = y;
  if (activation_ == Activation::kGelu) {
    saved->tensors.push_back(y);  // the pre-activation, completed in place by BiasGeluForward
    PW_ASSIGN_OR_RETURN(
        out, bias ? ops::BiasGeluForward(e, y, bias_.value, rows, out_) : ops::GeluForward(e, y));
  } else if (bias) {
    PW_RETURN_IF_ERROR(ops::BiasAdd(e, y, bias_.value, rows, out_));
  }
  if (residual != nullptr) PW_RETURN_IF_ERROR(ops::AddInPlace(e, out, *residual));
  return out;
}

absl::StatusOr<Tensor> LinearLayer::BackwardInput(const Tensor& dy_out, const LayerContext& ctx,
                                                  Saved* saved) {
  return BackwardImpl(dy_out, ctx, saved, /*weights=*/false);
}

absl::StatusOr<Tensor> LinearLayer::Backward(const Tensor& dy_out, const LayerContext& ctx,
                                             Saved* saved) {
  return BackwardImpl(dy_out, ctx, saved, /*weights=*/true);
}

absl::StatusOr<Tensor> LinearLayer::BackwardImpl(const Tensor& dy_given, const LayerContext& ctx,
                                                 Saved* saved, bool weights) {
  const bool sp = parallel_ != Parallel::kNone && SequenceParallel(ctx);
  // Sequence parallelism: a row-parallel layer's output gradient arrives as this rank's rows.
  Tensor dy_out = dy_given;
  if (sp && parallel_ == Parallel::kRow) {
    PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "linear backward"));
    PW_ASSIGN_OR_RETURN(dy_out,
                        SequenceAllGather(ctx, dy_given, "row-parallel linear's output gradient"));
  }
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(dy_out, out_, "linear backward"));
  const size_t forward_saved = activation_ == Activation::kGelu ? 2 : 1;
  if (saved->tensors.size() != forward_saved) {
    return absl::FailedPreconditionError("linear: no forward saved");
  }
  // A sequence-parallel column-parallel layer kept its input's rows: its output has t times
  // their positions.
  std::vector<int64_t> out_shape = WithLastDim(saved->tensors[0].shape(), out_);
  if (sp && parallel_ == Parallel::kColumn && out_shape.size() >= 2) out_shape[1] *= tp_size_;
  PW_RETURN_IF_ERROR(CheckGradShape(dy_out, out_shape, "linear backward"));
  const ops::Exec e = ops::ExecOf(ctx);
  const DType cd = saved->tensors[0].dtype();  // the precision the forward ran in
  // dy: the gradient at x W^T + b (through the GELU when there is one).
  Tensor dy = dy_out;
  Tensor dbias_partial;
  if (activation_ == Activation::kGelu) {
    const Tensor pre = std::move(saved->tensors[1]);
    saved->tensors.pop_back();
    if (has_bias_ && !IsHalf(cd)) {
      dbias_partial = Tensor::Zeros({out_}, DType::kF32, AllocatorOf(ctx));
      PW_ASSIGN_OR_RETURN(dy, ops::BiasGeluBackward(e, pre, dy_out, dbias_partial, rows, out_));
    } else {
      PW_ASSIGN_OR_RETURN(dy, ops::GeluBackward(e, pre, dy_out));
    }
  }
  // The product's operands: dy and the weight, or their 16-bit copies. BackwardWeight takes
  // {x, dy} or, with GELU, {x, dy, dbias} (dbias defined when the bias gradient is already
  // summed).
  Tensor w = weight_.value;
  if (IsHalf(cd)) {
    PW_ASSIGN_OR_RETURN(dy, ops::Cast(e, dy, cd));
    PW_ASSIGN_OR_RETURN(w, HalfWeight(ctx, weight_.value, cd));
  }
  saved->tensors.push_back(dy);
  if (activation_ == Activation::kGelu) saved->tensors.push_back(std::move(dbias_partial));
  if (weights) PW_RETURN_IF_ERROR(BackwardWeight(ctx, saved));
  Tensor dx = Tensor::Empty(WithLastDim(dy.shape(), in_), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(
      ops::Gemm(e, false, false, rows, in_, out_, 1.0f, dy, out_, w, in_, 0.0f, dx, in_));
  if (parallel_ == Parallel::kColumn) {
    // Each rank's outputs contributed their share of dx: the whole gradient is the sum (under
    // sequence parallelism, each rank keeps the sum's rows of its positions).
    PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "linear backward"));
    if (sp) return SequenceReduceScatter(ctx, dx, "column-parallel linear's input gradient");
    PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, dx, "column-parallel linear's input gradient"));
  }
  return dx;
}

absl::Status LinearLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  // {x, dy}, or with GELU {x, dy, dbias} (dbias undefined unless BackwardInput summed it).
  if (saved->tensors.size() != (activation_ == Activation::kGelu ? 3u : 2u)) {
    return absl::FailedPreconditionError("linear: BackwardWeight before BackwardInput");
  }
  const ops::Exec e = ops::ExecOf(ctx);
  Tensor x = saved->tensors[0];
  if (parallel_ == Parallel::kColumn && SequenceParallel(ctx)) {  // the kept rows, whole again
    PW_ASSIGN_OR_RETURN(x, SequenceAllGather(ctx, x, "column-parallel linear's saved input"));
  }
  const Tensor& dy = saved->tensors[1];
  int64_t rows = x.numel() / in_;
  PW_RETURN_IF_ERROR(
      ops::Gemm(e, true, false, out_, in_, rows, 1.0f, dy, out_, x, in_, 1.0f, weight_.grad, in_));
  if (saved->tensors.size() == 3 && saved->tensors[2].defined()) {
    PW_RETURN_IF_ERROR(ops::AddInPlace(e, bias_.grad, saved->tensors[2]));
  } else if (has_bias_) {
    if (IsHalf(dy.dtype())) {
      // The bias gradient sums the same 16-bit dy the weight gradient used, in fp32.
      PW_ASSIGN_OR_RETURN(Tensor dy32, ops::Cast(e, dy, DType::kF32));
      PW_RETURN_IF_ERROR(ops::BiasBackward(e, dy32, bias_.grad, rows, out_));
    } else {
      PW_RETURN_IF_ERROR(ops::BiasBackward(e, dy, bias_.grad, rows, out_));
    }
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
  PW_ASSIGN_OR_RETURN(Tensor y, ops::GeluForward(ops::ExecOf(ctx), x));
  saved->tensors = {x};
  return y;
}

absl::StatusOr<Tensor> GeluLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                Saved* saved) {
  if (saved->tensors.size() != 1 || saved->tensors[0].numel() != dy.numel()) {
    return absl::FailedPreconditionError("gelu: backward without a matching forward");
  }
  PW_ASSIGN_OR_RETURN(Tensor dx, ops::GeluBackward(ops::ExecOf(ctx), saved->tensors[0], dy));
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
  Tensor y = Tensor::Empty(x.shape(), DType::kF32, AllocatorOf(ctx));
  Tensor mean = Tensor::Empty({rows}, DType::kF32, AllocatorOf(ctx));
  Tensor rstd = Tensor::Empty({rows}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::LayerNormForward(ops::ExecOf(ctx), x, gamma_.value, beta_.value, y, mean,
                                           rstd, rows, dim_, eps_));
  saved->tensors = {x, mean, rstd};
  return y;
}

absl::StatusOr<Tensor> LayerNormLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                     Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(dy, dim_, "layernorm backward"));
  if (saved->tensors.size() != 3) return absl::FailedPreconditionError("layernorm: no forward");
  PW_RETURN_IF_ERROR(CheckGradShape(dy, saved->tensors[0].shape(), "layernorm backward"));
  Tensor dx = Tensor::Empty(dy.shape(), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::LayerNormBackwardInput(ops::ExecOf(ctx), saved->tensors[0], gamma_.value,
                                                 saved->tensors[1], saved->tensors[2], dy, dx, rows,
                                                 dim_));
  saved->tensors.push_back(dy);
  return dx;
}

absl::Status LayerNormLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 4) {
    return absl::FailedPreconditionError("layernorm: BackwardWeight before BackwardInput");
  }
  const Tensor& x = saved->tensors[0];
  const ops::Exec e = ops::ExecOf(ctx);
  if (SequenceParallel(ctx)) {
    // Note [Sequence parallelism]: this rank saw its positions only; the weights' gradient is
    // the sum over the group (in rank order, so the same on every rank).
    Tensor g = Tensor::Zeros({2, dim_}, DType::kF32, AllocatorOf(ctx));
    PW_ASSIGN_OR_RETURN(Tensor dgamma, g.View(0, {dim_}));
    PW_ASSIGN_OR_RETURN(Tensor dbeta, g.View(dim_, {dim_}));
    PW_RETURN_IF_ERROR(ops::LayerNormBackwardWeight(e, x, saved->tensors[1], saved->tensors[2],
                                                    saved->tensors[3], dgamma, dbeta,
                                                    x.numel() / dim_, dim_));
    PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, g, "layernorm's weight gradient"));
    PW_RETURN_IF_ERROR(ops::AddInPlace(e, gamma_.grad, dgamma));
    PW_RETURN_IF_ERROR(ops::AddInPlace(e, beta_.grad, dbeta));
    saved->Clear();
    return absl::OkStatus();
  }
  PW_RETURN_IF_ERROR(ops::LayerNormBackwardWeight(e, x, saved->tensors[1], saved->tensors[2],
                                                  saved->tensors[3], gamma_.grad, beta_.grad,
                                                  x.numel() / dim_, dim_));
  saved->Clear();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
absl::Status CheckTokens(const Tensor& x, int64_t vocab) {
  if (!x.device().is_cpu()) return absl::OkStatus();  // checked on the host before their copy
  const int32_t* tok = x.data<int32_t>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (tok[i] < 0 || tok[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("embedding: token %d at position %d is outside the vocabulary [0, %d)",
                          tok[i], i, vocab));
    }
  }
  return absl::OkStatus();
}

EmbeddingLayer::EmbeddingLayer(const InitContext& init, int64_t vocab, int64_t max_seq, int64_t dim)
    : vocab_(vocab), max_seq_(max_seq), dim_(dim), tp_rank_(init.tp_rank), tp_size_(init.tp_size) {
  absl::StatusOr<TensorShard> shard = ShardOf(init, {vocab, dim}, 0, 1, init.name);
  PW_CHECK(shard.ok());  // the spec checked that the size divides the vocabulary
  wte_ = MakeShardedParameter(init, "wte.weight", {vocab, dim}, true, *shard);
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
  PW_RETURN_IF_ERROR(CheckTokens(x, vocab_));
  if (tp_size_ > 1) {
    saved->tensors = {x};
    return ForwardParallel(x, ctx);
  }
  Tensor y = Tensor::Empty({B, T, dim_}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(
      ops::EmbeddingForward(ops::ExecOf(ctx), x, wte_.value, wpe_.value, y, B, T, dim_));
  saved->tensors = {x};
  return y;
}

absl::StatusOr<Tensor> EmbeddingLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                     Saved* saved) {
  if (saved->tensors.size() != 1) return absl::FailedPreconditionError("embedding: no forward");
  const Tensor& tokens = saved->tensors[0];
  // Under sequence parallelism the gradient of this rank's positions (Note [Sequence
  // parallelism]).
  const int64_t positions = SequenceParallel(ctx) ? tokens.dim(1) / ctx.tp->size : tokens.dim(1);
  PW_RETURN_IF_ERROR(CheckGradShape(dy, {tokens.dim(0), positions, dim_}, "embedding backward"));
  saved->tensors.push_back(dy);
  return Tensor();  // token inputs have no gradient
}

absl::Status EmbeddingLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 2) {
    return absl::FailedPreconditionError("embedding: BackwardWeight before BackwardInput");
  }
  const Tensor& tok = saved->tensors[0];
  if (tp_size_ > 1) {
    PW_ASSIGN_OR_RETURN(Tensor dy,
                        SequenceAllGather(ctx, saved->tensors[1], "embedding's output gradient"));
    PW_RETURN_IF_ERROR(BackwardWeightParallel(tok, dy, ctx));
    saved->Clear();
    return absl::OkStatus();
  }
  PW_RETURN_IF_ERROR(ops::EmbeddingBackward(ops::ExecOf(ctx), saved->tensors[1], tok, wte_.grad,
                                            wpe_.grad, tok.dim(0), tok.dim(1), dim_));
  saved->Clear();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
absl::Status CheckTargets(const Tensor& targets, int64_t vocab) {
  if (!targets.device().is_cpu()) return absl::OkStatus();  // checked on the host before the copy
  const int32_t* t = targets.data<int32_t>();
  for (int64_t i = 0; i < targets.numel(); ++i) {
    if (t[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "loss: target %d at row %d is outside the vocabulary [0, %d)", t[i], i, vocab));
    }
  }
  return absl::OkStatus();
}

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
  if (tp_size_ > 1) return ForwardParallel(x, targets, ctx, saved);
  int64_t vocab = x.dim(-1), rows = targets.numel();
  PW_RETURN_IF_ERROR(CheckTargets(targets, vocab));
  int64_t count = 0;
  PW_ASSIGN_OR_RETURN(double sum,
                      ops::CrossEntropyForward(ops::ExecOf(ctx), x, targets, rows, vocab, &count));
  // The loss and the row count are host scalars on every device.
  Tensor loss = Tensor::Empty({1}, DType::kF32);
  loss.data<float>()[0] = count > 0 ? static_cast<float>(sum / count) : 0.0f;
  Tensor n = Tensor::Empty({1}, DType::kF64);
  n.data<double>()[0] = static_cast<double>(count);
  saved->tensors = {x, targets, n};
  return loss;
}

absl::StatusOr<Tensor> CrossEntropyLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                        Saved* saved) {
  if (saved->tensors.size() != (tp_size_ > 1 ? 4u : 3u)) {
    return absl::FailedPreconditionError("loss: no forward saved");
  }
  if (dy.defined() && (dy.dtype() != DType::kF32 || dy.numel() != 1 || !dy.device().is_cpu())) {
    return absl::InvalidArgumentError("loss backward: expected a host f32 [1] gradient scale");
  }
  float g = dy.defined() ? dy.data<float>()[0] : 1.0f;
  if (tp_size_ > 1) return BackwardParallel(g, ctx, saved);
  const Tensor& logits = saved->tensors[0];
  const Tensor& targets = saved->tensors[1];
  int64_t vocab = logits.dim(-1), rows = targets.numel();
  const int64_t count = static_cast<int64_t>(saved->tensors[2].data<double>()[0]);
  Tensor dx = Tensor::Empty(logits.shape(), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::CrossEntropyBackward(ops::ExecOf(ctx), logits, targets, rows, vocab,
                                               count > 0 ? g / static_cast<float>(count) : 0.0f,
                                               dx));
  saved->Clear();
  return dx;
}

// ---------------------------------------------------------------------------------------------
namespace {
// Note [Precise delay]. A plain sleep overshoots by the kernel's timer slack (50 us by default)
// plus the wake-up latency: ~136 us per 10 ms sleep was measured here, 1.4% of a Delay layer's
// time, which the overhead benchmark would charge to the engine. So the delay drops the calling
// thread's timer slack to 1 ns, sleeps until kSpin before the deadline, and yields in a loop for
// the rest: at most kSpin of busy waiting per call, so ranks sharing cores barely compete.
constexpr std::chrono::microseconds kSpin{100};

// Waits at least `seconds` (rounded up to whole nanoseconds, so a caller timing the call never
// measures less than configured).
void SleepSeconds(double seconds) {
  if (seconds <= 0) return;
#if defined(__linux__)
  static thread_local bool slack_set = [] { return prctl(PR_SET_TIMERSLACK, 1UL) == 0; }();
  (void)slack_set;
#endif
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + std::chrono::ceil<std::chrono::nanoseconds>(
                                                        std::chrono::duration<double>(seconds));
  const Clock::time_point wake = deadline - kSpin;
  if (Clock::now() < wake) std::this_thread::sleep_until(wake);
  while (Clock::now() < deadline) std::this_thread::yield();
}
}  // namespace

absl::StatusOr<Tensor> DelayLayer::Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) {
  PW_RETURN_IF_ERROR(CheckRows(x, dim_, "delay").status());
  SleepSeconds(forward_s_);
  saved->Clear();
  return x.Clone(AllocatorOf(ctx));  // a fresh output, so memory accounting resembles a real layer
}

absl::StatusOr<Tensor> DelayLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                 Saved* saved) {
  PW_RETURN_IF_ERROR(CheckRows(dy, dim_, "delay backward").status());
  SleepSeconds(backward_input_s_);
  return dy.Clone(AllocatorOf(ctx));
}

absl::Status DelayLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  SleepSeconds(backward_weight_s_);
  saved->Clear();
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace pipewright
