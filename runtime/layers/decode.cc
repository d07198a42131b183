// Incremental decoding of the built-in layers (Note [Incremental decoding] in
// pipewright/layer.h): what each keeps between the steps of one sequence and how it computes the
// rows of new positions alone. The math is the training forward's ops (pipewright/ops.h): the
// position-wise layers run their Forward on the new rows, the embedding its op on a view of the
// new positions' rows of the position table, the attention the training kernel for a prefill
// and ops::AttentionDecode, over its key/value cache, for later positions.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/init.h"
#include "pipewright/ops.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright::internal {

absl::StatusOr<int64_t> CheckDecodeInput(const Tensor& x, const DecodeCache& cache,
                                         absl::string_view what) {
  if (!x.defined() || x.rank() < 2 || x.dim(0) != 1 || x.dim(1) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": expected the rows of n >= 1 new positions of one sequence [1, n, ...], got ",
        x.defined() ? x.ShapeString() : std::string("no tensor")));
  }
  const int64_t n = x.dim(1);
  if (cache.length + n > cache.capacity) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %d new positions after %d do not fit the cache's %d (StartDecode "
                        "a new sequence)",
                        what, n, cache.length, cache.capacity));
  }
  return n;
}

absl::Status StartCountingCache(int64_t capacity, absl::string_view what, DecodeCache* cache) {
  if (capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": decoding capacity ", capacity, ": must be >= 1"));
  }
  *cache = DecodeCache{};
  cache->capacity = capacity;
  return absl::OkStatus();
}

absl::StatusOr<Tensor> DecodePositionwise(Layer& layer, const Tensor& x, const LayerContext& ctx,
                                          DecodeCache* cache) {
  PW_ASSIGN_OR_RETURN(const int64_t n, CheckDecodeInput(x, *cache, layer.kind()));
  Saved scratch;  // what Forward keeps for a backward that will not come
  PW_ASSIGN_OR_RETURN(Tensor y, layer.Forward(x, ctx, &scratch));
  cache->length += n;
  return y;
}

// ---- embedding: the position table's rows of the new positions -------------------------------
absl::Status EmbeddingLayer::StartDecode(int64_t capacity, const LayerContext&,
                                         DecodeCache* cache) {
  if (capacity > max_seq_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "embedding: decoding capacity %d exceeds the %d positions it embeds", capacity, max_seq_));
  }
  return StartCountingCache(capacity, kind(), cache);
}

absl::StatusOr<Tensor> EmbeddingLayer::Decode(const Tensor& x, const LayerContext& ctx,
                                              DecodeCache* cache) {
  if (!x.defined() || x.dtype() != DType::kI32 || x.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding decode: expected [1, n] i32 tokens, got ",
                     x.defined() ? x.ShapeString() : std::string("no tensor")));
  }
  PW_ASSIGN_OR_RETURN(const int64_t n, CheckDecodeInput(x, *cache, "embedding decode"));
  PW_RETURN_IF_ERROR(CheckTokens(x, vocab_));
  // wpe rows [length, length + n): the op adds row t of the table it is given to token t.
  PW_ASSIGN_OR_RETURN(Tensor wpe, wpe_.value.View(cache->length * dim_, {n, dim_}));
  Tensor y = Tensor::Empty({1, n, dim_}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::EmbeddingForward(ops::ExecOf(ctx), x, wte_.value, wpe, y, 1, n, dim_));
  cache->length += n;
  return y;
}

