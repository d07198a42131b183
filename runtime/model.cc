#include "pipewright/model.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/sha256.h"

namespace pipewright {

Stage::Stage(int begin, std::vector<std::string> names, std::vector<std::unique_ptr<Layer>> layers)
    : begin_(begin), names_(std::move(names)), layers_(std::move(layers)) {}

std::vector<Parameter*> Stage::Parameters() {
  std::vector<Parameter*> out;
  for (auto& l : layers_) {
    for (Parameter* p : l->Parameters()) out.push_back(p);
  }
  return out;
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
                                                               Allocator* allocator) const {
  if (begin < 0 || end > num_layers() || begin >= end) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer range [%d, %d) is empty or outside the model's %d layers", begin,
                        end, num_layers()));
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
    PW_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer, nodes_[i].spec->Create(init));
    names.push_back(nodes_[i].name);
    built.push_back(std::move(layer));
  }
  return std::make_unique<Stage>(begin, std::move(names), std::move(built));
}

std::string LayerGraph::Fingerprint() const {
  std::string text = absl::StrCat(name_, "|b=", shape_.batch, "|s=", shape_.seq_len);
  for (const LayerNode& n : nodes_) {
    absl::StrAppend(&text, "|", n.name, ":", n.spec->kind(), "(", n.spec->Config(), ")");
  }
  return absl::StrCat("sha256:", Sha256Hex(text));
}

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
  if (c.layers < 1 || c.hidden < 1 || c.heads < 1 || c.seq < 1 || c.vocab < 1) {
    return absl::InvalidArgumentError("GPT config: every dimension must be >= 1");
  }
  if (c.hidden % c.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GPT config: hidden %d is not divisible by heads %d", c.hidden, c.heads));
  }
  ModelBuilder b(name, {micro_batch_size, c.seq});
  b.Add("embed", layers::Embedding(c.vocab, c.seq, c.hidden));
  for (int64_t i = 0; i < c.layers; ++i) {
    b.Add(absl::StrCat("blocks.", i), layers::TransformerBlock(c.hidden, c.heads));
  }
  b.Add("ln_f", layers::LayerNorm(c.hidden));
  b.Add("lm_head", layers::LmHead(c.hidden, c.vocab));
  b.Add("loss", layers::CrossEntropyLoss());
  return b.Build();
}

std::vector<std::string> PresetNames() { return {"mlp", "gpt-tiny", "gpt-small"}; }

absl::StatusOr<LayerGraph> PresetModel(absl::string_view preset, int64_t micro_batch_size) {
  if (micro_batch_size < 0) return absl::InvalidArgumentError("micro-batch size must be >= 1");
  if (preset == "gpt-tiny") {
    return GptModel("gpt-tiny", {.layers = 4, .hidden = 64, .heads = 4, .seq = 32, .vocab = 256},
                    micro_batch_size ? micro_batch_size : 8);
  }
  if (preset == "gpt-small") {
    return GptModel("gpt-small", {.layers = 6, .hidden = 256, .heads = 8, .seq = 128, .vocab = 256},
                    micro_batch_size ? micro_batch_size : 8);
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
  return absl::InvalidArgumentError(
      absl::StrCat("unknown preset '", preset, "' (known: mlp, gpt-tiny, gpt-small)"));
}

}  // namespace pipewright
