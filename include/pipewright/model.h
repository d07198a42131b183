// Staging a model: a ModelBuilder adds named layer nodes in order and yields a LayerGraph with
// per-layer costs. Any contiguous range [begin, end) of a LayerGraph can be instantiated alone
// as a Stage: no rank ever allocates the whole model.
//
//   ModelBuilder b("my-gpt", {.batch = 4, .seq_len = 64});
//   b.Add("embed", layers::Embedding(256, 64, 128));
//   for (int i = 0; i < 6; ++i) b.Add(absl::StrCat("blocks.", i), layers::TransformerBlock(128,
//   4)); b.Add("ln_f", layers::LayerNorm(128)).Add("lm_head", layers::LmHead(128, 256));
//   b.Add("loss", layers::CrossEntropyLoss());
//   PW_ASSIGN_OR_RETURN(LayerGraph graph, b.Build());
//   PW_ASSIGN_OR_RETURN(auto stage, graph.Instantiate(2, 5, /*seed=*/7));
#ifndef PIPEWRIGHT_MODEL_H_
#define PIPEWRIGHT_MODEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/cost.h"
#include "pipewright/layer.h"
#include "pipewright/plan.h"

namespace pipewright {

struct LayerNode {
  std::string name;
  LayerSpecPtr spec;
  Cost cost;  // for the graph's micro-batch shape
};

// A tied copy (Parameter::tied_to) linked to its owner: the copy's value is the owner's tensor.
struct TiedLink {
  Parameter* copy = nullptr;
  Parameter* owner = nullptr;
};

// Links every tied copy in `params` whose owner (the parameter named copy->tied_to) is in
// `params` too: the copy's value becomes the owner's tensor (shared storage). Copies whose
// owner is elsewhere are left alone. An owner of another shape or dtype is an error naming both.
absl::StatusOr<std::vector<TiedLink>> LinkTiedParameters(const std::vector<Parameter*>& params);

// The tie reduction of linked copies: owner.grad += copy.grad, then copy.grad = 0 (so the copy
// starts the next step at zero). Run after the data-parallel reduction, before the gradient
// norm and the optimizer (Note [Tied parameters] in runtime/model.cc).
absl::Status AddTiedGradients(const std::vector<TiedLink>& links, Allocator* exec = nullptr);

// The layers [begin, end) of a graph, instantiated with their global names and weights.
class Stage {
 public:
  Stage(int begin, std::vector<std::string> names, std::vector<std::unique_ptr<Layer>> layers);
  int begin() const { return begin_; }
  int end() const { return begin_ + static_cast<int>(layers_.size()); }
  int size() const { return static_cast<int>(layers_.size()); }
  Layer& layer(int i) { return *layers_[i]; }
  const std::string& name(int i) const { return names_[i]; }
  // The parameters this stage trains, in layer order: every layer's, less the tied copies
  // linked to an owner within the stage (they share its value; see tied()).
  std::vector<Parameter*> Parameters();
  // Links the tied copies whose owner is in this stage (LinkTiedParameters). Instantiate calls
  // it; call it again after replacing an owner's value tensor (a move to another device).
  absl::Status LinkTied();
  // The copies linked within this stage; after each step's backward, AddTiedGradients(tied()).
  const std::vector<TiedLink>& tied() const { return tied_; }

  // One micro-batch through every layer; `saved` gets one entry per layer.
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx,
                                 std::vector<Saved>* saved);
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       std::vector<Saved>* saved);
  absl::Status BackwardWeight(const LayerContext& ctx, std::vector<Saved>* saved);

 private:
  int begin_;
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<TiedLink> tied_;
};

class LayerGraph {
 public:
  const std::string& name() const { return name_; }
  const MicroBatchShape& shape() const { return shape_; }
  int num_layers() const { return static_cast<int>(nodes_.size()); }
  const LayerNode& node(int i) const { return nodes_[i]; }
  const std::vector<LayerNode>& nodes() const { return nodes_; }
  Cost TotalCost() const;
  // Number of transformer blocks (for GPT-2's residual-projection init scaling).
  int num_blocks() const { return num_blocks_; }
  // Instantiates layers [begin, end) only. Errors on an empty or out-of-range range. With
  // tp_size > 1, tensor-parallel part `tp_rank` of each layer (InitContext::tp_rank): the
  // layers' specs refuse a size their shapes do not divide by.
  absl::StatusOr<std::unique_ptr<Stage>> Instantiate(int begin, int end, uint64_t seed,
                                                     Allocator* allocator = nullptr,
                                                     int tp_rank = 0, int tp_size = 1) const;
  // Stable digest of names, kinds and configs: "sha256-like" hex of a 64-bit FNV-1a pair.
  std::string Fingerprint() const;

