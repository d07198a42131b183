#include "pipewright/model.h"

#include <set>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "pipewright/ops.h"
#include "runtime/sha256.h"

namespace pipewright {

Stage::Stage(int begin, std::vector<std::string> names, std::vector<std::unique_ptr<Layer>> layers)
    : begin_(begin), names_(std::move(names)), layers_(std::move(layers)) {}

// Note [Tied parameters]. A tied LM head (layers::LmHead(..., tied_to)) uses the embedding's
// token table as its weight. Its Parameter is a copy naming its owner (Parameter::tied_to) with
// a gradient of its own:
//  - owner and copy on one rank (one stage, or the first and last stage of a V schedule): the
//    copy shares the owner's value tensor (LinkTiedParameters) and is not trained; one tensor,
//    one optimizer state, plus the copy's gradient buffer.
//  - on two ranks: each holds the weight, trained alike from equal starting values; the
//    embedding group (the two ranks of a replica) all-reduces the two gradients.
// Either way the gradients accumulate apart over the micro-batches (the head's backward and the
// embedding's interleave differently at different depths), each is reduced over the replicas by
// the gradient synchronization, and then owner + copy is formed — a single addition, which is
// commutative, so every rank and every depth gets the same bits (pp = k is bit-identical to
// pp = 1). The copy is not counted again in the gradient norm (GradSquaredNorm skips it) and a
// checkpoint stores the owner only; a copy loads its owner's value and optimizer state.
absl::StatusOr<std::vector<TiedLink>> LinkTiedParameters(const std::vector<Parameter*>& params) {
  std::vector<TiedLink> links;
  for (Parameter* c : params) {
    if (c->tied_to.empty()) continue;
    Parameter* owner = nullptr;
    for (Parameter* o : params) {
      if (o->tied_to.empty() && o->name == c->tied_to) owner = o;
    }
    if (owner == nullptr) continue;
    if (owner->value.shape() != c->value.shape() || owner->value.dtype() != c->value.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          c->name, " is tied to ", owner->name, ", but has shape ", c->value.ShapeString(),
          " where ", owner->name, " has ", owner->value.ShapeString()));
    }
    c->value = owner->value;
    links.push_back({c, owner});
  }
  return links;
}

absl::Status AddTiedGradients(const std::vector<TiedLink>& links, Allocator* exec) {
  for (const TiedLink& l : links) {
    PW_RETURN_IF_ERROR(ops::AddInPlace(ops::Exec{exec}, l.owner->grad, l.copy->grad));
    l.copy->grad.SetZero();
  }
  return absl::OkStatus();
}

std::vector<Parameter*> Stage::Parameters() {
  std::vector<Parameter*> out;
  for (auto& l : layers_) {
    for (Parameter* p : l->Parameters()) {
      bool linked = false;
      for (const TiedLink& t : tied_) linked = linked || t.copy == p;
      if (!linked) out.push_back(p);
    }
  }
  return out;
}

absl::Status Stage::LinkTied() {
  std::vector<Parameter*> all;
  for (auto& l : layers_) {
    for (Parameter* p : l->Parameters()) all.push_back(p);
  }
  PW_ASSIGN_OR_RETURN(tied_, LinkTiedParameters(all));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Stage::Forward(const Tensor& x, const LayerContext& ctx,
                                      std::vector<Saved>* saved) {
  saved->assign(layers_.size(), Saved{});
  Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto r = layers_[i]->Forward(h, ctx, &(*saved)[i]);
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat("layer ", begin_ + i, " (", names_[i],
                                                          ") forward: ", r.status().message()));
    }
    h = *std::move(r);
  }
  return h;
}

absl::StatusOr<Tensor> Stage::BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                            std::vector<Saved>* saved) {
  if (saved->size() != layers_.size()) {
    return absl::FailedPreconditionError("stage backward without a saved forward");
  }
  Tensor g = dy;
  for (size_t i = layers_.size(); i-- > 0;) {
    auto r = layers_[i]->BackwardInput(g, ctx, &(*saved)[i]);
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat("layer ", begin_ + i, " (", names_[i],
                                                          ") backward: ", r.status().message()));
    }
    g = *std::move(r);
  }
  return g;
}

