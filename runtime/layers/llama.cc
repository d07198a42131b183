// The Llama family's layers (layers_internal.h; Note [Llama layers] in runtime/ops/llama_ops.cc):
// RMSNorm, the token embedding without positions, the rotary grouped-query attention core, the
// SwiGLU gate and the Llama block that composes them with bias-free Linear layers.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/init.h"
#include "pipewright/ops.h"
#include "pipewright/tensor_parallel.h"
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
  const ops::Exec e = ops::ExecOf(ctx);
  if (SequenceParallel(ctx)) {
    // This rank saw its positions only: the gradient is the group's sum (as LayerNormLayer's).
    Tensor g = Tensor::Zeros({dim_}, DType::kF32, AllocatorOf(ctx));
    PW_RETURN_IF_ERROR(ops::RmsNormBackwardWeight(e, x, saved->tensors[1], saved->tensors[2], g,
                                                  x.numel() / dim_, dim_));
    PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, g, "rmsnorm's weight gradient"));
    PW_RETURN_IF_ERROR(ops::AddInPlace(e, weight_.grad, g));
    saved->Clear();
    return absl::OkStatus();
  }
  PW_RETURN_IF_ERROR(ops::RmsNormBackwardWeight(e, x, saved->tensors[1], saved->tensors[2],
                                                weight_.grad, x.numel() / dim_, dim_));
  saved->Clear();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Vocab-parallel at tp_size > 1 as EmbeddingLayer is (Note [Tensor parallelism]), without
// positions: the rank's rows of its tokens, zero rows for the others, summed over the group (or
// reduce-scattered along the sequence under sequence parallelism). One nonzero term a row, so
// the same bits as at tp = 1.
TokenEmbeddingLayer::TokenEmbeddingLayer(const InitContext& init, int64_t vocab, int64_t dim)
    : vocab_(vocab), dim_(dim), tp_rank_(init.tp_rank), tp_size_(init.tp_size) {
  absl::StatusOr<TensorShard> shard = ShardOf(init, {vocab, dim}, 0, 1, init.name);
  PW_CHECK(shard.ok());  // the spec checked that the size divides the vocabulary
  wte_ = MakeShardedParameter(init, "wte.weight", {vocab, dim}, true, *shard);
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
  saved->tensors = {x};
  if (tp_size_ > 1) {
    PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "token embedding"));
    PW_RETURN_IF_ERROR(ops::EmbeddingPartForward(ops::ExecOf(ctx), x, wte_.value,
                                                 tp_rank_ * wte_.value.dim(0), Tensor(), y,
                                                 x.dim(0), x.dim(1), dim_));
    if (SequenceParallel(ctx)) {
      return SequenceReduceScatter(ctx, y, "vocab-parallel token embedding's rows");
    }
    PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, y, "vocab-parallel token embedding's rows"));
    return y;
  }
  PW_RETURN_IF_ERROR(
      ops::TokenEmbeddingForward(ops::ExecOf(ctx), x, wte_.value, y, x.numel(), dim_));
  return y;
}

absl::StatusOr<Tensor> TokenEmbeddingLayer::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                                          Saved* saved) {
  if (saved->tensors.size() != 1) {
    return absl::FailedPreconditionError("token embedding: no forward");
  }
  const Tensor& x = saved->tensors[0];
  // Under sequence parallelism the gradient of this rank's positions.
  const int64_t positions = SequenceParallel(ctx) ? x.dim(1) / ctx.tp->size : x.dim(1);
  PW_RETURN_IF_ERROR(CheckGradShape(dy, {x.dim(0), positions, dim_}, "token embedding backward"));
  saved->tensors.push_back(dy);
  return Tensor();  // token inputs have no gradient
}

absl::Status TokenEmbeddingLayer::BackwardWeight(const LayerContext& ctx, Saved* saved) {
  if (saved->tensors.size() != 2) {
    return absl::FailedPreconditionError("token embedding: BackwardWeight before BackwardInput");
  }
  const Tensor& x = saved->tensors[0];
  if (tp_size_ > 1) {
    PW_ASSIGN_OR_RETURN(
        Tensor dy, SequenceAllGather(ctx, saved->tensors[1], "token embedding's output gradient"));
    Tensor none;
    PW_RETURN_IF_ERROR(ops::EmbeddingPartBackward(ops::ExecOf(ctx), dy, x,
                                                  tp_rank_ * wte_.grad.dim(0), wte_.grad, none,
                                                  x.dim(0), x.dim(1), dim_));
    saved->Clear();
    return absl::OkStatus();
  }
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
using Parallel = LinearLayer::Parallel;

int64_t KvWidth(const LlamaBlockShape& s) { return s.kv_heads * (s.dim / s.heads); }
std::vector<int64_t> QkvSections(const LlamaBlockShape& s) {
  return {s.dim, KvWidth(s), KvWidth(s)};
}
}  // namespace