// ---- attention: the key/value cache ------------------------------------------------------------
// cache->tensors = {kv}: [capacity, 2C], row j holding position j's key and value (k | v), as
// the qkv rows hold them after their q.
namespace {

absl::Status StartKvCache(int64_t capacity, int64_t C, absl::string_view what,
                          const LayerContext& ctx, DecodeCache* cache) {
  PW_RETURN_IF_ERROR(StartCountingCache(capacity, what, cache));
  cache->tensors = {Tensor::Empty({capacity, 2 * C}, DType::kF32, AllocatorOf(ctx))};
  return absl::OkStatus();
}

// The attention of qkv [1, n, 3C]'s rows at positions [cache->length, + n): their k | v appended
// to the cache, then a prefill (the training forward of its positions: that kernel's bits) or
// ops::AttentionDecode over every cached position. Advances the cache.
absl::StatusOr<Tensor> AttendWithKvCache(const Tensor& qkv, int64_t n, int64_t C, int64_t heads,
                                         absl::string_view what, const LayerContext& ctx,
                                         DecodeCache* cache) {
  if (cache->tensors.size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": no StartDecode"));
  }
  const ops::Exec e = ops::ExecOf(ctx);
  Tensor& kv = cache->tensors[0];
  const int64_t start = cache->length;
  for (int64_t i = 0; i < n; ++i) {  // the new rows' k | v, after their q
    PW_RETURN_IF_ERROR(ops::CopyRange(e, qkv, i * 3 * C + C, kv, (start + i) * 2 * C, 2 * C));
  }
  Tensor out = Tensor::Empty({1, n, C}, DType::kF32, AllocatorOf(ctx));
  if (start == 0) {
    Tensor lse = Tensor::Empty(ops::AttentionLseShape(1, n, heads), DType::kF32, AllocatorOf(ctx));
    PW_RETURN_IF_ERROR(ops::AttentionForward(e, qkv, out, lse, 1, n, C, heads));
  } else {
    PW_RETURN_IF_ERROR(ops::AttentionDecode(e, qkv, kv, out, start, n, C, heads));
  }
  cache->length += n;
  return out;
}

}  // namespace

absl::Status AttentionCoreLayer::StartDecode(int64_t capacity, const LayerContext& ctx,
                                             DecodeCache* cache) {
  return StartKvCache(capacity, dim_, kind(), ctx, cache);
}

absl::StatusOr<Tensor> AttentionCoreLayer::Decode(const Tensor& x, const LayerContext& ctx,
                                                  DecodeCache* cache) {
  if (!x.defined() || x.rank() != 3 || x.dim(2) != 3 * dim_ || x.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("attention decode: expected qkv [1, n, ",
                                                   3 * dim_, "] f32, got ",
                                                   x.defined() ? x.ShapeString() : "no tensor"));
  }
  PW_ASSIGN_OR_RETURN(const int64_t n, CheckDecodeInput(x, *cache, "attention decode"));
  return AttendWithKvCache(x, n, dim_, heads_, "attention decode", ctx, cache);
}

// ---- composites: the children in turn ----------------------------------------------------------
IncrementalDecoder* SequentialLayer::decoder() {
  for (const auto& c : children_) {
    if (c->decoder() == nullptr) return nullptr;
  }
  return this;
}

absl::Status SequentialLayer::StartDecode(int64_t capacity, const LayerContext& ctx,
                                          DecodeCache* cache) {
  PW_RETURN_IF_ERROR(StartCountingCache(capacity, kind_, cache));
  cache->children.resize(children_.size());
  for (size_t i = 0; i < children_.size(); ++i) {
    IncrementalDecoder* d = children_[i]->decoder();
    if (d == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          kind_, ": child ", i, " (", children_[i]->kind(), ") has no incremental decoding"));
    }
    PW_RETURN_IF_ERROR(d->StartDecode(capacity, ctx, &cache->children[i]));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> SequentialLayer::Decode(const Tensor& x, const LayerContext& ctx,
                                               DecodeCache* cache) {
  PW_ASSIGN_OR_RETURN(const int64_t n, CheckDecodeInput(x, *cache, kind_));
  if (cache->children.size() != children_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(kind_, ": decode without StartDecode"));
  }
  Tensor h = x;
  for (size_t i = 0; i < children_.size(); ++i) {
    PW_ASSIGN_OR_RETURN(h, children_[i]->decoder()->Decode(h, ctx, &cache->children[i]));
  }
  cache->length += n;
  return h;
}

// The pre-norm block's cache: {norm_1, attn, norm_2, mlp}, as its Saved.
IncrementalDecoder* PreNormBlockLayer::decoder() {
  for (Layer* l :
       std::initializer_list<Layer*>{norm_1_.get(), attn_.get(), norm_2_.get(), mlp_.get()}) {
    if (l->decoder() == nullptr) return nullptr;
  }
  return this;
}