 private:
  friend class ModelBuilder;
  std::string name_;
  MicroBatchShape shape_;
  std::vector<LayerNode> nodes_;
  int num_blocks_ = 1;
};

class ModelBuilder {
 public:
  ModelBuilder(std::string name, MicroBatchShape shape);
  // Appends a node. Names must be unique and non-empty (checked at Build).
  ModelBuilder& Add(std::string name, LayerSpecPtr spec);
  absl::StatusOr<LayerGraph> Build() const;

 private:
  std::string name_;
  MicroBatchShape shape_;
  std::vector<std::pair<std::string, LayerSpecPtr>> nodes_;
};

// Presets. Runnable (small enough to train here): "mlp", "gpt-tiny", "gpt-small" (untied LM
// head, default micro-batch size 8); "gpt2-124m" (GPT-2 small, seq 1024, vocabulary 50304, the
// LM head tied to the embedding: 124M parameters) is runnable too but meant for a GPU. Analytic
// (for planning only; their graphs allocate nothing, but LayerGraph::Instantiate of the whole model
// would need terabytes): "gpt3-175b" and the weak-scaling configurations of Narayanan et al. 2021,
// Table 1
// ("megatron-1.7b" ... "megatron-1t"), all with sequence 2048, vocabulary 51200, a tied LM head and
// default micro-batch size 1. `micro_batch_size` 0 keeps the preset's default.
struct GptConfig {
  int64_t layers = 4, hidden = 64, heads = 4, seq = 32, vocab = 256;
  // The LM head is the token embedding's weight (layers::LmHead(..., "embed"); Note [Tied
  // parameters] in runtime/model.cc), as in GPT-2 and GPT-3.
  bool tied = false;
};
absl::StatusOr<LayerGraph> GptModel(const std::string& name, const GptConfig& config,
                                    int64_t micro_batch_size);
absl::StatusOr<LayerGraph> PresetModel(absl::string_view preset, int64_t micro_batch_size);
// Every preset name, runnable ones first.
std::vector<std::string> PresetNames();

// The Llama family (Note [Llama layers] in runtime/ops/llama_ops.cc): token embedding, `layers`
// Llama blocks (RMSNorm, rotary grouped-query attention, SwiGLU; no biases), a final RMSNorm,
// an LM head (tied to the embedding or not) and the loss. Presets: "llama-tiny" (byte-level,
// runnable here: 4 blocks of 64 wide, 4 heads over 2 kv heads), "smollm2-135m" (SmolLM2-135M's
// published shape: 30 blocks, 576 wide, 9 heads, 3 kv heads, ffn 1536, vocabulary 49152, tied,
// theta 100000) and, for planning, "llama3-8b", "llama3-70b", "llama3-405b" (the Llama 3 paper's
// shapes: vocabulary 128256, sequence 8192, theta 500000, untied).
struct LlamaConfig {
  int64_t layers = 4, hidden = 64, heads = 4, kv_heads = 2, ffn = 176, seq = 32, vocab = 256;
  bool tied = false;
  double rope_theta = 10000;
  float eps = 1e-5f;
};
// Every field in range (the GPT limits of CheckGptConfig; ffn <= kMaxGptHidden x 8), hidden
// divisible by heads with an even head dim, heads divisible by kv_heads, and the parameter and
// activation byte counts at `micro_batch_size` within int64. InvalidArgument naming the field.
absl::Status CheckLlamaConfig(const LlamaConfig& config, absl::string_view context,
                              int64_t micro_batch_size = 1);
absl::StatusOr<LayerGraph> LlamaModel(const std::string& name, const LlamaConfig& config,
                                      int64_t micro_batch_size);

// Model specs (runtime/model_spec.cc): "llama:layers=L,hidden=H,heads=A,ffn=F,seq=S,vocab=V"
// with optional kv_heads (default heads), tied (0|1, default 0) and rope_theta (default 10000).
// Every required key once, as an integer (rope_theta a number); CheckLlamaConfig's ranges.
// InvalidArgument naming the key.
absl::StatusOr<LlamaConfig> ParseLlamaSpec(absl::string_view spec);
// The canonical spec of a config, "gpt:layers=…,tied=1" or "llama:…,rope_theta=500000": the
// name ModelFromSpec gives the graph, so the name alone rebuilds it.
std::string ModelSpecName(const GptConfig& config);
std::string ModelSpecName(const LlamaConfig& config);
// A preset name, "gpt:SPEC" (ParseGptSpec) or "llama:SPEC" (ParseLlamaSpec): the graph, named
// by ModelSpecName for a spec. `micro_batch_size` 0: the preset's default, 1 for a spec.
absl::StatusOr<LayerGraph> ModelFromSpec(absl::string_view spec, int64_t micro_batch_size);
// The LlamaConfig of a Llama preset; InvalidArgument for any other name.
absl::StatusOr<LlamaConfig> PresetLlamaConfig(absl::string_view preset);
// The LlamaConfig of a graph ModelFromSpec built from a Llama preset or spec (checked by
// rebuilding it: same fingerprint); NotFound for any other graph.
absl::StatusOr<LlamaConfig> LlamaConfigOf(const LayerGraph& graph);
// Whether `name` is a spec ("gpt:…" or "llama:…") rather than a preset name.
bool IsModelSpec(absl::string_view name);