absl::Status Stage::BackwardWeight(const LayerContext& ctx, std::vector<Saved>* saved) {
  if (saved->size() != layers_.size()) {
    return absl::FailedPreconditionError("stage weight backward without a saved forward");
  }
  for (size_t i = layers_.size(); i-- > 0;) {
    absl::Status s = layers_[i]->BackwardWeight(ctx, &(*saved)[i]);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("layer ", begin_ + i, " (", names_[i],
                                                 ") weight backward: ", s.message()));
    }
  }
  saved->clear();
  return absl::OkStatus();
}

Cost LayerGraph::TotalCost() const {
  Cost total;
  for (const LayerNode& n : nodes_) total += n.cost;
  return total;
}

absl::StatusOr<std::unique_ptr<Stage>> LayerGraph::Instantiate(int begin, int end, uint64_t seed,
                                                               Allocator* allocator, int tp_rank,
                                                               int tp_size) const {
  if (begin < 0 || end > num_layers() || begin >= end) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer range [%d, %d) is empty or outside the model's %d layers", begin,
                        end, num_layers()));
  }
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor-parallel rank %d of %d: the rank must be in [0, size)", tp_rank, tp_size));
  }
  std::vector<std::string> names;
  std::vector<std::unique_ptr<Layer>> built;
  for (int i = begin; i < end; ++i) {
    InitContext init;
    init.seed = seed;
    init.layer_index = i;
    init.name = nodes_[i].name;
    init.num_blocks = num_blocks_;
    init.allocator = allocator;
    init.tp_rank = tp_rank;
    init.tp_size = tp_size;
    PW_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer, nodes_[i].spec->Create(init));
    names.push_back(nodes_[i].name);
    built.push_back(std::move(layer));
  }
  auto stage = std::make_unique<Stage>(begin, std::move(names), std::move(built));
  PW_RETURN_IF_ERROR(stage->LinkTied());
  return stage;
}

std::string LayerGraph::Fingerprint() const {
  // The micro-batch size is not part of it: a plan or checkpoint of the same model at another
  // micro-batch size still matches.
  std::string text = absl::StrCat(name_, "|s=", shape_.seq_len);
  for (const LayerNode& n : nodes_) {
    absl::StrAppend(&text, "|", n.name, ":", n.spec->kind(), "(", n.spec->Config(), ")");
  }
  return absl::StrCat("sha256:", Sha256Hex(text));
}

namespace {

// The value of `key` in a spec's "key=value,..." configuration, or "".
std::string ConfigValue(const std::string& config, absl::string_view key) {
  for (absl::string_view kv : absl::StrSplit(config, ',')) {
    std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first == key) return std::string(p.second);
  }
  return "";
}

// A tied layer names an earlier Embedding or TokenEmbedding node of its own vocabulary and width.
absl::Status CheckTie(const std::vector<LayerNode>& earlier, size_t i, const std::string& name,
                      const LayerSpec& spec, const std::string& tied_to) {
  for (const LayerNode& n : earlier) {
    if (n.name != tied_to) continue;
    if (n.spec->kind() != "embedding" && n.spec->kind() != "token_embedding") {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "] (", name, "): tied_to '",
                                                     tied_to, "' is a ", n.spec->kind(),
                                                     " node; it must name an embedding"));
    }
    const std::string a = spec.Config(), b = n.spec->Config();
    for (absl::string_view key : {"vocab", "dim"}) {
      if (ConfigValue(a, key) != ConfigValue(b, key)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layers[", i, "] (", name, "): tied to '", tied_to, "' but its ", key, " is ",
            ConfigValue(a, key), " where the embedding's is ", ConfigValue(b, key)));
      }
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("layers[", i, "] (", name, "): tied_to '", tied_to, "' names no earlier layer"));
}

}  // namespace

ModelBuilder::ModelBuilder(std::string name, MicroBatchShape shape)
    : name_(std::move(name)), shape_(shape) {}

ModelBuilder& ModelBuilder::Add(std::string name, LayerSpecPtr spec) {
  nodes_.emplace_back(std::move(name), std::move(spec));
  return *this;
}

