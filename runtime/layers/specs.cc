// LayerSpecs: configuration, analytic cost per micro-batch, and factories for built-in layers.
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/tensor_parallel.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright {
namespace {

constexpr int64_t kF32 = 4;

Cost LinearCost(int64_t n, int64_t in, int64_t out, bool bias) {
  Cost c;
  c.params = in * out + (bias ? out : 0);
  c.forward_flops = 2.0 * n * in * out;
  c.backward_flops = 4.0 * n * in * out;
  c.activation_bytes = n * in * kF32;
  c.output_bytes = n * out * kF32;
  return c;
}
Cost GeluCost(int64_t n, int64_t dim) {
  Cost c;
  c.forward_flops = 10.0 * n * dim;
  c.backward_flops = 14.0 * n * dim;
  c.activation_bytes = n * dim * kF32;
  c.output_bytes = n * dim * kF32;
  return c;
}
Cost LayerNormCost(int64_t n, int64_t dim) {
  Cost c;
  c.params = 2 * dim;
  c.forward_flops = 8.0 * n * dim;
  c.backward_flops = 14.0 * n * dim;
  c.activation_bytes = (n * dim + 2 * n) * kF32;
  c.output_bytes = n * dim * kF32;
  return c;
}
Cost AttentionCoreCost(const MicroBatchShape& s, int64_t dim, int64_t heads) {
  Cost c;
  double b = s.batch, t = s.seq_len;
  c.forward_flops = 4.0 * b * t * t * dim + 5.0 * b * heads * t * t;
  c.backward_flops = 8.0 * b * t * t * dim + 8.0 * b * heads * t * t;
  // Saved for the backward: qkv and the row log-sum-exp [B, H, T] (the kernels recompute the
  // probabilities; the output it also keeps is the next Linear's saved input, counted there).
  c.activation_bytes = (s.tokens() * 3 * dim + s.batch * heads * s.seq_len) * kF32;
  c.output_bytes = s.tokens() * dim * kF32;
  return c;
}
Cost MlpCost(int64_t n, int64_t dim, int64_t hidden) {
  Cost c = LinearCost(n, dim, hidden, true);
  c += GeluCost(n, hidden);
  c += LinearCost(n, hidden, dim, true);
  return c;
}
Cost AttentionCost(const MicroBatchShape& s, int64_t dim, int64_t heads) {
  Cost c = LinearCost(s.tokens(), dim, 3 * dim, true);
  c += AttentionCoreCost(s, dim, heads);
  c += LinearCost(s.tokens(), dim, dim, true);
  return c;
}

using ShapeFn = std::function<std::vector<int64_t>(const std::vector<int64_t>&)>;

template <typename Fn>
class SimpleSpec final : public LayerSpec {
 public:
  SimpleSpec(std::string kind, std::string config,
             std::function<Cost(const MicroBatchShape&, int64_t)> cost, Fn make, ShapeFn shape,
             std::string tied_to, std::string tied_parameter)
      : kind_(std::move(kind)),
        config_(std::move(config)),
        cost_(std::move(cost)),
        make_(std::move(make)),
        shape_(std::move(shape)),
        tied_to_(std::move(tied_to)),
        tied_parameter_(std::move(tied_parameter)) {}
  std::string kind() const override { return kind_; }
  Cost GetCost(const MicroBatchShape& shape, int64_t input_bytes) const override {
    return cost_(shape, input_bytes);
  }
  std::string Config() const override { return config_; }
  absl::StatusOr<std::unique_ptr<Layer>> Create(const InitContext& init) const override {
    return make_(init);
  }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& input) const override {
    return shape_ ? shape_(input) : input;
  }
  std::string tied_to() const override { return tied_to_; }
  std::string tied_parameter() const override { return tied_parameter_; }

 private:
  std::string kind_, config_;
  std::function<Cost(const MicroBatchShape&, int64_t)> cost_;
  Fn make_;
  ShapeFn shape_;  // empty: the output keeps the input's shape
  std::string tied_to_, tied_parameter_;
};

template <typename Fn>
LayerSpecPtr MakeSpec(std::string kind, std::string config,
                      std::function<Cost(const MicroBatchShape&, int64_t)> cost, Fn make,
                      ShapeFn shape = nullptr, std::string tied_to = "",
                      std::string tied_parameter = "") {
  return std::make_shared<SimpleSpec<Fn>>(std::move(kind), std::move(config), std::move(cost),
                                          std::move(make), std::move(shape), std::move(tied_to),
                                          std::move(tied_parameter));
}

// Output shape of a layer that maps the last dimension to `last` ([B, T, in] -> [B, T, last]).
ShapeFn LastDimShape(int64_t last) {
  return [last](const std::vector<int64_t>& input) {
    return input.empty() ? input : internal::WithLastDim(input, last);
  };
}

}  // namespace