absl::Status PreNormBlockLayer::StartDecode(int64_t capacity, const LayerContext& ctx,
                                            DecodeCache* cache) {
  PW_RETURN_IF_ERROR(StartCountingCache(capacity, kind(), cache));
  cache->children.resize(4);
  int i = 0;
  for (Layer* l :
       std::initializer_list<Layer*>{norm_1_.get(), attn_.get(), norm_2_.get(), mlp_.get()}) {
    if (l->decoder() == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(kind(), ": its ", l->kind(), " has no incremental decoding"));
    }
    PW_RETURN_IF_ERROR(l->decoder()->StartDecode(capacity, ctx, &cache->children[i++]));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> PreNormBlockLayer::Decode(const Tensor& x, const LayerContext& ctx,
                                                 DecodeCache* cache) {
  PW_ASSIGN_OR_RETURN(const int64_t n, CheckDecodeInput(x, *cache, kind()));
  if (cache->children.size() != 4) {
    return absl::FailedPreconditionError(absl::StrCat(kind(), ": decode without StartDecode"));
  }
  const ops::Exec e = ops::ExecOf(ctx);
  std::vector<DecodeCache>& c = cache->children;
  PW_ASSIGN_OR_RETURN(Tensor a, norm_1_->decoder()->Decode(x, ctx, &c[0]));
  PW_ASSIGN_OR_RETURN(Tensor h, attn_->Decode(a, ctx, &c[1]));
  PW_RETURN_IF_ERROR(ops::AddInPlace(e, h, x));  // h = x + attn(norm_1(x))
  PW_ASSIGN_OR_RETURN(Tensor m, norm_2_->decoder()->Decode(h, ctx, &c[2]));
  PW_ASSIGN_OR_RETURN(Tensor d, mlp_->Decode(m, ctx, &c[3]));
  PW_RETURN_IF_ERROR(ops::AddInPlace(e, d, h));  // out = h + mlp(norm_2(h))
  cache->length += n;
  return d;
}

// ---- the Llama family's rotary attention: its cache -------------------------------------------
// cache->tensors = {kv}: [capacity, 2C], row j holding position j's key and value (k | v) turned
// to position j and repeated for every query head (ExpandKv), as the attention's qkv rows hold
// them after their q: the GPT attention's cache and ops::AttentionDecode, at heads / kv_heads
// times a grouped cache's size.
absl::Status RotaryAttentionLayer::StartDecode(int64_t capacity, const LayerContext& ctx,
                                               DecodeCache* cache) {
  return StartKvCache(capacity, dim_, kind(), ctx, cache);
}

absl::StatusOr<Tensor> RotaryAttentionLayer::Decode(const Tensor& x, const LayerContext& ctx,
                                                    DecodeCache* cache) {
  const int64_t D = dim_ / heads_, K = kv_heads_ * D;
  if (!x.defined() || x.rank() != 3 || x.dim(2) != dim_ + 2 * K || x.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("rotary attention decode: expected qkv [1, n, ",
                                                   dim_ + 2 * K, "] f32, got ",
                                                   x.defined() ? x.ShapeString() : "no tensor"));
  }
  PW_ASSIGN_OR_RETURN(const int64_t n, CheckDecodeInput(x, *cache, "rotary attention decode"));
  if (cache->tensors.size() != 1) {
    return absl::FailedPreconditionError("rotary attention decode: no StartDecode");
  }
  const ops::Exec e = ops::ExecOf(ctx);
  Tensor qkv = Tensor::Empty({1, n, 3 * dim_}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::ExpandKv(e, x, qkv, n, heads_, kv_heads_, D));
  // The new rows at positions [length, length + n): Forward's turn of those rows, bit for bit.
  PW_RETURN_IF_ERROR(ops::Rope(e, qkv, n, n, 3 * dim_, 0, 2 * heads_, D, theta_,
                               /*inverse=*/false, cache->length));
  return AttendWithKvCache(qkv, n, dim_, heads_, "rotary attention decode", ctx, cache);
}

}  // namespace pipewright::internal