absl::StatusOr<LayerGraph> ModelBuilder::Build() const {
  if (nodes_.empty())
    return absl::InvalidArgumentError(absl::StrCat("model '", name_, "' has no layers"));
  if (shape_.batch < 1 || shape_.seq_len < 1) {
    return absl::InvalidArgumentError("micro-batch size and sequence length must be >= 1");
  }
  LayerGraph g;
  g.name_ = name_;
  g.shape_ = shape_;
  std::set<std::string> seen;
  int blocks = 0;
  int64_t input_bytes = shape_.tokens() * 4;  // i32 tokens
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const auto& [name, spec] = nodes_[i];
    if (name.empty())
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "]: empty name"));
    if (spec == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "] (", name, "): no spec"));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", i, "]: duplicate layer name '", name, "'"));
    }
    if (const std::string t = spec->tied_to(); !t.empty()) {
      PW_RETURN_IF_ERROR(CheckTie(g.nodes_, i, name, *spec, t));
    }
    LayerNode node{name, spec, spec->GetCost(shape_, input_bytes)};
    input_bytes = node.cost.output_bytes;
    if (spec->kind() == "transformer_block") ++blocks;
    g.nodes_.push_back(std::move(node));
  }
  g.num_blocks_ = std::max(1, blocks);
  return g;
}

absl::StatusOr<LayerGraph> GptModel(const std::string& name, const GptConfig& c,
                                    int64_t micro_batch_size) {
  // Before building anything: a refused config allocates nothing (a million layer nodes would).
  PW_RETURN_IF_ERROR(CheckGptConfig(c, absl::StrCat("GPT model '", name, "'"), micro_batch_size));
  ModelBuilder b(name, {micro_batch_size, c.seq});
  b.Add("embed", layers::Embedding(c.vocab, c.seq, c.hidden));
  for (int64_t i = 0; i < c.layers; ++i) {
    b.Add(absl::StrCat("blocks.", i), layers::TransformerBlock(c.hidden, c.heads));
  }
  b.Add("ln_f", layers::LayerNorm(c.hidden));
  b.Add("lm_head", layers::LmHead(c.hidden, c.vocab, c.tied ? "embed" : ""));
  b.Add("loss", layers::CrossEntropyLoss());
  return b.Build();
}

ModelCosts ToModelCosts(const LayerGraph& graph) {
  ModelCosts m;
  m.name = graph.name();
  m.fingerprint = graph.Fingerprint();
  m.micro_batch_size = graph.shape().batch;
  m.seq_len = graph.shape().seq_len;
  m.input_bytes = graph.shape().tokens() * 4;  // i32 tokens
  for (const LayerNode& n : graph.nodes()) {
    LayerCost c;
    c.name = n.name;
    c.kind = n.spec->kind();
    c.params = n.cost.params;
    c.forward_flops = n.cost.forward_flops;
    c.backward_flops = n.cost.backward_flops;
    c.activation_bytes = n.cost.activation_bytes;
    c.output_bytes = n.cost.output_bytes;
    c.selective_saving_bytes = n.cost.selective_saving_bytes;
    c.selective_recompute_flops = n.cost.selective_recompute_flops;
    c.largest_group_params = n.cost.largest_group_params;
    c.tied_to = n.spec->tied_to();
    m.layers.push_back(std::move(c));
  }
  // A GPT's or a Llama's shape, which tensor parallelism splits (the planner's TransformerShape).
  if (absl::StatusOr<GptConfig> gpt = GptConfigOf(graph); gpt.ok()) {
    m.transformer = TransformerShape{gpt->hidden, gpt->heads, 4 * gpt->hidden, gpt->vocab};
  } else if (absl::StatusOr<LlamaConfig> llama = LlamaConfigOf(graph); llama.ok()) {
    m.transformer =
        TransformerShape{llama->hidden, llama->heads, llama->ffn, llama->vocab, llama->kv_heads};
  }
  return m;
}

