// Concrete built-in layers (internal; users go through the LayerSpec factories in layer.h).
#ifndef PIPEWRIGHT_RUNTIME_LAYERS_LAYERS_INTERNAL_H_
#define PIPEWRIGHT_RUNTIME_LAYERS_LAYERS_INTERNAL_H_

#include <memory>
#include <vector>

#include "pipewright/layer.h"

namespace pipewright::internal {

std::vector<int64_t> WithLastDim(const std::vector<int64_t>& shape, int64_t last);

// ---- incremental decoding of the built-in layers (runtime/layers/decode.cc) ----
// Decode's checks (IncrementalDecoder): x is [1, n, ...] with n >= 1 and the cache has room for
// n more positions. Returns n; InvalidArgument naming `what` otherwise.
absl::StatusOr<int64_t> CheckDecodeInput(const Tensor& x, const DecodeCache& cache,
                                         absl::string_view what);
// A fresh cache of `capacity` positions that keeps nothing but the count.
absl::Status StartCountingCache(int64_t capacity, absl::string_view what, DecodeCache* cache);
// Decode of a layer whose output rows depend on their own input rows only (Linear, LayerNorm,
// GELU, RMSNorm, SwiGLU, the token embedding): its Forward on the new rows.
absl::StatusOr<Tensor> DecodePositionwise(Layer& layer, const Tensor& x, const LayerContext& ctx,
                                          DecodeCache* cache);
// The incremental decoding of such a layer L (a Layer deriving from this): a cache that counts,
// and Forward on the new rows.
template <class L>
class PositionwiseDecoder : public IncrementalDecoder {
 public:
  absl::Status StartDecode(int64_t capacity, const LayerContext&, DecodeCache* cache) override {
    return StartCountingCache(capacity, static_cast<L*>(this)->kind(), cache);
  }
  absl::StatusOr<Tensor> Decode(const Tensor& x, const LayerContext& ctx,
                                DecodeCache* cache) override {
    return DecodePositionwise(*static_cast<L*>(this), x, ctx, cache);
  }
};

// y = x W^T + b with W [out, in] row-major (PyTorch nn.Linear layout); with Activation::kGelu,
// y = GELU(x W^T + b), the bias and the GELU applied in one fused pass (ops::BiasGeluForward) and
// their backward likewise (the MLP's first projection). Parameters and their names are those of
// the plain Linear either way.
//
// Tensor parallelism (Note [Tensor parallelism] in pipewright/tensor_parallel.h): kColumn holds
// its part of the outputs (piece tp_rank of each of the output axis's `sections` of W and b,
// Note [Tensor-parallel shards]; empty: one section) and all-reduces its input gradient; kRow holds
// its part of the inputs, adds the bias and residual on tensor rank 0 only and all-reduces its
// output. `in` and `out` are the whole layer's; at tp_size 1 both modes are the plain layer.
class LinearLayer final : public Layer, public PositionwiseDecoder<LinearLayer> {
 public:
  enum class Activation { kNone, kGelu };
  enum class Parallel { kNone, kColumn, kRow };
  // `tied_weight`: the global name of the parameter the weight is a tied copy of (or "").
  // The caller checks the split first (CheckLinearSplit).
  LinearLayer(const InitContext& init, int64_t in, int64_t out, bool bias, float std,
              Activation activation = Activation::kNone, const std::string& tied_weight = "",
              Parallel parallel = Parallel::kNone, const std::vector<int64_t>& sections = {});
  // InvalidArgument naming `what` when init.tp_size does not split the layer's axis.
  static absl::Status CheckSplit(const InitContext& init, int64_t in, int64_t out,
                                 Parallel parallel, const std::vector<int64_t>& sections,
                                 absl::string_view what);
  absl::string_view kind() const override { return "linear"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;
  // The weight gradient, then the input gradient (Note [Backward by layer]).
  absl::StatusOr<Tensor> Backward(const Tensor& dy, const LayerContext& ctx, Saved* saved) override;
  std::vector<Parameter*> Parameters() override;
  // Forward plus a residual connection: x W^T + b + residual, the same values (and saved state)
  // as Forward then AddInPlace(y, residual); the add in the product's epilogue where the CPU's
  // GEMM can (Note [Residual epilogue] in transformer.cc).
  absl::StatusOr<Tensor> ForwardWithResidual(const Tensor& x, const Tensor& residual,
                                             const LayerContext& ctx, Saved* saved);

 private:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x, const Tensor* residual,
                                     const LayerContext& ctx, Saved* saved);
  absl::StatusOr<Tensor> ForwardPart(const Tensor& x, int64_t rows, const Tensor* residual,
                                     bool bias, const LayerContext& ctx, Saved* saved);
  // BackwardInput, or with `weights` the weight gradient first and then the input gradient.
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy_out, const LayerContext& ctx, Saved* saved,
                                      bool weights);

