// Layer: the unit of work a pipeline stage runs. The backward is split in two, as zero-bubble
// schedules need:
//   Forward(x)          -> y, keeping in `saved` what the backward needs
//   BackwardInput(dy)   -> dx = dL/dx, keeping in `saved` what the weight gradient needs
//   BackwardWeight()    -> dL/dW ACCUMULATED (+=) into each Parameter::grad, then frees `saved`
// Backward() = BackwardInput then BackwardWeight. One `Saved` per micro-batch in flight, so a
// stage may hold several micro-batches' activations at once (1F1B warm-up).
//
// Parameters are created and initialised by LayerSpec::Create, each from (seed, the parameter's
// global name, e.g. "blocks.3.attn.qkv.weight") with a counter-based generator
// (pipewright/init.h), so a layer has bit-identical weights whichever pipeline stage
// instantiates it and in whatever order. The layer's global index (InitContext::layer_index) is
// not part of the key: renaming a node changes its weights, moving it does not.
//
// Custom layers implement Layer and LayerSpec with the same tools as the built-in ones: device
// dispatch through pipewright/ops.h, parameters and input checks through pipewright/init.h
// (docs/custom_layers.md).
#ifndef PIPEWRIGHT_LAYER_H_
#define PIPEWRIGHT_LAYER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "pipewright/cost.h"
#include "pipewright/tensor.h"

namespace pipewright {

struct TensorParallelGroup;  // pipewright/tensor_parallel.h

// Which part of a global tensor a tensor-parallel rank holds (Note [Tensor-parallel shards] in
// pipewright/tensor_parallel.h). The default is the whole tensor.
struct TensorShard {
  int axis = -1;  // the split dimension of the whole tensor; -1: whole (replicated)
  int parts = 1;  // the tensor-parallel size it is split over
  int index = 0;  // this rank's part
  // The whole axis's sections, in order (a fused product's q, k and v outputs), each split in
  // `parts` alike: the part holds piece `index` of every section. Empty: one section.
  std::vector<int64_t> sections;
  bool sharded() const { return axis >= 0 && parts > 1; }
};

struct Parameter {
  std::string name;          // global, stable: "blocks.3.attn.qkv.weight"
  Tensor value;              // f32 master weights
  Tensor grad;               // f32, same shape; accumulated across micro-batches
  bool weight_decay = true;  // false for biases, LayerNorm and embeddings' positions
  // A tied copy (layers::LmHead(..., tied_to)): the global name of the parameter whose weight
  // this one is ("embed.wte.weight"); empty for a parameter of its own. A copy is initialised
  // from that name, so it starts equal to its owner. Where the owner is on the same rank the
  // copy shares the owner's value tensor and is not trained itself; elsewhere it is trained like
  // the owner. Either way its gradient is accumulated on its own and added to the owner's before
  // the optimizer step (Note [Tied parameters] in runtime/model.cc), it is not counted again in
  // the gradient norm, and checkpoints hold the owner only.
  std::string tied_to;
  // Under tensor parallelism, the part of the global tensor `name` this parameter holds (its
  // value's shape is the part's); checkpoints store the whole tensor.
  TensorShard shard;
};

// The name a parameter is initialised from and stored under: its owner's for a tied copy.
inline const std::string& StoredName(const Parameter& p) {
  return p.tied_to.empty() ? p.name : p.tied_to;
}

// What one layer keeps between the passes of one micro-batch. Composite layers nest.
struct Saved {
  std::vector<Tensor> tensors;
  std::vector<Saved> children;
  void Clear() {
    tensors.clear();
    children.clear();
  }
  bool empty() const { return tensors.empty() && children.empty(); }
  int64_t bytes() const;
};

// Note [Gradient groups]. A layer's parameters fall into groups whose weight gradients are added
// together: one group per leaf layer (a Linear's weight and bias, a LayerNorm's gamma and beta),
// Layer::ParameterGroups. A composite layer's backward finishes its children's groups one after
// another, in the reverse of their order, and says so as each finishes (ReportGradients), so a
// data-parallel strategy whose gradient buffers are smaller than a layer (ZeRO-2: two buckets'
// worth per stage, docs/runtime.md) can reduce a bucket and reuse its buffer in the middle of a
// layer's backward. The executor reports every parameter of a layer after the layer's backward
// anyway; a report of a parameter already reported for this micro-batch is ignored.
class GradientObserver {
 public:
  virtual ~GradientObserver() = default;
  // The weight gradients of `params` for the current micro-batch are complete (added into each
  // Parameter::grad).
  virtual absl::Status GradientsDone(const std::vector<Parameter*>& params) = 0;
};

// Note [16-bit weights once a step]. Under mixed precision a Linear layer multiplies the 16-bit
// rounding of its fp32 master weight, in the forward and again in the backward of every
// micro-batch: 2M casts of every weight a step, 11% of gpt2-124m's bf16 step on the CPU
// (docs/benchmarks-kernels.md, "AMX tiles"). The masters do not change between a step's first
// forward and its optimizer update, so the engine gives its layers a cache
// (LayerContext::half_weights) that keeps each rounding from its first use in a step and forgets
// them all when the next step begins (RankExecutor::BeginStep: after the update, after an
// asynchronous replica's pull). The rounding is the same function of the same masters, so the bits
// are those of casting at every use (tested:
// MixedPrecisionTraining.HalfWeightsOnceAStepGiveTheBitsOfEveryUse). The copies are the 2 bytes a
// parameter the memory model already charges for mixed precision (docs/memory.md). A caller without
// an engine (evaluation, generation, a layer's own tests) passes none and casts at every use.
class HalfWeightCache {
 public:
  // The rounding of `master` (a parameter's fp32 value) to `dtype`: `make`'s result on the first
  // call for this tensor and dtype since Clear(), the same tensor afterwards.
  absl::StatusOr<Tensor> GetOrMake(const Tensor& master, DType dtype,
                                   absl::FunctionRef<absl::StatusOr<Tensor>()> make);
  // The masters may have changed: every copy is dropped.
  void Clear();
  int64_t size() const;  // copies held