namespace {

struct GptPreset {
  const char* name;
  GptConfig config;
  int64_t default_micro_batch_size;
};

// gpt-tiny and gpt-small keep an untied head (their losses are the project's reference numbers);
// gpt2-124m is GPT-2's real tied model. The analytic ones are the published models: GPT-3 175B
// (Brown et al. 2020) and the weak-scaling series of Narayanan et al. 2021 ("Efficient
// Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), Table 1, whose
// published sizes (1.7B ... 1008.0B) are 12lh^2 + 13lh + (V + s)h with a tied head.
constexpr int64_t kPaperSeq = 2048, kPaperVocab = 51200;
constexpr GptConfig Paper(int64_t heads, int64_t hidden, int64_t layers) {
  return {.layers = layers,
          .hidden = hidden,
          .heads = heads,
          .seq = kPaperSeq,
          .vocab = kPaperVocab,
          .tied = true};
}
const GptPreset kGptPresets[] = {
    {"gpt-tiny", {.layers = 4, .hidden = 64, .heads = 4, .seq = 32, .vocab = 256}, 8},
    {"gpt-small", {.layers = 6, .hidden = 256, .heads = 8, .seq = 128, .vocab = 256}, 8},
    // GPT-2 small (Radford et al. 2019): 124M parameters, the LM head tied to the token
    // embedding. The vocabulary is padded to a multiple of 128 (50257 -> 50304) as nanoGPT and
    // Megatron do; byte-level data uses only the first 256 rows. Sized for GPU runs
    // (scripts/gpu-check); trainable on the CPU but slow.
    {"gpt2-124m",
     {.layers = 12, .hidden = 768, .heads = 12, .seq = 1024, .vocab = 50304, .tied = true},
     8},
    {"gpt3-175b", Paper(96, 12288, 96), 1},
    {"megatron-1.7b", Paper(24, 2304, 24), 1},
    {"megatron-3.6b", Paper(32, 3072, 30), 1},
    {"megatron-7.5b", Paper(32, 4096, 36), 1},
    {"megatron-18.4b", Paper(48, 6144, 40), 1},
    {"megatron-39.1b", Paper(64, 8192, 48), 1},
    {"megatron-76.1b", Paper(80, 10240, 60), 1},
    {"megatron-145.6b", Paper(96, 12288, 80), 1},
    {"megatron-310.1b", Paper(128, 16384, 96), 1},
    {"megatron-529.6b", Paper(128, 20480, 105), 1},
    {"megatron-1t", Paper(160, 25600, 128), 1},
};

struct LlamaPreset {
  const char* name;
  LlamaConfig config;
  int64_t default_micro_batch_size;
};
constexpr LlamaConfig Llama3(int64_t layers, int64_t hidden, int64_t heads, int64_t ffn) {
  return {.layers = layers,
          .hidden = hidden,
          .heads = heads,
          .kv_heads = 8,
          .ffn = ffn,
          .seq = 8192,
          .vocab = 128256,
          .tied = false,
          .rope_theta = 500000};
}
const LlamaPreset kLlamaPresets[] = {
    {"llama-tiny", LlamaConfig{}, 8},
    {"smollm2-135m",
     {.layers = 30,
      .hidden = 576,
      .heads = 9,
      .kv_heads = 3,
      .ffn = 1536,
      .seq = 2048,
      .vocab = 49152,
      .tied = true,
      .rope_theta = 100000},
     1},
    {"llama3-8b", Llama3(32, 4096, 32, 14336), 1},
    {"llama3-70b", Llama3(80, 8192, 64, 28672), 1},
    {"llama3-405b", Llama3(126, 16384, 128, 53248), 1},
};

const LlamaPreset* FindLlamaPreset(absl::string_view name) {
  for (const LlamaPreset& p : kLlamaPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

const GptPreset* FindGptPreset(absl::string_view name) {
  for (const GptPreset& p : kGptPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

absl::Status UnknownPreset(absl::string_view preset) {
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown preset '", preset, "' (known: ", absl::StrJoin(PresetNames(), ", "), ")"));
}

// Note [GPT limits]. Every GptConfig is checked by CheckGptConfig before a graph is built
// (GptModel calls it): each field in its range (model.h), and the counts the cost model keeps in
// int64 computed here exactly, with overflow checks, for the micro-batch size: the parameters'
// bytes (18 per parameter, the most the partitioner counts), the activations all blocks save
// for the backward and the logits' bytes. A config whose counts would overflow is refused by
// name instead of wrapping around.

// int64 arithmetic that remembers an overflow.
class CheckedInt {
 public:
  explicit CheckedInt(int64_t v) : v_(v) {}
  CheckedInt operator*(CheckedInt o) const {
    CheckedInt r(0);
    r.overflow_ = overflow_ || o.overflow_ || __builtin_mul_overflow(v_, o.v_, &r.v_);
    return r;
  }
  CheckedInt operator+(CheckedInt o) const {
    CheckedInt r(0);
    r.overflow_ = overflow_ || o.overflow_ || __builtin_add_overflow(v_, o.v_, &r.v_);
    return r;
  }
  bool overflow() const { return overflow_; }

 private:
  int64_t v_;
  bool overflow_ = false;
};

// InvalidArgument naming the first (name, value, max) whose value is outside [1, max].
template <size_t N>
absl::Status CheckFieldRanges(absl::string_view context,
                              const std::tuple<const char*, int64_t, int64_t> (&fields)[N]) {
  for (const auto& [name, v, max] : fields) {
    if (v < 1 || v > max) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": ", name, "=", v, " is out of range [1, ", max, "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names = {"mlp"};
  for (const GptPreset& p : kGptPresets) names.push_back(p.name);
  for (const LlamaPreset& p : kLlamaPresets) names.push_back(p.name);
  return names;
}

absl::StatusOr<GptConfig> PresetGptConfig(absl::string_view preset) {
  if (const GptPreset* p = FindGptPreset(preset)) return p->config;
  if (preset == "mlp") {
    return absl::InvalidArgumentError("preset 'mlp' is not a GPT (it has no attention)");
  }
  if (FindLlamaPreset(preset) != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("preset '", preset, "' is a Llama-family model, not a GPT"));
  }
  return UnknownPreset(preset);
}

absl::StatusOr<LlamaConfig> PresetLlamaConfig(absl::string_view preset) {
  if (const LlamaPreset* p = FindLlamaPreset(preset)) return p->config;
  return absl::InvalidArgumentError(absl::StrCat("preset '", preset, "' is not a Llama model"));
}

absl::StatusOr<LayerGraph> PresetModel(absl::string_view preset, int64_t micro_batch_size) {
  if (micro_batch_size < 0) return absl::InvalidArgumentError("micro-batch size must be >= 1");
  if (const GptPreset* p = FindGptPreset(preset)) {
    const int64_t b = micro_batch_size ? micro_batch_size : p->default_micro_batch_size;
    return GptModel(p->name, p->config, b);
  }
  if (const LlamaPreset* p = FindLlamaPreset(preset)) {
    const int64_t b = micro_batch_size ? micro_batch_size : p->default_micro_batch_size;
    return LlamaModel(p->name, p->config, b);
  }
  if (preset == "mlp") {
    // A per-position next-byte model without attention: embed, 3 x (linear, gelu), head, loss.
    constexpr int64_t kDim = 64, kHidden = 256, kSeq = 32, kVocab = 256;
    ModelBuilder b("mlp", {micro_batch_size ? micro_batch_size : 8, kSeq});
    b.Add("embed", layers::Embedding(kVocab, kSeq, kDim));
    int64_t width = kDim;
    for (int i = 0; i < 3; ++i) {
      b.Add(absl::StrCat("fc.", i), layers::Linear(width, kHidden));
      b.Add(absl::StrCat("act.", i), layers::Gelu());
      width = kHidden;
    }
    b.Add("lm_head", layers::LmHead(width, kVocab));
    b.Add("loss", layers::CrossEntropyLoss());
    return b.Build();
  }
  return UnknownPreset(preset);
}

absl::Status CheckGptConfig(const GptConfig& c, absl::string_view context,
                            int64_t micro_batch_size) {
  const std::tuple<const char*, int64_t, int64_t> fields[] = {
      {"layers", c.layers, kMaxGptLayers},
      {"hidden", c.hidden, kMaxGptHidden},
      {"heads", c.heads, kMaxGptHidden},
      {"seq", c.seq, kMaxGptSeq},
      {"vocab", c.vocab, kMaxGptVocab},
      {"micro_batch_size", micro_batch_size, kMaxGptMicroBatchSize}};
  PW_RETURN_IF_ERROR(CheckFieldRanges(context, fields));
  if (c.hidden % c.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: hidden=%d is not divisible by heads=%d", context, c.hidden, c.heads));
  }
  // Note [GPT limits]: the largest counts, exactly (the per-layer formulas of
  // runtime/layers/specs.cc, summed).
  const CheckedInt l(c.layers), h(c.hidden), a(c.heads), s(c.seq), v(c.vocab);
  const CheckedInt n = CheckedInt(micro_batch_size) * s;  // tokens per micro-batch
  const CheckedInt params = l * (CheckedInt(12) * h * h + CheckedInt(13) * h) +
                            (CheckedInt(2) * v + s) * h + CheckedInt(2) * h;
  const CheckedInt block_bytes = CheckedInt(4) * (CheckedInt(16) * n * h + CheckedInt(4) * n +
                                                  CheckedInt(micro_batch_size) * a * s);
  const CheckedInt logits_bytes = CheckedInt(8) * n * v;
  const struct {
    const char* what;
    CheckedInt bytes;
  } counts[] = {{"the bytes of its parameters, gradients and optimizer state (18 per parameter)",
                 CheckedInt(18) * params},
                {"the bytes all its blocks save for the backward", l * block_bytes},
                {"the bytes of its logits", logits_bytes},
                {"its total bytes", CheckedInt(18) * params + l * block_bytes + logits_bytes}};
  for (const auto& count : counts) {
    if (count.bytes.overflow()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: layers=%d,hidden=%d,heads=%d,seq=%d,vocab=%d at micro-batch size %d is too "
          "large: %s overflow 64-bit integers",
          context, c.layers, c.hidden, c.heads, c.seq, c.vocab, micro_batch_size, count.what));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GptConfig> ParseGptSpec(absl::string_view spec) {
  GptConfig c;
  c.tied = true;  // GPT-3 and Megatron-LM tie the LM head (docs in the header)
  struct Key {
    const char* name;
    int64_t* value;
    bool seen = false;
  };
  int64_t tied = 1;
  Key keys[] = {{"layers", &c.layers}, {"hidden", &c.hidden}, {"heads", &c.heads},
                {"seq", &c.seq},       {"vocab", &c.vocab},   {"tied", &tied}};
  const std::string context = absl::StrCat("GPT spec '", spec, "'");
  if (absl::StripAsciiWhitespace(spec).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": empty; expected layers=L,hidden=H,heads=A,seq=S,vocab=V"));
  }
  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    item = absl::StripAsciiWhitespace(item);
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": '", item, "' is not key=value"));
    }
    const absl::string_view name = absl::StripAsciiWhitespace(item.substr(0, eq));
    const absl::string_view text = absl::StripAsciiWhitespace(item.substr(eq + 1));
    Key* key = nullptr;
    for (Key& k : keys) {
      if (name == k.name) key = &k;
    }
    if (key == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          context, ": unknown key '", name, "' (keys: layers, hidden, heads, seq, vocab, tied)"));
    }
    if (key->seen) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": ", name, " given twice"));
    }
    key->seen = true;
    int64_t v = 0;
    if (!absl::SimpleAtoi(text, &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": ", name, "='", text, "' is not an integer"));
    }
    if (key->value == &tied) {
      if (v != 0 && v != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(context, ": tied=", text, " must be 0 or 1"));
      }
    }
    *key->value = v;
  }
  for (const Key& k : keys) {
    if (!k.seen && k.value != &tied) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": missing ", k.name, "="));
    }
  }
  c.tied = tied == 1;
  PW_RETURN_IF_ERROR(CheckGptConfig(c, context));
  return c;
}