  int64_t in_, out_;  // this rank's part
  bool has_bias_;
  Activation activation_;
  Parallel parallel_;
  int tp_rank_, tp_size_;
  Parameter weight_, bias_;
};

class GeluLayer final : public Layer, public PositionwiseDecoder<GeluLayer> {
 public:
  absl::string_view kind() const override { return "gelu"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext&, Saved*) override { return absl::OkStatus(); }
};

class LayerNormLayer final : public Layer, public PositionwiseDecoder<LayerNormLayer> {
 public:
  LayerNormLayer(const InitContext& init, int64_t dim, float eps);
  absl::string_view kind() const override { return "layernorm"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;
  std::vector<Parameter*> Parameters() override { return {&gamma_, &beta_}; }

 private:
  int64_t dim_;
  float eps_;
  Parameter gamma_, beta_;
};

// OK when every token of the host tensor x is in [0, vocab) (device tokens are checked on the
// host before their copy); InvalidArgument naming the first one that is not.
absl::Status CheckTokens(const Tensor& x, int64_t vocab);

// Vocab-parallel at init.tp_size > 1 (runtime/layers/vocab_parallel.cc): the rank holds rows
// [r V/t, (r+1) V/t) of the token table, looks up the tokens in that range (zero rows for the
// others), rank 0 adds the positions, and the rows are all-reduced. The spec checks that the size
// divides the vocabulary.
class EmbeddingLayer final : public Layer, public IncrementalDecoder {
 public:
  EmbeddingLayer(const InitContext& init, int64_t vocab, int64_t max_seq, int64_t dim);
  absl::string_view kind() const override { return "embedding"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::Status StartDecode(int64_t capacity, const LayerContext& ctx, DecodeCache* cache) override;
  absl::StatusOr<Tensor> Decode(const Tensor& x, const LayerContext& ctx,
                                DecodeCache* cache) override;
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;
  std::vector<Parameter*> Parameters() override { return {&wte_, &wpe_}; }

 private:
  absl::StatusOr<Tensor> ForwardParallel(const Tensor& x, const LayerContext& ctx);
  absl::Status BackwardWeightParallel(const Tensor& tokens, const Tensor& dy,
                                      const LayerContext& ctx);
  int64_t vocab_, max_seq_, dim_;
  int tp_rank_ = 0, tp_size_ = 1;
  Parameter wte_, wpe_;
};

// OK when every target of a host tensor is below `vocab` (negative ones are ignored rows; device
// targets were checked on the host before their copy); InvalidArgument naming the first that is
// not.
absl::Status CheckTargets(const Tensor& targets, int64_t vocab);

// Mean token cross-entropy of logits against ctx.targets; output [1]. The incoming gradient
// dy[0] scales the result (the engine passes 1 / micro-batches). Vocab-parallel at tp_size > 1
// (runtime/layers/vocab_parallel.cc): the input is the rank's part of the logits (a column-parallel
// LM head's), and the row maxima, sums of exponentials and target logits are reduced over the
// group.
class CrossEntropyLayer final : public Layer {
 public:
  explicit CrossEntropyLayer(const InitContext& init = {})
      : tp_rank_(init.tp_rank), tp_size_(init.tp_size) {}
  absl::string_view kind() const override { return "cross_entropy"; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext&, Saved*) override { return absl::OkStatus(); }

 private:
  absl::StatusOr<Tensor> ForwardParallel(const Tensor& x, const Tensor& targets,
                                         const LayerContext& ctx, Saved* saved);
  absl::StatusOr<Tensor> BackwardParallel(float g, const LayerContext& ctx, Saved* saved);
  int tp_rank_, tp_size_;
};

// Identity on [B, T, dim] f32 that sleeps instead of computing (engine overhead benchmarks).
// Forward and BackwardInput return copies from ctx.allocator; nothing is saved.
class DelayLayer final : public Layer {
 public:
  DelayLayer(int64_t dim, double forward_s, double backward_input_s, double backward_weight_s)
      : dim_(dim),
        forward_s_(forward_s),
        backward_input_s_(backward_input_s),
        backward_weight_s_(backward_weight_s) {}
  absl::string_view kind() const override { return "delay"; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;

 private:
  int64_t dim_;
  double forward_s_, backward_input_s_, backward_weight_s_;
};

// Children applied in order; its Saved has one child per sub-layer.
class SequentialLayer : public Layer, public IncrementalDecoder {
 public:
  SequentialLayer(std::string kind, std::vector<std::unique_ptr<Layer>> children)
      : kind_(std::move(kind)), children_(std::move(children)) {}
  absl::string_view kind() const override { return kind_; }
  // This layer when every child has a decoder; its cache has one child per sub-layer.
  IncrementalDecoder* decoder() override;
  absl::Status StartDecode(int64_t capacity, const LayerContext& ctx, DecodeCache* cache) override;
  absl::StatusOr<Tensor> Decode(const Tensor& x, const LayerContext& ctx,
                                DecodeCache* cache) override;
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;
  // Each child's weight gradient right after its input gradient (Note [Backward by layer]).
  absl::StatusOr<Tensor> Backward(const Tensor& dy, const LayerContext& ctx, Saved* saved) override;
  std::vector<Parameter*> Parameters() override;
  std::vector<std::vector<Parameter*>> ParameterGroups() override;
  // Forward plus a residual added to the last child's output (LinearLayer::ForwardWithResidual
  // when that child is a Linear layer).
  absl::StatusOr<Tensor> ForwardWithResidual(const Tensor& x, const Tensor& residual,
                                             const LayerContext& ctx, Saved* saved);

