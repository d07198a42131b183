// Composite layers: sequential containers, causal self-attention, the GPT-2 block.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/init.h"
#include "pipewright/ops.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright::internal {

namespace {
// GPT-2 scales the init of projections that write into the residual stream by 1/sqrt(2 L).
float ResidualStd(const InitContext& init) {
  return 0.02f / std::sqrt(2.0f * static_cast<float>(std::max(1, init.num_blocks)));
}

absl::StatusOr<Tensor> AddTensors(const Tensor& a, const Tensor& b, const LayerContext& ctx) {
  return ops::Add(ops::ExecOf(ctx), a, b);
}
}  // namespace

absl::StatusOr<Tensor> SequentialLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                                Saved* saved) {
  saved->Clear();
  saved->children.resize(children_.size());
  Tensor h = x;
  for (size_t i = 0; i < children_.size(); ++i) {
    PW_ASSIGN_OR_RETURN(h, children_[i]->Forward(h, ctx, &saved->children[i]));
  }
  return h;
}

absl::StatusOr<Tensor> SequentialLayer::ForwardWithResidual(const Tensor& x, const Tensor& residual,
                                                            const LayerContext& ctx, Saved* saved) {
  saved->Clear();
  saved->children.resize(children_.size());
  if (children_.empty()) return AddTensors(x, residual, ctx);
  Tensor h = x;
  const size_t last = children_.size() - 1;
  for (size_t i = 0; i < last; ++i) {
    PW_ASSIGN_OR_RETURN(h, children_[i]->Forward(h, ctx, &saved->children[i]));
  }
  if (auto* linear = dynamic_cast<LinearLayer*>(children_[last].get())) {
    return linear->ForwardWithResidual(h, residual, ctx, &saved->children[last]);
  }
  PW_ASSIGN_OR_RETURN(h, children_[last]->Forward(h, ctx, &saved->children[last]));
  PW_RETURN_IF_ERROR(ops::AddInPlace(ops::ExecOf(ctx), h, residual));
  return h;
}

// Note [Backward by layer]. A schedule without a separate weight-gradient pass (1F1B, GPipe,
// interleaved) runs Layer::Backward. A composite layer's default Backward would run all its
// children's BackwardInput and then all their BackwardWeight, so a product's weight gradient
// (dW = dY^T X, and the bias and LayerNorm weight gradients) came after the rest of the
// block's backward had pushed its dY and X out of L2, and read them from L3 or memory again.
// SequentialLayer and TransformerBlockLayer override Backward to run each child's Backward in
// turn, and LinearLayer's Backward runs its weight gradient first: its dY has just been written
// (by the input-gradient product or the GELU backward above it) and is packed while still in
// L2, and then the input-gradient product leaves dX in cache for the layer below, which reads it
// next. Every gradient is the same operations on the same values (a parameter's gradient
// depends on its own layer's dY and X only), so the bits are the same; saved tensors are
// released earlier too (docs/memory.md). gpt-small, pp=1, one thread: step 1.963 -> 1.926 s
// (median of 6 interleaved rounds; interleaving the children alone, with each Linear's input
// gradient first, measured no faster: docs/benchmarks-kernels.md). Zero-bubble schedules' separate
// I and W passes still call BackwardInput and BackwardWeight.
absl::StatusOr<Tensor> ChildBackward(Layer& child, const Tensor& dy, const LayerContext& ctx,
                                     Saved* saved, bool weights) {
  if (!weights) return child.BackwardInput(dy, ctx, saved);
  PW_ASSIGN_OR_RETURN(Tensor dx, child.Backward(dy, ctx, saved));
  PW_RETURN_IF_ERROR(ReportGradients(ctx, child));  // Note [Gradient groups] in layer.h
  return dx;
}

// The children's groups, in their order (Note [Gradient groups] in layer.h).
static std::vector<std::vector<Parameter*>> ChildGroups(std::initializer_list<Layer*> children) {
  std::vector<std::vector<Parameter*>> out;
  for (Layer* c : children) {
    for (std::vector<Parameter*>& g : c->ParameterGroups()) out.push_back(std::move(g));
  }
  return out;
}

absl::StatusOr<Tensor> SequentialLayer::BackwardChildren(const Tensor& dy, const LayerContext& ctx,
                                                         Saved* saved, bool weights) {
  if (saved->children.size() != children_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(kind_, ": backward without forward"));
  }
  Tensor g = dy;
  for (size_t i = children_.size(); i-- > 0;) {
    PW_ASSIGN_OR_RETURN(g, ChildBackward(*children_[i], g, ctx, &saved->children[i], weights));
  }
  if (weights) saved->Clear();
  return g;
}