// Tensor-parallel as the GPT block (Note [Tensor parallelism]): the rank holds heads/t query
// heads and kv_heads/t key-value heads (the fused qkv column-parallel in its three unequal
// sections, so the rank's part is (q | k | v) of its heads and each of its query heads' kv head
// is among its own), ffn/t of the gate and of the up units (gate_up's two sections), and the
// o_proj and down_proj row-parallel. RMSNorms are replicated.
absl::Status LlamaBlockLayer::CheckSplit(const InitContext& init, const LlamaBlockShape& s) {
  if (init.tp_size == 1) return absl::OkStatus();
  if (s.heads % init.tp_size != 0 || s.kv_heads % init.tp_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: a tensor-parallel size of %d does not divide its %d heads and %d key-value heads",
        init.name, init.tp_size, s.heads, s.kv_heads));
  }
  PW_RETURN_IF_ERROR(LinearLayer::CheckSplit(init, s.dim, s.dim + 2 * KvWidth(s), Parallel::kColumn,
                                             QkvSections(s), init.name));
  return LinearLayer::CheckSplit(init, s.dim, 2 * s.ffn, Parallel::kColumn, {s.ffn, s.ffn},
                                 absl::StrCat(init.name, " (ffn width)"));
}

namespace {
std::unique_ptr<SequentialLayer> MakeLlamaAttention(const InitContext& init,
                                                    const LlamaBlockShape& s) {
  const int64_t t = init.tp_size;
  std::vector<std::unique_ptr<Layer>> c;
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "qkv"), s.dim, s.dim + 2 * KvWidth(s),
                                            false, 0.02f, Act::kNone, "", Parallel::kColumn,
                                            QkvSections(s)));
  c.push_back(
      std::make_unique<RotaryAttentionLayer>(s.dim / t, s.heads / t, s.kv_heads / t, s.rope_theta));
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "o_proj"), s.dim, s.dim, false, 0.02f,
                                            Act::kNone, "", Parallel::kRow));
  return std::make_unique<SequentialLayer>("llama_attention", std::move(c));
}

std::unique_ptr<SequentialLayer> MakeLlamaMlp(const InitContext& init, const LlamaBlockShape& s) {
  std::vector<std::unique_ptr<Layer>> c;
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "gate_up"), s.dim, 2 * s.ffn, false,
                                            0.02f, Act::kNone, "", Parallel::kColumn,
                                            std::vector<int64_t>{s.ffn, s.ffn}));
  c.push_back(std::make_unique<SwiGluLayer>(s.ffn / init.tp_size));
  c.push_back(std::make_unique<LinearLayer>(ChildInit(init, "down_proj"), s.ffn, s.dim, false,
                                            0.02f, Act::kNone, "", Parallel::kRow));
  return std::make_unique<SequentialLayer>("llama_mlp", std::move(c));
}
}  // namespace

LlamaBlockLayer::LlamaBlockLayer(const InitContext& init, const LlamaBlockShape& s)
    : PreNormBlockLayer(
          std::make_unique<RmsNormLayer>(ChildInit(init, "input_layernorm"), s.dim, s.eps),
          MakeLlamaAttention(ChildInit(init, "self_attn"), s),
          std::make_unique<RmsNormLayer>(ChildInit(init, "post_attention_layernorm"), s.dim, s.eps),
          MakeLlamaMlp(ChildInit(init, "mlp"), s)) {}

// SwiGLU(g | u), from the gate_up output the SwiGLU layer keeps.
absl::StatusOr<Tensor> LlamaBlockLayer::RemakeActivation(const LayerContext& ctx,
                                                         const Saved& mlp) const {
  const Tensor& gu = mlp.children.at(1).tensors.at(0);
  const int64_t ffn = gu.dim(-1) / 2;
  Tensor y = Tensor::Empty(WithLastDim(gu.shape(), ffn), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::SwiGluForward(ops::ExecOf(ctx), gu, y, gu.numel() / (2 * ffn), ffn));
  return y;
}

}  // namespace pipewright::internal