 private:
  // BackwardInput, or with `weights` Backward, of the children in reverse order.
  absl::StatusOr<Tensor> BackwardChildren(const Tensor& dy, const LayerContext& ctx, Saved* saved,
                                          bool weights);
  std::string kind_;
  std::vector<std::unique_ptr<Layer>> children_;
};

// The attention core: qkv [B, T, 3C] -> [B, T, C], no parameters.
class AttentionCoreLayer final : public Layer, public IncrementalDecoder {
 public:
  AttentionCoreLayer(int64_t dim, int64_t heads) : dim_(dim), heads_(heads) {}
  absl::string_view kind() const override { return "attention_core"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::Status StartDecode(int64_t capacity, const LayerContext& ctx, DecodeCache* cache) override;
  absl::StatusOr<Tensor> Decode(const Tensor& x, const LayerContext& ctx,
                                DecodeCache* cache) override;
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext&, Saved*) override { return absl::OkStatus(); }

 private:
  int64_t dim_, heads_;
};

// A pre-norm residual block: h = x + attn(norm_1(x)); out = h + mlp(norm_2(h)), where attn and mlp
// are sequences whose first and last children are Linear layers (the GPT and Llama blocks). Its
// Saved has the four sublayers' as children. Under selective recomputation
// (LayerContext::selective_recompute) the inputs of the attention's first product, of the MLP's
// first and of its last product are dropped after the forward and remade in the backward from
// what the norms and the MLP's activation keep anyway (Note [Selective recomputation]).
class PreNormBlockLayer : public Layer, public IncrementalDecoder {
 public:
  // This block when its four sublayers have decoders (the built-in ones do); its cache holds
  // theirs: {norm_1, attn, norm_2, mlp}.
  IncrementalDecoder* decoder() override;
  absl::Status StartDecode(int64_t capacity, const LayerContext& ctx, DecodeCache* cache) override;
  absl::StatusOr<Tensor> Decode(const Tensor& x, const LayerContext& ctx,
                                DecodeCache* cache) override;
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;
  // Each sublayer's weight gradient right after its input gradient (Note [Backward by layer]).
  absl::StatusOr<Tensor> Backward(const Tensor& dy, const LayerContext& ctx, Saved* saved) override;
  std::vector<Parameter*> Parameters() override;
  std::vector<std::vector<Parameter*>> ParameterGroups() override;

 protected:
  PreNormBlockLayer(std::unique_ptr<Layer> norm_1, std::unique_ptr<SequentialLayer> attn,
                    std::unique_ptr<Layer> norm_2, std::unique_ptr<SequentialLayer> mlp)
      : norm_1_(std::move(norm_1)),
        attn_(std::move(attn)),
        norm_2_(std::move(norm_2)),
        mlp_(std::move(mlp)) {}
  // The MLP's activation output (its last product's input) from what the MLP's Saved keeps.
  virtual absl::StatusOr<Tensor> RemakeActivation(const LayerContext& ctx,
                                                  const Saved& mlp) const = 0;
  std::unique_ptr<Layer> norm_1_;
  std::unique_ptr<SequentialLayer> attn_;
  std::unique_ptr<Layer> norm_2_;
  std::unique_ptr<SequentialLayer> mlp_;

 private:
  // BackwardInput, or with `weights` Backward, of the sublayers in reverse order.
  absl::StatusOr<Tensor> BackwardSublayers(const Tensor& dy, const LayerContext& ctx, Saved* saved,
                                           bool weights);
  absl::Status Remake(const LayerContext& ctx, Saved* saved);
};

// Pre-LN GPT-2 block: h = x + attn(ln_1(x)); out = h + mlp(ln_2(h)).
class TransformerBlockLayer final : public PreNormBlockLayer {
 public:
  TransformerBlockLayer(const InitContext& init, int64_t dim, int64_t heads);
  absl::string_view kind() const override { return "transformer_block"; }