namespace layers {

LayerSpecPtr Linear(int64_t in, int64_t out, bool bias) {
  PW_CHECK(in > 0 && out > 0);
  return MakeSpec(
      "linear", absl::StrFormat("in=%d,out=%d,bias=%d", in, out, bias ? 1 : 0),
      [=](const MicroBatchShape& s, int64_t) { return LinearCost(s.tokens(), in, out, bias); },
      [=](const InitContext& init) -> std::unique_ptr<Layer> {
        return std::make_unique<internal::LinearLayer>(init, in, out, bias, 0.02f);
      },
      LastDimShape(out));
}

LayerSpecPtr Gelu() {
  return MakeSpec(
      "gelu", "",
      [](const MicroBatchShape&, int64_t in_bytes) { return GeluCost(in_bytes / kF32, 1); },
      [](const InitContext&) -> std::unique_ptr<Layer> {
        return std::make_unique<internal::GeluLayer>();
      });
}

LayerSpecPtr LayerNorm(int64_t dim, float eps) {
  PW_CHECK(dim > 0);
  return MakeSpec(
      "layernorm", absl::StrFormat("dim=%d,eps=%g", dim, eps),
      [=](const MicroBatchShape& s, int64_t) { return LayerNormCost(s.tokens(), dim); },
      [=](const InitContext& init) -> std::unique_ptr<Layer> {
        return std::make_unique<internal::LayerNormLayer>(init, dim, eps);
      });
}

LayerSpecPtr Mlp(int64_t dim, int64_t hidden) {
  PW_CHECK(dim > 0 && hidden > 0);
  return MakeSpec(
      "mlp", absl::StrFormat("dim=%d,hidden=%d", dim, hidden),
      [=](const MicroBatchShape& s, int64_t) { return MlpCost(s.tokens(), dim, hidden); },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        PW_RETURN_IF_ERROR(internal::CheckMlpSplit(init, dim, hidden));
        return internal::MakeMlp(init, dim, hidden);
      });
}

LayerSpecPtr CausalSelfAttention(int64_t dim, int64_t heads) {
  PW_CHECK(dim > 0 && heads > 0 && dim % heads == 0);
  return MakeSpec(
      "causal_self_attention", absl::StrFormat("dim=%d,heads=%d", dim, heads),
      [=](const MicroBatchShape& s, int64_t) { return AttentionCost(s, dim, heads); },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        PW_RETURN_IF_ERROR(internal::CheckAttentionSplit(init, dim, heads));
        return internal::MakeAttention(init, dim, heads);
      });
}

LayerSpecPtr TransformerBlock(int64_t dim, int64_t heads) {
  PW_CHECK(dim > 0 && heads > 0 && dim % heads == 0);
  return MakeSpec(
      "transformer_block", absl::StrFormat("dim=%d,heads=%d", dim, heads),
      [=](const MicroBatchShape& s, int64_t) {
        int64_t n = s.tokens();
        Cost c = LayerNormCost(n, dim);
        c += AttentionCost(s, dim, heads);
        c += LayerNormCost(n, dim);
        c += MlpCost(n, dim, 4 * dim);
        c.forward_flops += 2.0 * n * dim;  // the two residual adds
        c.backward_flops += 2.0 * n * dim;
        // Recompute::kSelective: the LayerNorm and GELU outputs (the qkv, fc and MLP projection
        // inputs) are remade in the backward from what their own backward keeps anyway.
        c.selective_saving_bytes = (2 * n * dim + n * 4 * dim) * kF32;
        c.selective_recompute_flops =
            2 * LayerNormCost(n, dim).forward_flops + GeluCost(n, 4 * dim).forward_flops;
        return c;
      },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        PW_RETURN_IF_ERROR(internal::CheckAttentionSplit(init, dim, heads));
        PW_RETURN_IF_ERROR(internal::CheckMlpSplit(init, dim, 4 * dim));
        return std::make_unique<internal::TransformerBlockLayer>(init, dim, heads);
      });
}