 private:
  using Key = std::tuple<const void*, int64_t, DType>;  // the master's data, its size, the dtype
  mutable absl::Mutex mu_;
  std::map<Key, Tensor> copies_ ABSL_GUARDED_BY(mu_);
};

// Per-call context: where to allocate outputs, and the targets for a loss layer.
struct LayerContext {
  Allocator* allocator = nullptr;   // nullptr = DefaultCpuAllocator()
  const Tensor* targets = nullptr;  // [B, T] i32 next tokens; loss layers only
  // Matrix-product input dtype (precision.h): f32, or bf16/f16 for mixed precision, where
  // Linear layers round their input, weight and output gradient to 16 bits, accumulate in
  // fp32 and keep the 16-bit copies as their saved activations.
  DType compute_dtype = DType::kF32;
  // --recompute selective on this stage (docs/memory.md): a layer with a selective mode keeps
  // only what cannot be remade cheaply and remakes the rest at the start of BackwardInput, bit
  // for bit (the transformer block drops its LayerNorm and GELU outputs). Forward and the
  // backward of one micro-batch must see the same value.
  bool selective_recompute = false;
  // The stage's tensor-parallel group (pipewright/tensor_parallel.h), or null when the run is
  // not tensor-parallel: what a layer built with InitContext::tp_size > 1 reduces over.
  const TensorParallelGroup* tp = nullptr;
  // (backward passes) Told as each group of weight gradients is complete (Note [Gradient
  // groups]); null when no one listens.
  GradientObserver* gradients = nullptr;
  // Mixed precision: the step's 16-bit weight copies (Note [16-bit weights once a step]); null:
  // cast at every use.
  HalfWeightCache* half_weights = nullptr;
};

// Note [Incremental decoding]. Generating text one token at a time (`pipewright generate`,
// GenerateFromCheckpoint in train.h) need not recompute the whole window for every token: a
// causal model's rows at the positions already seen do not change when a token is appended, so
// a layer that keeps what later positions read (the attention's keys and values: a KV cache)
// can compute the new position's row alone. A layer offers this through an IncrementalDecoder
// (optional: Layer::decoder() is null when the layer has none):
//
//   DecodeCache cache;
//   PW_RETURN_IF_ERROR(layer.decoder()->StartDecode(/*capacity=*/T, ctx, &cache));
//   PW_ASSIGN_OR_RETURN(Tensor y, layer.decoder()->Decode(prompt_rows, ctx, &cache));  // prefill
//   PW_ASSIGN_OR_RETURN(y, layer.decoder()->Decode(next_row, ctx, &cache));            // one more
//
// Decode(x) of the rows of positions [length, length + n) of one sequence (batch 1) returns the
// rows that Forward of the sequence's first length + n positions gives there, within rounding
// (the kernels may sum in another order). Position-wise layers (Linear, LayerNorm, GELU) just
// run Forward on the new rows; the embedding adds the position embedding of each row's
// absolute position; the attention appends the rows' keys and values to its cache and attends
// over every position so far (the rotary attention turns the new rows' queries and keys to
// their positions first, and caches the keys turned); composite layers decode their children in
// turn. All the built-in
// layers but the loss implement it, on the CPU and on CUDA (ops::AttentionDecode); a
// model with any layer that does not (a custom layer, unless it implements IncrementalDecoder)
// is generated by recomputing the whole window for every token instead (Note [Sampling] in
// train.h).

// What one layer keeps between the Decode calls of one sequence: for the attention, the keys
// and values of the positions decoded so far. Composite layers nest, like Saved.
struct DecodeCache {
  int64_t length = 0;    // positions decoded so far: the next Decode's first position
  int64_t capacity = 0;  // the most positions the sequence may reach (StartDecode's)
  std::vector<Tensor> tensors;
  std::vector<DecodeCache> children;
};

// A layer's incremental decoding (Note [Incremental decoding]). Every call runs on
// ctx.allocator's device, as the Layer passes do; the cache's tensors live there.
class IncrementalDecoder {
 public:
  // Readies `cache` (replacing its contents) for one new sequence of at most `capacity`
  // positions: length 0, and whatever the layer keeps allocated for `capacity` positions.
  // InvalidArgument when capacity < 1 or exceeds what the layer can encode (the embedding's
  // max_seq).
  virtual absl::Status StartDecode(int64_t capacity, const LayerContext& ctx,
                                   DecodeCache* cache) = 0;
  // y for x, the layer's input at the next n = x.dim(1) positions [cache->length,
  // cache->length + n) of the sequence ([1, n] i32 tokens or [1, n, C] f32 activations), as
  // Forward of all length + n positions would give at those rows; appends what later positions
  // need to `cache` and advances cache->length by n. InvalidArgument for another batch size
  // than 1, n < 1 or length + n > capacity (the cache is then unchanged).
  virtual absl::StatusOr<Tensor> Decode(const Tensor& x, const LayerContext& ctx,
                                        DecodeCache* cache) = 0;

