// The Llama family's layers (layers_internal.h; Note [Llama layers] in runtime/ops/llama_ops.cc):
// RMSNorm, the token embedding without positions, the rotary grouped-query attention core, the
// SwiGLU gate and the Llama block that composes them with bias-free Linear layers.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/init.h"
#include "pipewright/ops.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright::internal {

// ---------------------------------------------------------------------------------------------
RmsNormLayer::RmsNormLayer(const InitContext& init, int64_t dim, float eps) : dim_(dim), eps_(eps) {
  weight_ = MakeParameter(init, "weight", {dim}, false);
  InitConstant(weight_, 1.0f);
}

absl::StatusOr<Tensor> RmsNormLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                             Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(x, dim_, "rmsnorm"));
  Tensor y = Tensor::Empty(x.shape(), DType::kF32, AllocatorOf(ctx));
  Tensor rstd = Tensor::Empty({rows}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(
      ops::RmsNormForward(ops::ExecOf(ctx), x, weight_.value, y, rstd, rows, dim_, eps_));
  saved->tensors = {x, rstd};
  return y;
}

absl::StatusOr<Tensor> RmsNormLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                   Saved* saved) {
  PW_ASSIGN_OR_RETURN(int64_t rows, CheckRows(dy, dim_, "rmsnorm backward"));
  if (saved->tensors.size() != 2) return absl::FailedPreconditionError("rmsnorm: no forward");
  PW_RETURN_IF_ERROR(CheckGradShape(dy, saved->tensors[0].shape(), "rmsnorm backward"));
  Tensor dx = Tensor::Empty(dy.shape(), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::RmsNormBackwardInput(ops::ExecOf(ctx), saved->tensors[0], weight_.value,
                                               saved->tensors[1], dy, dx, rows, dim_));
  saved->tensors.push_back(dy);
  return dx;
}

absl::Status RmsNormLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 3) {
    return absl::FailedPreconditionError("rmsnorm: BackwardWeight before BackwardInput");
  }
  const Tensor& x = saved->tensors[0];
  PW_RETURN_IF_ERROR(ops::RmsNormBackwardWeight(ops::ExecOf(ctx), x, saved->tensors[1],
                                                saved->tensors[2], weight_.grad, x.numel() / dim_,
                                                dim_));
  saved->Clear();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
TokenEmbeddingLayer::TokenEmbeddingLayer(const InitContext& init, int64_t vocab, int64_t dim)
    : vocab_(vocab), dim_(dim) {
  wte_ = MakeParameter(init, "wte.weight", {vocab, dim}, true);
  InitNormal(wte_, init, 0.02f);
}

absl::StatusOr<Tensor> TokenEmbeddingLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                                    Saved* saved) {
  if (!x.defined() || x.dtype() != DType::kI32 || x.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("token embedding: expected tokens [B, T] i32, got ",
                     x.defined() ? x.ShapeString() : "no tensor"));
  }
  PW_RETURN_IF_ERROR(CheckTokens(x, vocab_));
  Tensor y = Tensor::Empty({x.dim(0), x.dim(1), dim_}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(
      ops::TokenEmbeddingForward(ops::ExecOf(ctx), x, wte_.value, y, x.numel(), dim_));
  saved->tensors = {x};
  return y;
}

absl::StatusOr<Tensor> TokenEmbeddingLayer::BackwardInput(const Tensor& dy, const LayerContext&,
                                                          Saved* saved) {
  if (saved->tensors.size() != 1) {
    return absl::FailedPreconditionError("token embedding: no forward");
  }
  const Tensor& x = saved->tensors[0];
  PW_RETURN_IF_ERROR(CheckGradShape(dy, {x.dim(0), x.dim(1), dim_}, "token embedding backward"));
  saved->tensors.push_back(dy);
  return Tensor();  // token inputs have no gradient
}

absl::Status TokenEmbeddingLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 2) {
    return absl::FailedPreconditionError("token embedding: BackwardWeight before BackwardInput");
  }
  const Tensor& x = saved->tensors[0];
  PW_RETURN_IF_ERROR(ops::TokenEmbeddingBackward(ops::ExecOf(ctx), x, saved->tensors[1], wte_.grad,
                                                 x.numel(), dim_));
  saved->Clear();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// x [B, T, C + 2K] = (q | k | v): the rotary turn of q and k at their positions, every query