LayerSpecPtr Embedding(int64_t vocab, int64_t max_seq, int64_t dim) {
  PW_CHECK(vocab > 0 && max_seq > 0 && dim > 0);
  return MakeSpec(
      "embedding", absl::StrFormat("vocab=%d,max_seq=%d,dim=%d", vocab, max_seq, dim),
      [=](const MicroBatchShape& s, int64_t) {
        Cost c;
        c.params = (vocab + max_seq) * dim;
        c.forward_flops = 1.0 * s.tokens() * dim;
        c.backward_flops = 2.0 * s.tokens() * dim;
        c.activation_bytes = s.tokens() * 4;
        c.output_bytes = s.tokens() * dim * kF32;
        return c;
      },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        PW_RETURN_IF_ERROR(ShardOf(init, {vocab, dim}, 0, 1, init.name).status());
        return std::make_unique<internal::EmbeddingLayer>(init, vocab, max_seq, dim);
      },
      [=](const std::vector<int64_t>& tokens) {  // [B, T] -> [B, T, dim]
        std::vector<int64_t> out = tokens;
        out.push_back(dim);
        return out;
      });
}

LayerSpecPtr LmHead(int64_t dim, int64_t vocab, const std::string& tied_to) {
  PW_CHECK(dim > 0 && vocab > 0);
  // A tied head's weight is the embedding's token table, initialised from its name with the
  // embedding's std (0.02), so a copy on another stage starts equal to it.
  const std::string weight = tied_to.empty() ? "" : absl::StrCat(tied_to, ".wte.weight");
  std::string config = absl::StrFormat("dim=%d,vocab=%d", dim, vocab);
  if (!tied_to.empty()) absl::StrAppend(&config, ",tied_to=", tied_to);
  return MakeSpec(
      "lm_head", std::move(config),
      [=](const MicroBatchShape& s, int64_t) { return LinearCost(s.tokens(), dim, vocab, false); },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        // Tensor-parallel: column-parallel over the vocabulary, its part of the logits to a
        // vocab-parallel loss (Note [Tensor parallelism] in pipewright/tensor_parallel.h).
        constexpr auto kColumn = internal::LinearLayer::Parallel::kColumn;
        PW_RETURN_IF_ERROR(
            internal::LinearLayer::CheckSplit(init, dim, vocab, kColumn, {}, init.name));
        return std::make_unique<internal::LinearLayer>(init, dim, vocab, false, 0.02f,
                                                       internal::LinearLayer::Activation::kNone,
                                                       weight, kColumn);
      },
      LastDimShape(vocab), tied_to, weight);
}

// ---- The Llama family (runtime/layers/llama.cc) ----
namespace {

Cost RmsNormCost(int64_t n, int64_t dim) {
  Cost c;
  c.params = dim;
  c.forward_flops = 4.0 * n * dim;
  c.backward_flops = 8.0 * n * dim;
  c.activation_bytes = (n * dim + n) * kF32;
  c.output_bytes = n * dim * kF32;
  return c;
}

}  // namespace

LayerSpecPtr RmsNorm(int64_t dim, float eps) {
  PW_CHECK(dim > 0 && eps > 0);
  return MakeSpec(
      "rmsnorm", absl::StrFormat("dim=%d,eps=%g", dim, eps),
      [=](const MicroBatchShape& s, int64_t) { return RmsNormCost(s.tokens(), dim); },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        return std::make_unique<internal::RmsNormLayer>(init, dim, eps);
      });
}

LayerSpecPtr TokenEmbedding(int64_t vocab, int64_t dim) {
  PW_CHECK(vocab > 0 && dim > 0);
  return MakeSpec(
      "token_embedding", absl::StrFormat("vocab=%d,dim=%d", vocab, dim),
      [=](const MicroBatchShape& s, int64_t) {
        Cost c;
        c.params = vocab * dim;
        c.forward_flops = 1.0 * s.tokens() * dim;
        c.backward_flops = 1.0 * s.tokens() * dim;
        c.activation_bytes = s.tokens() * 4;
        c.output_bytes = s.tokens() * dim * kF32;
        return c;
      },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        PW_RETURN_IF_ERROR(ShardOf(init, {vocab, dim}, 0, 1, init.name).status());
        return std::make_unique<internal::TokenEmbeddingLayer>(init, vocab, dim);
      },
      [=](const std::vector<int64_t>& tokens) {  // [B, T] -> [B, T, dim]
        std::vector<int64_t> out = tokens;
        out.push_back(dim);
        return out;
      });
}