absl::StatusOr<GptConfig> GptConfigOf(const LayerGraph& graph) {
  const int n = graph.num_layers();
  auto not_gpt = [&] {
    return absl::NotFoundError(absl::StrCat("model '", graph.name(), "' is not a GPT"));
  };
  if (n < 5 || graph.node(0).spec->kind() != "embedding" ||
      graph.node(1).spec->kind() != "transformer_block" ||
      graph.node(n - 2).spec->kind() != "lm_head") {
    return not_gpt();
  }
  auto number = [](const LayerNode& node, absl::string_view key) {
    int64_t v = 0;
    return absl::SimpleAtoi(ConfigValue(node.spec->Config(), key), &v) ? v : int64_t{0};
  };
  GptConfig c;
  c.layers = n - 4;
  c.hidden = number(graph.node(0), "dim");
  c.seq = number(graph.node(0), "max_seq");
  c.vocab = number(graph.node(0), "vocab");
  c.heads = number(graph.node(1), "heads");
  c.tied = !graph.node(n - 2).spec->tied_to().empty();
  if (c.layers < 1 || c.hidden < 1 || c.seq < 1 || c.vocab < 1 || c.heads < 1 ||
      c.hidden % c.heads != 0) {
    return not_gpt();
  }
  absl::StatusOr<LayerGraph> rebuilt = GptModel(graph.name(), c, graph.shape().batch);
  if (!rebuilt.ok() || rebuilt->Fingerprint() != graph.Fingerprint()) return not_gpt();
  return c;
}