// head's keys and values (ExpandKv), then the flash-style attention of the GPT blocks. Saved: the
// expanded, rotated qkv, the row log-sum-exp and the output, as AttentionCoreLayer saves them.
absl::StatusOr<Tensor> RotaryAttentionLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                                     Saved* saved) {
  const int64_t D = dim_ / heads_, K = kv_heads_ * D;
  PW_ASSIGN_OR_RETURN(const int64_t rows, CheckRows(x, dim_ + 2 * K, "rotary attention"));
  if (x.rank() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("rotary attention: expected [B, T, ",
                                                   dim_ + 2 * K, "], got ", x.ShapeString()));
  }
  const int64_t B = x.dim(0), T = x.dim(1);
  const ops::Exec e = ops::ExecOf(ctx);
  Tensor qkv = Tensor::Empty({B, T, 3 * dim_}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::ExpandKv(e, x, qkv, rows, heads_, kv_heads_, D));
  // q and the (repeated) k turn alike: each copy of a kv head turns as the head would.
  PW_RETURN_IF_ERROR(ops::Rope(e, qkv, rows, T, 3 * dim_, 0, 2 * heads_, D, theta_, false));
  Tensor out = Tensor::Empty({B, T, dim_}, DType::kF32, AllocatorOf(ctx));
  Tensor lse = Tensor::Empty(ops::AttentionLseShape(B, T, heads_), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::AttentionForward(e, qkv, out, lse, B, T, dim_, heads_));
  saved->tensors = {qkv, lse, out};
  return out;
}

absl::StatusOr<Tensor> RotaryAttentionLayer::BackwardInput(const Tensor& dy,
                                                           const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 3) {
    return absl::FailedPreconditionError("rotary attention: no forward");
  }
  const Tensor& qkv = saved->tensors[0];
  const int64_t B = qkv.dim(0), T = qkv.dim(1), D = dim_ / heads_, K = kv_heads_ * D;
  PW_RETURN_IF_ERROR(CheckGradShape(dy, {B, T, dim_}, "rotary attention backward"));
  const ops::Exec e = ops::ExecOf(ctx);
  PW_ASSIGN_OR_RETURN(Tensor dqkv, ops::AttentionBackward(e, dy, qkv, saved->tensors[2],
                                                          saved->tensors[1], B, T, dim_, heads_));
  // The turn's transpose, then each kv head's sum over the query heads that read it.
  PW_RETURN_IF_ERROR(ops::Rope(e, dqkv, B * T, T, 3 * dim_, 0, 2 * heads_, D, theta_, true));
  Tensor dx = Tensor::Empty({B, T, dim_ + 2 * K}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::ReduceKv(e, dqkv, dx, B * T, heads_, kv_heads_, D));
  saved->Clear();
  return dx;
}

// ---------------------------------------------------------------------------------------------
absl::StatusOr<Tensor> SwiGluLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                            Saved* saved) {
  PW_ASSIGN_OR_RETURN(const int64_t rows, CheckRows(x, 2 * ffn_, "swiglu"));
  Tensor y = Tensor::Empty(WithLastDim(x.shape(), ffn_), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::SwiGluForward(ops::ExecOf(ctx), x, y, rows, ffn_));
  saved->tensors = {x};
  return y;
}

absl::StatusOr<Tensor> SwiGluLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                  Saved* saved) {
  if (saved->tensors.size() != 1) return absl::FailedPreconditionError("swiglu: no forward");
  const Tensor& x = saved->tensors[0];
  PW_RETURN_IF_ERROR(CheckGradShape(dy, WithLastDim(x.shape(), ffn_), "swiglu backward"));
  Tensor dx = Tensor::Empty(x.shape(), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(
      ops::SwiGluBackward(ops::ExecOf(ctx), x, dy, dx, x.numel() / (2 * ffn_), ffn_));
  saved->Clear();
  return dx;
}

// ---------------------------------------------------------------------------------------------
namespace {
using Act = LinearLayer::Activation;
}  // namespace

LlamaBlockLayer::LlamaBlockLayer(const InitContext& init, const LlamaBlockShape& s) {
  const int64_t kv = s.kv_heads * (s.dim / s.heads);
  norm_1_ = std::make_unique<RmsNormLayer>(ChildInit(init, "input_layernorm"), s.dim, s.eps);
  std::vector<std::unique_ptr<Layer>> attn;
  attn.push_back(std::make_unique<LinearLayer>(ChildInit(ChildInit(init, "self_attn"), "qkv"),
                                               s.dim, s.dim + 2 * kv, false, 0.02f));
  attn.push_back(std::make_unique<RotaryAttentionLayer>(s.dim, s.heads, s.kv_heads, s.rope_theta));
  attn.push_back(std::make_unique<LinearLayer>(ChildInit(ChildInit(init, "self_attn"), "o_proj"),
                                               s.dim, s.dim, false, 0.02f));
  attn_ = std::make_unique<SequentialLayer>("llama_attention", std::move(attn));
  norm_2_ =
      std::make_unique<RmsNormLayer>(ChildInit(init, "post_attention_layernorm"), s.dim, s.eps);
  std::vector<std::unique_ptr<Layer>> mlp;
  mlp.push_back(std::make_unique<LinearLayer>(ChildInit(ChildInit(init, "mlp"), "gate_up"), s.dim,
                                              2 * s.ffn, false, 0.02f, Act::kNone));
  mlp.push_back(std::make_unique<SwiGluLayer>(s.ffn));
  mlp.push_back(std::make_unique<LinearLayer>(ChildInit(ChildInit(init, "mlp"), "down_proj"), s.ffn,
                                              s.dim, false, 0.02f));
  mlp_ = std::make_unique<SequentialLayer>("llama_mlp", std::move(mlp));
}

absl::StatusOr<Tensor> LlamaBlockLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                                Saved* saved) {
  saved->Clear();
  saved->children.resize(4);
  PW_ASSIGN_OR_RETURN(Tensor a, norm_1_->Forward(x, ctx, &saved->children[0]));
  PW_ASSIGN_OR_RETURN(Tensor h, attn_->ForwardWithResidual(a, x, ctx, &saved->children[1]));
  PW_ASSIGN_OR_RETURN(Tensor c, norm_2_->Forward(h, ctx, &saved->children[2]));
  return mlp_->ForwardWithResidual(c, h, ctx, &saved->children[3]);
}