 protected:
  ~IncrementalDecoder() = default;  // not owned through this interface
};

class Layer {
 public:
  virtual ~Layer() = default;
  virtual absl::string_view kind() const = 0;

  // Every pass runs on ctx.allocator's device: its inputs, the parameters and the `saved`
  // tensors live there, and it allocates what it returns or keeps from that allocator
  // (ops::ExecOf(ctx), AllocatorOf(ctx)). Inputs are not modified; a pass may keep a reference
  // to them in `saved` (tensors share storage).
  //
  // y = f(x). Fills `*saved` (replacing its contents) with what the backward needs.
  virtual absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx,
                                         Saved* saved) = 0;
  // dx = dL/dx for the output gradient dy of the Forward that filled `saved` (an undefined
  // tensor for token inputs). Adds to `saved` what BackwardWeight needs; a layer without
  // parameters may clear it here.
  virtual absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                               Saved* saved) = 0;
  // Adds (+=, never =) dL/dW of this micro-batch to every Parameter::grad, so gradients sum
  // across micro-batches, then clears `saved`. Runs after BackwardInput of the same `saved`,
  // possibly much later (zero-bubble schedules) and after other micro-batches' passes.
  virtual absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) = 0;
  // Both halves for one micro-batch (what schedules without a separate W pass run): by default
  // BackwardInput, then BackwardWeight. A layer may override it to order its work for the cache
  // (the built-in Linear computes its weight gradient first; composite layers run each child's
  // Backward in turn, while the child's output gradient and saved input are still in cache),
  // provided every gradient is the same operations on the same values as the default.
  virtual absl::StatusOr<Tensor> Backward(const Tensor& dy, const LayerContext& ctx, Saved* saved);

  // Trainable parameters in a fixed order (the layer keeps ownership).
  virtual std::vector<Parameter*> Parameters() { return {}; }

  // Parameters() cut into the groups whose weight gradients are complete together, in the same
  // order (Note [Gradient groups]); the backward completes them last group first. The default is
  // one group. A composite layer that returns its children's groups must call ReportGradients
  // after each child's weight gradients (its Backward or BackwardWeight).
  virtual std::vector<std::vector<Parameter*>> ParameterGroups();

  // (optional) This layer's incremental decoding (Note [Incremental decoding]), owned by the
  // layer; null when it has none: generation then recomputes the whole window per token.
  virtual IncrementalDecoder* decoder() { return nullptr; }
};

// Tells ctx.gradients (if any) that `child`'s weight gradients of this micro-batch are complete.
absl::Status ReportGradients(const LayerContext& ctx, Layer& child);

struct InitContext {
  uint64_t seed = 0;
  int layer_index = 0;  // global index in the LayerGraph
  std::string name;     // the node's name, prefix of every parameter name
  int num_blocks = 1;   // transformer depth, for GPT-2's residual-projection scaling
  Allocator* allocator = nullptr;
  // Tensor parallelism (pipewright/tensor_parallel.h): the layer is built as part `tp_rank` of
  // `tp_size`; a layer without a tensor-parallel form refuses tp_size > 1 or keeps its
  // parameters whole (replicated), as it documents.
  int tp_rank = 0, tp_size = 1;
};