 private:
  absl::StatusOr<Tensor> RemakeActivation(const LayerContext& ctx, const Saved& mlp) const override;
};

// ---- The Llama family (runtime/layers/llama.cc; Note [Llama layers] in ops/llama_ops.cc) ----

// y = weight * x / sqrt(mean(x^2) + eps) over the last dimension; weight starts at 1.
class RmsNormLayer final : public Layer, public PositionwiseDecoder<RmsNormLayer> {
 public:
  RmsNormLayer(const InitContext& init, int64_t dim, float eps);
  absl::string_view kind() const override { return "rmsnorm"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;
  std::vector<Parameter*> Parameters() override { return {&weight_}; }

 private:
  int64_t dim_;
  float eps_;
  Parameter weight_;
};

// Tokens [B, T] -> rows of the token table "wte.weight" (no positions: the attention turns its
// queries and keys instead). Vocab-parallel at init.tp_size > 1, as EmbeddingLayer.
class TokenEmbeddingLayer final : public Layer, public PositionwiseDecoder<TokenEmbeddingLayer> {
 public:
  TokenEmbeddingLayer(const InitContext& init, int64_t vocab, int64_t dim);
  absl::string_view kind() const override { return "token_embedding"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override;
  std::vector<Parameter*> Parameters() override { return {&wte_}; }

 private:
  int64_t vocab_, dim_;
  int tp_rank_ = 0, tp_size_ = 1;
  Parameter wte_;
};

// Grouped-query attention with rotary positions: (q | k | v) [B, T, C + 2 kv_heads D] -> [B, T, C],
// no parameters.
class RotaryAttentionLayer final : public Layer, public IncrementalDecoder {
 public:
  RotaryAttentionLayer(int64_t dim, int64_t heads, int64_t kv_heads, double theta)
      : dim_(dim), heads_(heads), kv_heads_(kv_heads), theta_(theta) {}
  absl::string_view kind() const override { return "rotary_attention"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::Status StartDecode(int64_t capacity, const LayerContext& ctx, DecodeCache* cache) override;
  absl::StatusOr<Tensor> Decode(const Tensor& x, const LayerContext& ctx,
                                DecodeCache* cache) override;
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext&, Saved*) override { return absl::OkStatus(); }

 private:
  int64_t dim_, heads_, kv_heads_;
  double theta_;
};

// (g | u) [..., 2F] -> silu(g) * u [..., F], no parameters.
class SwiGluLayer final : public Layer, public PositionwiseDecoder<SwiGluLayer> {
 public:
  explicit SwiGluLayer(int64_t ffn) : ffn_(ffn) {}
  absl::string_view kind() const override { return "swiglu"; }
  IncrementalDecoder* decoder() override { return this; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override;
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override;
  absl::Status BackwardWeight(const LayerContext&, Saved*) override { return absl::OkStatus(); }

 private:
  int64_t ffn_;
};

struct LlamaBlockShape {
  int64_t dim = 0, heads = 0, kv_heads = 0, ffn = 0;
  double rope_theta = 10000;
  float eps = 1e-5f;
};

// h = x + o_proj(attn(qkv(norm_1(x)))); out = h + down(swiglu(gate_up(norm_2(h)))), every
// product without bias; parameter names as transformers' LlamaDecoderLayer's, q/k/v and
// gate/up fused (self_attn.qkv, mlp.gate_up).
class LlamaBlockLayer final : public PreNormBlockLayer {
 public:
  // Tensor-parallel at init.tp_size > 1 (CheckSplit says first whether the size splits it:
  // InvalidArgument naming the layer).
  LlamaBlockLayer(const InitContext& init, const LlamaBlockShape& shape);
  static absl::Status CheckSplit(const InitContext& init, const LlamaBlockShape& shape);
  absl::string_view kind() const override { return "llama_block"; }

 private:
  absl::StatusOr<Tensor> RemakeActivation(const LayerContext& ctx, const Saved& mlp) const override;
};

// A composite layer's pass over one child (Note [Backward by layer]): its Backward (both halves)
// when `weights`, else its BackwardInput only.
absl::StatusOr<Tensor> ChildBackward(Layer& child, const Tensor& dy, const LayerContext& ctx,
                                     Saved* saved, bool weights);

// The MLP and the attention of a GPT block, tensor-parallel at init.tp_size > 1 (the Check
// functions say first whether the size splits them: InvalidArgument naming the layer).
absl::Status CheckMlpSplit(const InitContext& init, int64_t dim, int64_t hidden);
absl::Status CheckAttentionSplit(const InitContext& init, int64_t dim, int64_t heads);
std::unique_ptr<SequentialLayer> MakeMlp(const InitContext& init, int64_t dim, int64_t hidden);
std::unique_ptr<SequentialLayer> MakeAttention(const InitContext& init, int64_t dim, int64_t heads);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_LAYERS_LAYERS_INTERNAL_H_