absl::StatusOr<Tensor> LlamaBlockLayer::BackwardSublayers(const Tensor& dy, const LayerContext& ctx,
                                                          Saved* saved, bool weights) {
  if (saved->children.size() != 4) {
    return absl::FailedPreconditionError("llama_block: backward without forward");
  }
  PW_ASSIGN_OR_RETURN(Tensor dc, ChildBackward(*mlp_, dy, ctx, &saved->children[3], weights));
  PW_ASSIGN_OR_RETURN(Tensor dh, ChildBackward(*norm_2_, dc, ctx, &saved->children[2], weights));
  PW_RETURN_IF_ERROR(ops::AddInPlace(ops::ExecOf(ctx), dh, dy));
  PW_ASSIGN_OR_RETURN(Tensor da, ChildBackward(*attn_, dh, ctx, &saved->children[1], weights));
  PW_ASSIGN_OR_RETURN(Tensor dx, ChildBackward(*norm_1_, da, ctx, &saved->children[0], weights));
  PW_RETURN_IF_ERROR(ops::AddInPlace(ops::ExecOf(ctx), dx, dh));
  if (weights) saved->Clear();
  return dx;
}

absl::StatusOr<Tensor> LlamaBlockLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                      Saved* saved) {
  return BackwardSublayers(dy, ctx, saved, /*weights=*/false);
}

absl::StatusOr<Tensor> LlamaBlockLayer::Backward(const Tensor& dy, const LayerContext& ctx,
                                                 Saved* saved) {
  return BackwardSublayers(dy, ctx, saved, /*weights=*/true);
}

absl::Status LlamaBlockLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->children.size() != 4) {
    return absl::FailedPreconditionError("llama_block: BackwardWeight without forward");
  }
  Layer* const children[] = {norm_1_.get(), attn_.get(), norm_2_.get(), mlp_.get()};
  for (int i = 4; i-- > 0;) {
    PW_RETURN_IF_ERROR(children[i]->BackwardWeight(ctx, &saved->children[i]));
    PW_RETURN_IF_ERROR(ReportGradients(ctx, *children[i]));
  }
  saved->Clear();
  return absl::OkStatus();
}

std::vector<Parameter*> LlamaBlockLayer::Parameters() {
  std::vector<Parameter*> out;
  for (Layer* l : {static_cast<Layer*>(norm_1_.get()), static_cast<Layer*>(attn_.get()),
                   static_cast<Layer*>(norm_2_.get()), static_cast<Layer*>(mlp_.get())}) {
    for (Parameter* p : l->Parameters()) out.push_back(p);
  }
  return out;
}

std::vector<std::vector<Parameter*>> LlamaBlockLayer::ParameterGroups() {
  std::vector<std::vector<Parameter*>> out;
  for (Layer* l : {static_cast<Layer*>(norm_1_.get()), static_cast<Layer*>(attn_.get()),
                   static_cast<Layer*>(norm_2_.get()), static_cast<Layer*>(mlp_.get())}) {
    for (std::vector<Parameter*>& g : l->ParameterGroups()) out.push_back(std::move(g));
  }
  return out;
}

}  // namespace pipewright::internal