namespace {
// A Llama's config read from its layers' configurations (LlamaConfigOf checks it rebuilds them).
absl::StatusOr<LlamaConfig> LlamaConfigFromLayers(const LayerGraph& graph) {
  const int n = graph.num_layers();
  if (n < 5 || graph.node(0).spec->kind() != "token_embedding" ||
      graph.node(1).spec->kind() != "llama_block" || graph.node(n - 2).spec->kind() != "lm_head") {
    return absl::NotFoundError("not a Llama layer graph");
  }
  const std::string block = graph.node(1).spec->Config();
  auto number = [&](const std::string& config, absl::string_view key) {
    int64_t v = 0;
    return absl::SimpleAtoi(ConfigValue(config, key), &v) ? v : int64_t{0};
  };
  LlamaConfig c;
  c.layers = n - 4;
  c.vocab = number(graph.node(0).spec->Config(), "vocab");
  c.seq = graph.shape().seq_len;
  c.hidden = number(block, "dim");
  c.heads = number(block, "heads");
  c.kv_heads = number(block, "kv_heads");
  c.ffn = number(block, "ffn");
  c.tied = !graph.node(n - 2).spec->tied_to().empty();
  if (!absl::SimpleAtod(ConfigValue(block, "rope_theta"), &c.rope_theta) ||
      !absl::SimpleAtof(ConfigValue(block, "eps"), &c.eps)) {
    return absl::NotFoundError("not a Llama layer graph");
  }
  PW_RETURN_IF_ERROR(CheckLlamaConfig(c, "Llama layer graph", graph.shape().batch));
  return c;
}
}  // namespace