absl::StatusOr<Tensor> SequentialLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                      Saved* saved) {
  return BackwardChildren(dy, ctx, saved, /*weights=*/false);
}

absl::StatusOr<Tensor> SequentialLayer::Backward(const Tensor& dy, const LayerContext& ctx,
                                                 Saved* saved) {
  return BackwardChildren(dy, ctx, saved, /*weights=*/true);
}

absl::Status SequentialLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->children.size() != children_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(kind_, ": BackwardWeight without forward"));
  }
  for (size_t i = children_.size(); i-- > 0;) {
    PW_RETURN_IF_ERROR(children_[i]->BackwardWeight(ctx, &saved->children[i]));
    PW_RETURN_IF_ERROR(ReportGradients(ctx, *children_[i]));
  }
  saved->Clear();
  return absl::OkStatus();
}

std::vector<std::vector<Parameter*>> SequentialLayer::ParameterGroups() {
  std::vector<std::vector<Parameter*>> out;
  for (auto& c : children_) {
    for (std::vector<Parameter*>& g : c->ParameterGroups()) out.push_back(std::move(g));
  }
  return out;
}

std::vector<Parameter*> SequentialLayer::Parameters() {
  std::vector<Parameter*> out;
  for (auto& c : children_) {
    for (Parameter* p : c->Parameters()) out.push_back(p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
absl::StatusOr<Tensor> AttentionCoreLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                                   Saved* saved) {
  if (!x.defined() || x.rank() != 3 || x.dim(2) != 3 * dim_ || x.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: expected qkv [B, T, ", 3 * dim_, "] f32, got ", x.ShapeString()));
  }
  int64_t B = x.dim(0), T = x.dim(1);
  const ops::Exec e = ops::ExecOf(ctx);
  Tensor out = Tensor::Empty({B, T, dim_}, DType::kF32, AllocatorOf(ctx));
  Tensor lse = Tensor::Empty(ops::AttentionLseShape(B, T, heads_), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::AttentionForward(e, x, out, lse, B, T, dim_, heads_));
  // The backward needs rowsum(dout * out). `out` is the projection's input, which that layer
  // keeps anyway in fp32 (with 16-bit compute it keeps a 16-bit copy: then this is C floats a
  // token, against the H T probabilities a token the CPU saved before it was flash-style).
  saved->tensors = {x, lse, out};
  return out;
}

absl::StatusOr<Tensor> AttentionCoreLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                         Saved* saved) {
  if (saved->tensors.size() != 3) return absl::FailedPreconditionError("attention: no forward");
  const Tensor& qkv = saved->tensors[0];
  int64_t B = qkv.dim(0), T = qkv.dim(1);
  PW_RETURN_IF_ERROR(CheckGradShape(dy, {B, T, dim_}, "attention backward"));
  PW_ASSIGN_OR_RETURN(Tensor dqkv,
                      ops::AttentionBackward(ops::ExecOf(ctx), dy, qkv, saved->tensors[2],
                                             saved->tensors[1], B, T, dim_, heads_));
  saved->Clear();
  return dqkv;
}

// Under tensor parallelism (Note [Tensor parallelism] in pipewright/tensor_parallel.h) the
// first product of each is column-parallel and the second row-parallel: the rank's hidden units,
// or its heads (the qkv weight's q, k and v thirds split alike, so the rank's part of qkv is
// (q | k | v) of its heads and the attention core runs on them unchanged).
using Parallel = LinearLayer::Parallel;

absl::Status CheckMlpSplit(const InitContext& init, int64_t dim, int64_t hidden) {
  return LinearLayer::CheckSplit(init, dim, hidden, Parallel::kColumn, {},
                                 absl::StrCat(init.name, " (hidden width)"));
}

absl::Status CheckAttentionSplit(const InitContext& init, int64_t dim, int64_t heads) {
  if (heads % init.tp_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: a tensor-parallel size of %d does not divide its %d heads", init.name,
                        init.tp_size, heads));
  }
  return LinearLayer::CheckSplit(init, dim, 3 * dim, Parallel::kColumn, {dim, dim, dim}, init.name);
}