LayerSpecPtr LlamaBlock(int64_t dim, int64_t heads, int64_t kv_heads, int64_t ffn,
                        double rope_theta, float eps) {
  PW_CHECK(dim > 0 && heads > 0 && kv_heads > 0 && ffn > 0 && dim % heads == 0 &&
           heads % kv_heads == 0 && (dim / heads) % 2 == 0 && rope_theta > 0 && eps > 0);
  return MakeSpec(
      "llama_block",
      absl::StrFormat("dim=%d,heads=%d,kv_heads=%d,ffn=%d,rope_theta=%g,eps=%g", dim, heads,
                      kv_heads, ffn, rope_theta, eps),
      [=](const MicroBatchShape& s, int64_t) {
        const int64_t n = s.tokens(), kv = kv_heads * (dim / heads);
        Cost c = RmsNormCost(n, dim);
        c += LinearCost(n, dim, dim + 2 * kv, false);
        Cost core = AttentionCoreCost(s, dim, heads);
        core.forward_flops += 6.0 * n * 2 * dim;  // the rotary turns of q and the keys
        core.backward_flops += 6.0 * n * 2 * dim + 2.0 * n * dim;
        c += core;
        c += LinearCost(n, dim, dim, false);
        c += RmsNormCost(n, dim);
        c += LinearCost(n, dim, 2 * ffn, false);
        Cost glu;
        glu.forward_flops = 6.0 * n * ffn;
        glu.backward_flops = 12.0 * n * ffn;
        glu.activation_bytes = n * 2 * ffn * kF32;
        glu.output_bytes = n * ffn * kF32;
        c += glu;
        c += LinearCost(n, ffn, dim, false);
        c.forward_flops += 2.0 * n * dim;  // the two residual adds
        c.backward_flops += 2.0 * n * dim;
        // Recompute::kSelective: the two RMSNorm outputs and the SwiGLU output (the qkv, gate_up
        // and down_proj inputs), remade from what the norms and the SwiGLU keep anyway.
        c.selective_saving_bytes = (2 * n * dim + n * ffn) * kF32;
        c.selective_recompute_flops = 2 * RmsNormCost(n, dim).forward_flops + glu.forward_flops;
        return c;
      },
      [=](const InitContext& init) -> absl::StatusOr<std::unique_ptr<Layer>> {
        const internal::LlamaBlockShape shape{dim, heads, kv_heads, ffn, rope_theta, eps};
        PW_RETURN_IF_ERROR(internal::LlamaBlockLayer::CheckSplit(init, shape));
        return std::make_unique<internal::LlamaBlockLayer>(init, shape);
      });
}

LayerSpecPtr CrossEntropyLoss() {
  return MakeSpec(
      "cross_entropy", "",
      [](const MicroBatchShape& s, int64_t in_bytes) {
        Cost c;
        double logits = static_cast<double>(in_bytes) / kF32;
        c.forward_flops = 5.0 * logits;
        c.backward_flops = 3.0 * logits;
        c.activation_bytes = in_bytes + s.tokens() * 4;
        c.output_bytes = kF32;
        return c;
      },
      [](const InitContext& init) -> std::unique_ptr<Layer> {
        return std::make_unique<internal::CrossEntropyLayer>(init);
      },
      [](const std::vector<int64_t>&) { return std::vector<int64_t>{1}; });
}

LayerSpecPtr Delay(int64_t dim, double forward_s, double backward_input_s,
                   double backward_weight_s) {
  PW_CHECK(dim > 0 && forward_s >= 0 && backward_input_s >= 0 && backward_weight_s >= 0);
  return MakeSpec(
      "delay",
      absl::StrFormat("dim=%d,f=%g,b=%g,w=%g", dim, forward_s, backward_input_s, backward_weight_s),
      [=](const MicroBatchShape& s, int64_t) {
        Cost c;
        c.output_bytes = s.tokens() * dim * kF32;
        return c;
      },
      [=](const InitContext&) -> std::unique_ptr<Layer> {
        return std::make_unique<internal::DelayLayer>(dim, forward_s, backward_input_s,
                                                      backward_weight_s);
      });
}

}  // namespace layers
}  // namespace pipewright