absl::StatusOr<LlamaConfig> LlamaConfigOf(const LayerGraph& graph) {
  // From the layers (any name), else from the name (a spec or preset whose numbers the layers'
  // configurations print rounded); either way the rebuilt graph must be this one.
  absl::string_view name = graph.name();
  for (const absl::StatusOr<LlamaConfig>& c :
       {LlamaConfigFromLayers(graph),
        absl::ConsumePrefix(&name, "llama:") ? ParseLlamaSpec(name) : PresetLlamaConfig(name)}) {
    if (!c.ok()) continue;
    absl::StatusOr<LayerGraph> again = LlamaModel(graph.name(), *c, graph.shape().batch);
    if (again.ok() && again->Fingerprint() == graph.Fingerprint()) return c;
  }
  return absl::NotFoundError(absl::StrCat("model '", graph.name(), "' is not a Llama model"));
}

absl::StatusOr<ModelCosts> GptModelCosts(const std::string& name, const GptConfig& c,
                                         int64_t micro_batch_size) {
  if (micro_batch_size < 1) return absl::InvalidArgumentError("micro-batch size must be >= 1");
  PW_ASSIGN_OR_RETURN(LayerGraph graph, GptModel(name, c, micro_batch_size));
  return ToModelCosts(graph);
}

absl::Status CheckLlamaConfig(const LlamaConfig& c, absl::string_view context,
                              int64_t micro_batch_size) {
  const std::tuple<const char*, int64_t, int64_t> fields[] = {
      {"layers", c.layers, kMaxGptLayers},
      {"hidden", c.hidden, kMaxGptHidden},
      {"heads", c.heads, kMaxGptHidden},
      {"kv_heads", c.kv_heads, kMaxGptHidden},
      {"ffn", c.ffn, 8 * kMaxGptHidden},
      {"seq", c.seq, kMaxGptSeq},
      {"vocab", c.vocab, kMaxGptVocab},
      {"micro_batch_size", micro_batch_size, kMaxGptMicroBatchSize}};
  PW_RETURN_IF_ERROR(CheckFieldRanges(context, fields));
  if (c.hidden % c.heads != 0 || (c.hidden / c.heads) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": hidden=", c.hidden, " must be heads=", c.heads,
                     " times an even head dimension (the rotary embedding turns pairs of it)"));
  }
  if (c.heads % c.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": heads=", c.heads, " must be a multiple of kv_heads=", c.kv_heads));
  }
  if (!(c.rope_theta > 1 && c.rope_theta < 1e12) || !(c.eps > 0 && c.eps < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": rope_theta=", c.rope_theta,
                                                   " must be in (1, 1e12) and eps=", c.eps,
                                                   " in (0, 1)"));
  }
  // The counts the cost model keeps in int64 (Note [GPT limits]): parameters' bytes (18 per
  // parameter), every block's saved activations and the logits.
  const CheckedInt h(c.hidden), f(c.ffn), l(c.layers), v(c.vocab),
      kv(c.kv_heads * (c.hidden / c.heads));
  const CheckedInt n = CheckedInt(c.seq) * CheckedInt(micro_batch_size);
  const CheckedInt block = h * (h + kv * CheckedInt(2)) + h * h + h * f * CheckedInt(3);
  const CheckedInt params = l * block + v * h * CheckedInt(2);
  const CheckedInt bytes = params * CheckedInt(18) +
                           l * n * (h * CheckedInt(16) + f * CheckedInt(16)) +
                           n * v * CheckedInt(8);
  if (bytes.overflow()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": the model's byte counts overflow 64 bits (", c.layers,
                     " layers of ", c.hidden, ", ffn ", c.ffn, ", vocabulary ", c.vocab, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerGraph> LlamaModel(const std::string& name, const LlamaConfig& c,
                                      int64_t micro_batch_size) {
  PW_RETURN_IF_ERROR(
      CheckLlamaConfig(c, absl::StrCat("Llama model '", name, "'"), micro_batch_size));
  ModelBuilder b(name, {micro_batch_size, c.seq});
  b.Add("embed", layers::TokenEmbedding(c.vocab, c.hidden));
  for (int64_t i = 0; i < c.layers; ++i) {
    b.Add(absl::StrCat("blocks.", i),
          layers::LlamaBlock(c.hidden, c.heads, c.kv_heads, c.ffn, c.rope_theta, c.eps));
  }
  b.Add("norm", layers::RmsNorm(c.hidden, c.eps));
  b.Add("lm_head", layers::LmHead(c.hidden, c.vocab, c.tied ? "embed" : ""));
  b.Add("loss", layers::CrossEntropyLoss());
  return b.Build();
}

absl::StatusOr<ModelCosts> PresetModelCosts(absl::string_view preset, int64_t micro_batch_size) {
  if (micro_batch_size < 0) return absl::InvalidArgumentError("micro-batch size must be >= 1");
  if (const GptPreset* p = FindGptPreset(preset)) {
    return GptModelCosts(p->name, p->config,
                         micro_batch_size ? micro_batch_size : p->default_micro_batch_size);
  }
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetModel(preset, micro_batch_size));
  return ToModelCosts(graph);
}

}  // namespace pipewright