std::unique_ptr<SequentialLayer> MakeMlp(const InitContext& init, int64_t dim, int64_t hidden) {
  std::vector<std::unique_ptr<Layer>> c;
  // fc + bias + GELU as one layer: the bias and GELU are fused (ops::BiasGeluForward).
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "fc"), dim, hidden, true, 0.02f,
                                            LinearLayer::Activation::kGelu, "", Parallel::kColumn));
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "proj"), hidden, dim, true,
                                            ResidualStd(init), LinearLayer::Activation::kNone, "",
                                            Parallel::kRow));
  return std::make_unique<SequentialLayer>("mlp", std::move(c));
}

std::unique_ptr<SequentialLayer> MakeAttention(const InitContext& init, int64_t dim,
                                               int64_t heads) {
  std::vector<std::unique_ptr<Layer>> c;
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "qkv"), dim, 3 * dim, true, 0.02f,
                                            LinearLayer::Activation::kNone, "", Parallel::kColumn,
                                            std::vector<int64_t>{dim, dim, dim}));
  c.push_back(std::make_unique<AttentionCoreLayer>(dim / init.tp_size, heads / init.tp_size));
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "proj"), dim, dim, true,
                                            ResidualStd(init), LinearLayer::Activation::kNone, "",
                                            Parallel::kRow));
  return std::make_unique<SequentialLayer>("causal_self_attention", std::move(c));
}

// ---------------------------------------------------------------------------------------------
namespace {
// The Linear layers' saved inputs inside a block's Saved (LinearLayer keeps its input first): the
// attention's first product (qkv), the MLP's first (fc, gate_up) and its last (proj, down_proj).
Tensor& AttentionInput(Saved& s) { return s.children[1].children.at(0).tensors.at(0); }
Tensor& MlpInput(Saved& s) { return s.children[3].children.at(0).tensors.at(0); }
Tensor& MlpLastInput(Saved& s) { return s.children[3].children.back().tensors.at(0); }
}  // namespace

absl::StatusOr<Tensor> PreNormBlockLayer::Forward(const Tensor& x, const LayerContext& ctx,
                                                  Saved* saved) {
  saved->Clear();
  saved->children.resize(4);
  // Note [Residual epilogue]. The residual adds run in the epilogues of the attention's and the
  // MLP's output products (SequentialLayer::ForwardWithResidual, ops::GemmBias with a
  // residual): h = x + attn(...) and out = h + mlp(...) are written once, where an Add pass
  // re-read the product's output and the residual and wrote the sum. The same additions of the
  // same values (x + y == y + x in IEEE arithmetic), so the same bits.
  PW_ASSIGN_OR_RETURN(Tensor a, norm_1_->Forward(x, ctx, &saved->children[0]));
  PW_ASSIGN_OR_RETURN(Tensor h, attn_->ForwardWithResidual(a, x, ctx, &saved->children[1]));
  PW_ASSIGN_OR_RETURN(Tensor c, norm_2_->Forward(h, ctx, &saved->children[2]));
  PW_ASSIGN_OR_RETURN(Tensor d, mlp_->ForwardWithResidual(c, h, ctx, &saved->children[3]));
  if (ctx.selective_recompute) {
    // Note [Selective recomputation]. The inputs the products kept that are pointwise functions
    // of other kept tensors: norm_1(x) and norm_2(h) (the norms keep x and h) and the MLP's
    // activation (GELU(pre), which the fused fc keeps pre for; SwiGLU(g | u), which the SwiGLU
    // layer keeps g | u for). Dropped here, remade by Remake in the backward.
    AttentionInput(*saved) = Tensor();
    MlpInput(*saved) = Tensor();
    MlpLastInput(*saved) = Tensor();
  }
  return d;
}