// Describes a layer without allocating it: configuration, cost, and a factory.
class LayerSpec {
 public:
  virtual ~LayerSpec() = default;
  virtual std::string kind() const = 0;
  // Cost for one micro-batch; `input_bytes` is the previous layer's output_bytes (what
  // width-agnostic layers such as GELU and the loss are sized by).
  virtual Cost GetCost(const MicroBatchShape& shape, int64_t input_bytes) const = 0;
  // A new layer with its parameters allocated from init.allocator (the engine passes a host
  // allocator and moves the parameters to the rank's device afterwards) and initialised from
  // (init.seed, parameter names under init.name), e.g. with pipewright/init.h.
  virtual absl::StatusOr<std::unique_ptr<Layer>> Create(const InitContext& init) const = 0;
  // Shape configuration as "key=value,..." for fingerprints and model files.
  virtual std::string Config() const = 0;
  // Shape of the layer's output for an input of shape `input` (activations [B, T, C] f32;
  // token inputs [B, T] i32). The default keeps the input's shape. Used by the pipeline
  // engine to preallocate receive buffers.
  virtual std::vector<int64_t> OutputShape(const std::vector<int64_t>& input) const {
    return input;
  }
  // The earlier node whose weight this layer shares (a tied LM head: the embedding's name), or
  // "". ModelBuilder::Build checks that it names an earlier node.
  virtual std::string tied_to() const { return ""; }
  // The global name of that node's parameter this layer's tied copy stands for (a tied LM head:
  // "<tied_to>.wte.weight"), or "": what the engine matches across ranks without building the
  // layer.
  virtual std::string tied_parameter() const { return ""; }
};

using LayerSpecPtr = std::shared_ptr<const LayerSpec>;

// Built-in layer kinds. Activations are [B, T, C] f32; token inputs/targets are [B, T] i32.
namespace layers {
LayerSpecPtr Linear(int64_t in, int64_t out, bool bias = true);
LayerSpecPtr Gelu();
LayerSpecPtr LayerNorm(int64_t dim, float eps = 1e-5f);
// Linear(dim, hidden) -> GELU -> Linear(hidden, dim)
LayerSpecPtr Mlp(int64_t dim, int64_t hidden);
// qkv Linear(dim, 3 dim) -> causal multi-head attention -> proj Linear(dim, dim)
LayerSpecPtr CausalSelfAttention(int64_t dim, int64_t heads);
// Pre-LN GPT-2 block: x + attn(ln_1(x)), then h + mlp(ln_2(h)).
LayerSpecPtr TransformerBlock(int64_t dim, int64_t heads);
// The Llama family (Note [Llama layers] in runtime/ops/llama_ops.cc; CPU and CUDA; tensor-parallel
// as the GPT layers, Note [Tensor parallelism]). RMSNorm with a weight and no bias:
LayerSpecPtr RmsNorm(int64_t dim, float eps = 1e-5f);
// Token ids [B, T] -> rows of the table "wte.weight" [vocab, dim], no positions (an LmHead
// tied to this layer reads the same table).
LayerSpecPtr TokenEmbedding(int64_t vocab, int64_t dim);
// A Llama decoder block: h = x + o_proj(GQA(rope(qkv(rmsnorm(x))))), out = h +
// down_proj(silu(gate) * up) of rmsnorm(h); heads divisible by kv_heads, an even head dim.
LayerSpecPtr LlamaBlock(int64_t dim, int64_t heads, int64_t kv_heads, int64_t ffn,
                        double rope_theta = 10000, float eps = 1e-5f);
// tokens [B, T] i32 -> wte[token] + wpe[t]
LayerSpecPtr Embedding(int64_t vocab, int64_t max_seq, int64_t dim);
// Linear(dim, vocab) without bias. Untied by default; with `tied_to` the name of an Embedding
// node of the same vocab and dim, its weight is that node's token table "<tied_to>.wte.weight"
// (GPT-2's tied LM head): one tensor when both sit on one rank, two kept equal otherwise
// (Parameter::tied_to).
LayerSpecPtr LmHead(int64_t dim, int64_t vocab, const std::string& tied_to = "");
// logits [B, T, V] + ctx.targets -> [1] mean cross-entropy over tokens
LayerSpecPtr CrossEntropyLoss();
// Synthetic layer for engine overhead benchmarks: identity on [B, T, dim] activations that
// sleeps the given seconds in Forward / BackwardInput / BackwardWeight instead of computing, so
// ranks running on threads do not compete for CPU cores. Has no parameters. Used by
// `pipewright bench --suite overhead`.
LayerSpecPtr Delay(int64_t dim, double forward_s, double backward_input_s,
                   double backward_weight_s);
}  // namespace layers

}  // namespace pipewright

#endif  // PIPEWRIGHT_LAYER_H_