// The partitioner's view of a graph (plan.h): every node's Cost, the fingerprint, the input
// bytes of one micro-batch, and each tied layer's tied_to (LayerSpec::tied_to).
ModelCosts ToModelCosts(const LayerGraph& graph);

// `pipewright model --gpt SPEC`: "layers=96,hidden=12288,heads=96,seq=2048,vocab=51200" with an
// optional ",tied=0|1". Every key but tied is required, once, as an integer in its range
// (CheckGptConfig); hidden must be divisible by heads. tied defaults to 1 (GPT-3 and Megatron-LM
// tie the LM head to the token embedding; tied=0 unties it). Errors are InvalidArgument naming the
// key.
absl::StatusOr<GptConfig> ParseGptSpec(absl::string_view spec);
// The ranges of a GptConfig's fields (docs/input-limits.md, "Input limits"); heads must also divide
// hidden. A micro-batch size is in [1, kMaxGptMicroBatchSize].
inline constexpr int64_t kMaxGptLayers = 100000;
inline constexpr int64_t kMaxGptHidden = int64_t{1} << 20;  // heads too
inline constexpr int64_t kMaxGptSeq = int64_t{1} << 24;
inline constexpr int64_t kMaxGptVocab = (int64_t{1} << 31) - 1;
inline constexpr int64_t kMaxGptMicroBatchSize = int64_t{1} << 24;
// The one check of a GPT's shape, which GptModel (so every preset, --gpt spec, checkpoint
// manifest and import) runs before building anything: every field in its range, hidden divisible
// by heads, and the parameter, activation and logit byte counts at `micro_batch_size` within
// int64 (computed with overflow checks; Note [GPT limits] in runtime/model.cc). InvalidArgument
// naming the field and its range; `context` starts each message ("--gpt '...'",
// "DIR/manifest.json: model.gpt").
absl::Status CheckGptConfig(const GptConfig& config, absl::string_view context,
                            int64_t micro_batch_size = 1);

// The GptConfig of a graph GptModel built (checked by rebuilding it: same fingerprint);
// NotFound for any other graph. What a checkpoint records as its architecture.
absl::StatusOr<GptConfig> GptConfigOf(const LayerGraph& graph);

// The GptConfig of a GPT preset (every preset but "mlp"); InvalidArgument otherwise.
absl::StatusOr<GptConfig> PresetGptConfig(absl::string_view preset);

// ToModelCosts(GptModel(name, config, micro_batch_size)) after an overflow check. With
// config.tied the "lm_head" layer gets tied_to = "embed": its V*h weights are the embedding's
// token table, so
// ModelCosts::UniqueParams() leaves them out (the embedding's own count is (V + s) * h, token
// and position tables). Costs are analytic: nothing is allocated, whatever the model's size.
absl::StatusOr<ModelCosts> GptModelCosts(const std::string& name, const GptConfig& config,
                                         int64_t micro_batch_size);
// A preset's costs: GptModelCosts for the GPT presets, ToModelCosts for "mlp".
absl::StatusOr<ModelCosts> PresetModelCosts(absl::string_view preset, int64_t micro_batch_size);

// Measured per-layer times (`pipewright model --profile`, runtime/profile.cc): instantiates the
// whole graph on the CPU with `seed`, runs one deterministic synthetic micro-batch (token ids
// and targets drawn from the seed) through it once to warm up and then `reps` times, and
// returns ToModelCosts(graph) with every layer's forward_time_s (Forward) and backward_time_s
// (BackwardInput + BackwardWeight) set to the median over the reps. The graph must start with
// an embedding (token input). BLAS threading is the caller's choice (openblas_set_num_threads).
// InvalidArgument, before allocating anything, for reps < 1 or a graph whose fp32 weights and
// gradients would exceed 4 GiB.
absl::StatusOr<ModelCosts> ProfileModel(const LayerGraph& graph, int reps, uint64_t seed);
inline constexpr int64_t kProfileMemoryLimitBytes = int64_t{4} << 30;

}  // namespace pipewright

#endif  // PIPEWRIGHT_MODEL_H_
