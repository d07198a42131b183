// The two files the partitioner reads and writes (docs/plan.schema.json, docs/memory.md):
//
//  * a layer graph's costs, `pipewright.model/v1` (ModelCosts): one entry per layer with its
//    parameters, FLOPs, saved and output bytes for one micro-batch, and measured times when
//    the layer was profiled;
//  * a partition plan, `pipewright.plan/v1` (Plan): which contiguous layers each pipeline stage
//    runs, on which rank, with which schedule and recomputation, and what the partitioner
//    predicts for time and memory.
//
// Reading validates everything and reports every problem as "path: message"
// ("stages[2].layers: range [10, 8) is empty"), so a bad plan never reaches the runtime.
#ifndef PIPEWRIGHT_PLAN_H_
#define PIPEWRIGHT_PLAN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/schedule.h"

namespace pipewright {

inline constexpr char kModelFormat[] = "pipewright.model/v1";
inline constexpr char kPlanFormat[] = "pipewright.plan/v1";

// Limits of the two documents (docs/plan.md, "Limits"), checked while the text is parsed, before
// any rule, so a hostile file is refused in time linear in its size and memory linear in the
// limits. Files are also at most kMaxJsonFileBytes and nest at most kMaxJsonDepth
// (pipewright/input.h); texts handed to the parsers are nesting-checked here too.
//
// Stages of a plan (pipeline_parallel x chunks): far above any real pipeline (p = 128, v = 4 is
// 512), and every stage needs a layer of its own.
inline constexpr int kMaxPlanStages = 1 << 16;
// Layers of a layer graph (a transformer block is one layer): 64 MiB holds about 400,000.
inline constexpr int kMaxModelLayers = 1 << 18;
// JSON values (scalars, arrays and objects) of either document: a plan of kMaxPlanStages stages
// has about 1,000,000 and a layer graph of kMaxModelLayers layers under 3,700,000. It bounds
// the parsed document's memory (about 100 bytes a value at worst) whatever the text holds.
inline constexpr int64_t kMaxJsonValues = int64_t{1} << 22;
// Problems listed by one validation; the rest are counted in a last "N more problems" entry.
inline constexpr int kMaxListedProblems = 1000;

// Activation recomputation of one stage: keep every layer's saved tensors (none); keep what the
// matrix products need but remake the cheap pointwise outputs in the backward (selective: a
// transformer block's LayerNorm and GELU outputs, LayerContext::selective_recompute); or keep
// only the stage input, recomputing the forward before the backward (full).
enum class Recompute { kNone, kFull, kSelective };
absl::StatusOr<Recompute> ParseRecompute(absl::string_view name);  // "none" | "selective" | "full"
const char* RecomputeName(Recompute r);

// ---------------------------------------------------------------------------------------------
// pipewright.model/v1: per-layer costs for one micro-batch of (micro_batch_size, seq_len).

struct LayerCost {
  std::string name;  // unique, e.g. "blocks.3"
  std::string kind;  // the LayerSpec kind, e.g. "transformer_block"
  int64_t params = 0;
  double forward_flops = 0;
  double backward_flops = 0;     // input + weight gradients
  int64_t activation_bytes = 0;  // saved between forward and backward
  int64_t output_bytes = 0;      // what a stage boundary after this layer sends
  // Measured seconds per micro-batch (`pipewright model --profile`); they replace the
  // FLOP-derived times when present.
  std::optional<double> forward_time_s, backward_time_s;
  // Cost::selective_saving_bytes / selective_recompute_flops (0: no selective mode).
  int64_t selective_saving_bytes = 0;
  double selective_recompute_flops = 0;
  // Cost::largest_group_params: ZeRO-2's gradient buckets may close between groups (0: the
  // layer is one group).
  int64_t largest_group_params = 0;
  // Name of an earlier layer whose parameters these are (a tied LM head). The stage holding
  // this layer still stores (and all-reduces) a copy, so memory counts them; the model's
  // unique parameter count does not.
  std::string tied_to;
};

// The dimensions tensor parallelism splits (Megatron-LM: attention heads and the MLP hidden size
// column-wise, the vocabulary of the embedding, LM head and loss), for a GPT or Llama layer
// graph: an embedding, transformer or Llama blocks, a final norm, an LM head and a cross-entropy
// loss (docs/memory.md, "Tensor parallelism"). A layer graph without it can be planned at tensor
// parallel degree 1 only.
struct TransformerShape {
  int64_t hidden = 0;      // h
  int64_t heads = 0;       // a
  int64_t ffn_hidden = 0;  // the MLP's inner size (4h in a GPT; a Llama's ffn)
  int64_t vocab = 0;       // V
  int64_t kv_heads = 0;    // key-value heads of grouped-query attention; 0: as many as heads
  int64_t KvHeads() const { return kv_heads > 0 ? kv_heads : heads; }
};

struct ModelCosts {
  std::string name;
  std::string fingerprint;  // LayerGraph::Fingerprint() of the model these costs describe
  int64_t micro_batch_size = 1;
  int64_t seq_len = 1;
  int64_t input_bytes = 0;  // bytes of one micro-batch's input to layer 0 (token ids)
  std::vector<LayerCost> layers;
  // Optional in the JSON ("transformer"): what tensor parallelism splits.
  std::optional<TransformerShape> transformer;