// Remakes what Forward dropped under selective recomputation, with the same kernels on the same
// inputs (so the same bits), rounded to the precision the products ran in.
absl::Status PreNormBlockLayer::Remake(const LayerContext& ctx, Saved* saved) {
  const ops::Exec e = ops::ExecOf(ctx);
  auto as_saved = [&](Tensor t) -> absl::StatusOr<Tensor> {
    if (ctx.compute_dtype == DType::kF32) return t;
    return ops::Cast(e, t, ctx.compute_dtype);
  };
  Saved scratch;
  const Tensor& x = saved->children[0].tensors.at(0);  // norm_1's input
  const Tensor& h = saved->children[2].tensors.at(0);  // norm_2's input
  PW_ASSIGN_OR_RETURN(Tensor a, norm_1_->Forward(x, ctx, &scratch));
  PW_ASSIGN_OR_RETURN(AttentionInput(*saved), as_saved(std::move(a)));
  PW_ASSIGN_OR_RETURN(Tensor c, norm_2_->Forward(h, ctx, &scratch));
  PW_ASSIGN_OR_RETURN(MlpInput(*saved), as_saved(std::move(c)));
  PW_ASSIGN_OR_RETURN(Tensor g, RemakeActivation(ctx, saved->children[3]));
  PW_ASSIGN_OR_RETURN(MlpLastInput(*saved), as_saved(std::move(g)));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> PreNormBlockLayer::BackwardSublayers(const Tensor& dy,
                                                            const LayerContext& ctx, Saved* saved,
                                                            bool weights) {
  if (saved->children.size() != 4) {
    return absl::FailedPreconditionError(absl::StrCat(kind(), ": backward without forward"));
  }
  if (!AttentionInput(*saved).defined()) PW_RETURN_IF_ERROR(Remake(ctx, saved));
  PW_ASSIGN_OR_RETURN(Tensor dc, ChildBackward(*mlp_, dy, ctx, &saved->children[3], weights));
  PW_ASSIGN_OR_RETURN(Tensor dh, ChildBackward(*norm_2_, dc, ctx, &saved->children[2], weights));
  PW_RETURN_IF_ERROR(ops::AddInPlace(ops::ExecOf(ctx), dh, dy));
  PW_ASSIGN_OR_RETURN(Tensor da, ChildBackward(*attn_, dh, ctx, &saved->children[1], weights));
  PW_ASSIGN_OR_RETURN(Tensor dx, ChildBackward(*norm_1_, da, ctx, &saved->children[0], weights));
  PW_RETURN_IF_ERROR(ops::AddInPlace(ops::ExecOf(ctx), dx, dh));
  if (weights) saved->Clear();
  return dx;
}

absl::StatusOr<Tensor> PreNormBlockLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                        Saved* saved) {
  return BackwardSublayers(dy, ctx, saved, /*weights=*/false);
}

absl::StatusOr<Tensor> PreNormBlockLayer::Backward(const Tensor& dy, const LayerContext& ctx,
                                                   Saved* saved) {
  return BackwardSublayers(dy, ctx, saved, /*weights=*/true);
}

absl::Status PreNormBlockLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->children.size() != 4) {
    return absl::FailedPreconditionError(absl::StrCat(kind(), ": BackwardWeight without forward"));
  }
  Layer* const children[] = {norm_1_.get(), attn_.get(), norm_2_.get(), mlp_.get()};
  for (int i = 4; i-- > 0;) {
    PW_RETURN_IF_ERROR(children[i]->BackwardWeight(ctx, &saved->children[i]));
    PW_RETURN_IF_ERROR(ReportGradients(ctx, *children[i]));
  }
  saved->Clear();
  return absl::OkStatus();
}

std::vector<std::vector<Parameter*>> PreNormBlockLayer::ParameterGroups() {
  return ChildGroups({norm_1_.get(), attn_.get(), norm_2_.get(), mlp_.get()});
}

std::vector<Parameter*> PreNormBlockLayer::Parameters() {
  std::vector<Parameter*> out;
  for (Layer* l :
       std::initializer_list<Layer*>{norm_1_.get(), attn_.get(), norm_2_.get(), mlp_.get()}) {
    for (Parameter* p : l->Parameters()) out.push_back(p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
TransformerBlockLayer::TransformerBlockLayer(const InitContext& init, int64_t dim, int64_t heads)
    : PreNormBlockLayer(std::make_unique<LayerNormLayer>(ChildInit(init, "ln_1"), dim, 1e-5f),
                        MakeAttention(ChildInit(init, "attn"), dim, heads),
                        std::make_unique<LayerNormLayer>(ChildInit(init, "ln_2"), dim, 1e-5f),
                        MakeMlp(ChildInit(init, "mlp"), dim, 4 * dim)) {}

// GELU(pre), from the pre-activation the fused fc keeps.
absl::StatusOr<Tensor> TransformerBlockLayer::RemakeActivation(const LayerContext& ctx,
                                                               const Saved& mlp) const {
  return ops::GeluForward(ops::ExecOf(ctx), mlp.children.at(0).tensors.at(1));
}

}  // namespace pipewright::internal