  int num_layers() const { return static_cast<int>(layers.size()); }
  int64_t UniqueParams() const;  // parameters not tied to an earlier layer
  // The same model at another micro-batch size: FLOPs, bytes and times scale linearly.
  ModelCosts WithMicroBatchSize(int64_t micro_batch_size) const;
};

// JSON text <-> ModelCosts. Parsing validates types, ranges, unique names and tied_to.
std::string ModelCostsToJson(const ModelCosts& model);
absl::StatusOr<ModelCosts> ModelCostsFromJson(absl::string_view text);

// ---------------------------------------------------------------------------------------------
// pipewright.plan/v1 (DESIGN.md "Formats").

struct StageMemory {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, total = 0;
};

struct PlanStage {
  int index = 0;
  int rank = 0;            // pipeline rank; StageRank(spec, index)
  int begin = 0, end = 0;  // layers [begin, end) of the layer graph
  Recompute recompute = Recompute::kNone;
  double forward_s = 0;   // predicted seconds per micro-batch
  double backward_s = 0;  // input + weight gradients, plus the recomputed forward
  StageMemory memory;     // predicted bytes on the stage's device
};

struct PlanPrediction {
  double step_time_s = 0;
  double bubble_fraction = 0;
  double samples_per_s = 0;
  int64_t peak_memory_bytes = 0;  // largest per-device total
  int bottleneck_stage = 0;       // stage with the largest per-micro-batch time
  // Step time of the same schedule with every stage at max(sum / stages, largest layer), no
  // communication and no recomputation: no contiguous split can beat it.
  double lower_bound_step_time_s = 0;
  double lower_bound_gap = 0;  // step_time_s / lower_bound_step_time_s - 1
};

struct Plan {
  std::string model_name;
  int num_layers = 0;
  std::string fingerprint;
  int devices = 1;
  int64_t device_memory_bytes = 0;
  int pipeline_parallel = 1;
  int data_parallel = 1;
  // ZeRO (TrainOptions::zero): 1, the distributed optimizer, splits each stage's optimizer state
  // over its data_parallel replicas; 2 splits its gradients too (reduce-scattered every
  // micro-batch). Optional in the JSON ("zero", default 0); 1 and 2 need data_parallel >= 2.
  int zero = 0;
  // Tensor parallelism (Megatron-LM): each of the pipeline_parallel x data_parallel ranks is a
  // group of tensor_parallel devices that split every layer's heads, MLP hidden size and
  // vocabulary; sequence_parallel also splits the LayerNorm and residual regions along the
  // sequence. Optional in the JSON ("tensor_parallel", default 1; "sequence_parallel", default
  // false, true only with tensor_parallel >= 2). devices = pipeline_parallel x data_parallel x
  // tensor_parallel, and every predicted figure is one device's.
  int tensor_parallel = 1;
  bool sequence_parallel = false;
  ScheduleSpec schedule;          // kind, ranks (= pipeline_parallel), micro_batches, chunks
  int64_t micro_batch_size = 1;   // sequences per micro-batch
  std::vector<PlanStage> stages;  // model order; pipeline_parallel * chunks of them
  PlanPrediction predicted;

  int64_t global_batch() const {
    return int64_t{data_parallel} * schedule.micro_batches * micro_batch_size;
  }
  // Stage layer boundaries: stages + 1 increasing indices from 0 to num_layers.
  std::vector<int> Boundaries() const;
};

std::string PlanToJson(const Plan& plan);

// Every problem of a plan's JSON, one "path: message" per entry (empty = valid); `model`,
// when given, is checked too (name, layer count and fingerprint). Malformed JSON is one
// problem, never an exception.
std::vector<std::string> ValidatePlanJson(absl::string_view text,
                                          const ModelCosts* model = nullptr);
// Structural rules of an in-memory plan (the same rules, after parsing).
std::vector<std::string> ValidatePlan(const Plan& plan, const ModelCosts* model = nullptr);
// Parses and validates; the error lists every problem, one per line.
absl::StatusOr<Plan> PlanFromJson(absl::string_view text, const ModelCosts* model = nullptr);

}  // namespace pipewright

#endif  // PIPEWRIGHT_PLAN_H_
