// Training hyperparameters shared by every way of running a model (TrainOptions), the result of
// one step, the single-stage Trainer (pp = dp = 1: a thin facade over the Engine, engine.h) and
// checkpoint evaluation.
#ifndef PIPEWRIGHT_TRAIN_H_
#define PIPEWRIGHT_TRAIN_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/data.h"
#include "pipewright/model.h"
#include "pipewright/optimizer.h"
#include "pipewright/precision.h"

namespace pipewright {

// How the data-parallel replicas of a stage exchange their gradients (docs/runtime.md, "Gradient
// compression"). kNone: an fp32 all-reduce. kBf16: each replica sends its gradients rounded to
// bf16 (half the bytes), every receiver sums them in fp32 in replica order, and the rounding
// error is carried into the replica's next step (error feedback). kPowerSgd: every 2-D gradient
// is sent as rank-`rank` factors (PowerSGD, Vogels et al. 2019) with error feedback and a
// warm-started Q; 1-D gradients go uncompressed.
struct GradCompression {
  enum class Kind { kNone, kBf16, kPowerSgd };
  Kind kind = Kind::kNone;
  int rank = 0;  // kPowerSgd: the factors' rank, >= 1

  static GradCompression None() { return {}; }
  static GradCompression Bf16() { return {Kind::kBf16, 0}; }
  static GradCompression PowerSgd(int rank) { return {Kind::kPowerSgd, rank}; }
  bool enabled() const { return kind != Kind::kNone; }
  bool operator==(const GradCompression&) const = default;
};
// "none", "bf16", "powersgd:4".
std::string GradCompressionName(const GradCompression& c);
// The inverse of GradCompressionName; InvalidArgument naming the allowed values otherwise (a
// PowerSGD rank must be an integer in [1, 1024]).
absl::StatusOr<GradCompression> ParseGradCompression(absl::string_view name);

// How the data-parallel replicas of a stage combine their work (docs/runtime.md, "Asynchronous
// data parallelism"). kSync: every step sums every replica's gradients and applies one update
// everywhere (bit-reproducible). kAsync: bounded-staleness asynchronous updates (stale-synchronous
// parallel): each stage's parameters and optimizer state are owned in shards by its replicas,
// each replica's gradient is applied by the owners as soon as it arrives, and a replica runs
// ahead of the slowest one by at most `staleness` steps.
enum class DpMode { kSync, kAsync };
absl::StatusOr<DpMode> ParseDpMode(absl::string_view name);  // "sync" or "async"

struct TrainOptions {
  int64_t steps = 60;  // the run's length: the LR schedule's warm-up and cosine decay span it
  uint64_t seed = 1;   // weights (and, by convention, the dataset the caller opens)
  float lr = 3e-3f;    // for `base_batch` sequences; see lr_scaling
  LrScaling lr_scaling = LrScaling::kNone;
  int64_t base_batch = 32;  // the batch `lr` was tuned for (linear scaling rule)
  int64_t warmup_steps = 5;
  float min_lr_ratio = 0.1f;  // in [0, 1]
  float clip_norm = 1.0f;     // finite, >= 0; 0 disables clipping
  OptimizerConfig optimizer;
  Precision precision = Precision::kFp32;   // mixed precision: precision.h
  LossScaleOptions loss_scale;              // fp16 only
  int64_t bucket_bytes = int64_t{1} << 20;  // gradient all-reduce bucket size
  // Needs dp > 1 and fp32 or bf16 precision; every replica's state is checkpointed.
  GradCompression grad_compression;
  // kAsync needs dp >= 2, the CPU, fp32 or bf16, no gradient compression and a backend whose
  // point-to-point operations may be posted from two threads (local, mpi).
  DpMode dp_mode = DpMode::kSync;
  // The sharded optimizer (docs/runtime.md, "ZeRO"). 1 (ZeRO-1): each data-parallel replica owns
  // an even share of every gradient bucket's elements, receives their sum by a reduce-scatter,
  // keeps and applies their optimizer state, and all-gathers the new values: the all-reduce's
  // traffic, 1/dp of the optimizer state; losses and weights bit-identical to 0. 2 (ZeRO-2): the
  // same, and each micro-batch's gradient is reduce-scattered as its bucket completes, so the
  // gradient buffers shrink to 1/dp too, for M times the reduce-scatter traffic; losses agree
  // with 0 to fp32 rounding. Needs dp >= 2, synchronous DP and no gradient compression.
  int zero = 0;
  // ZeRO-2's bucket-sized gradient buffers per stage: 2 lets a bucket's reduce-scatter run while
  // the backward fills the next bucket; 1 waits for it before the backward goes on (one bucket
  // less memory, no overlap: DeepSpeed's overlap_comm = false). Results do not depend on it.
  int zero_buffers = 2;
  int staleness = 1;  // kAsync: the most steps a replica may run ahead of the slowest (>= 0)
  // Threads each CPU rank runs its kernels on (its own thread included): matrix products and
  // the row-parallel kernels split their work over them. 0 = automatic: the CPU cores this
  // process may use, divided among the ranks it runs (and, under a launcher, among the
  // processes on the node), at least 1; ranks on a GPU use 1. Results do not depend on it
  // (docs/runtime.md, "Threads per rank").
  int threads_per_rank = 0;
  // Loader workers per data-loading rank (docs/data.md, "Loader"): >= 1 threads build whole
  // steps ahead into a bounded queue; 0 builds each step on the rank's own thread when it is
  // needed. Results do not depend on it.
  int data_workers = 1;
  // (A straggler and fault injection, for tests and benchmarks, are TrainTestingHooks:
  // train_testing.h.)
};

// Note [Field names in errors]. The one check of a TrainOptions (Engine::Create calls it; so can
// a front end, before it builds anything) for a run of `data_parallel` replicas
// (RunSpec.data_parallel). InvalidArgument naming the field as `TrainOptions.<field>` and a value
// as `TrainOptions.<field> = <value>`: "TrainOptions.staleness = -1: must be >= 0 (0:
// lock-step)", "TrainOptions.dp_mode = async needs data parallelism (RunSpec.data_parallel >=
// 2): ...". Every library message names what a C++ caller set that way (`RunSpec.recompute`,
// `PartitionOptions.pp`, `WorldOptions.device`, `LossScaleOptions.initial_scale`, ...) and never
// a command-line flag; the `pipewright` CLI rewrites those names into its flags through one table
// (tools/flags.h, FieldFlags), so it says "--staleness -1: must be >= 0 (0: lock-step)".
// Checked: steps >= 0; lr finite and > 0; min_lr_ratio in [0, 1]; clip_norm finite and >= 0;
// optimizer.weight_decay finite and >= 0; warmup_steps >= 0; base_batch >= 1; loss_scale
// (LossScaler::Validate) under fp16; bucket_bytes >= 1; threads_per_rank in [0, 255];
// data_workers in [0, 64]; staleness >= 0; zero 0, 1 or 2; zero_buffers 1 or 2 (1 only with zero
// 2); and what combines: gradient compression not with fp16 and only with dp >= 2, ZeRO-1 only with
// dp >= 2 and synchronous DP, asynchronous DP only with dp >= 2, fp32 or bf16 and no compression.
// (What needs the world or the model as well — async DP on the CPU, with concurrent point-to-point
// and no tied weight split across pipeline ranks — Engine::Create checks, in the same terms.)
absl::Status ValidateTrainOptions(const TrainOptions& options, int data_parallel);

struct StepResult {
  int64_t step = 0;  // 0-based index of the step just taken
  double loss = 0;   // mean over the global batch
  float lr = 0;
  double grad_norm = 0;  // before clipping
  double step_time_s = 0;
  double samples_per_s = 0;
  double data_wait_s = 0;
  // fp16: the loss scale the step ran with, and whether it was skipped because a loss or a
  // gradient was not finite on some rank (weights and optimizer state unchanged).
  float loss_scale = 1.0f;
  bool skipped = false;
  // Some process of the run had RequestStop() called before this step's agreement: every rank
  // sees it after the same step, so a launcher's processes stop together.
  bool stop_requested = false;
};

// Process-wide preemption request: the CLI's SIGTERM / SIGINT / SIGUSR1 handler calls
// RequestStop (async-signal-safe: it sets an atomic flag); the next step agreement carries it to
// every rank (StepResult::stop_requested). ClearStopRequest resets it (tests).
void RequestStop();
bool StopRequested();
void ClearStopRequest();

// pp = dp = 1 on the CPU: the Engine with a one-stage 1F1B program over `micro_batches`
// micro-batches, in this thread's process.
class Trainer {
 public:
  // Instantiates every layer of `graph` on one CPU stage. `data` null = SyntheticDataset of the
  // graph's sequence length and options.seed.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const LayerGraph& graph, int64_t micro_batches, const TrainOptions& options,
      std::shared_ptr<const Dataset> data = nullptr);
  ~Trainer();

  // One optimizer step over micro_batches x micro_batch_size sequences. A non-finite loss or
  // gradient is an error and leaves the weights unchanged, except with fp16 loss scaling,
  // where it skips the step (StepResult::skipped) and backs the scale off.
  absl::StatusOr<StepResult> Step();
  int64_t step() const;
  int64_t global_batch() const;
  float PeakLr() const;

  // Checkpoint (docs/checkpoint.md): weights, optimizer moments, step, data position, seed.
  absl::Status Save(const std::string& dir) const;
  // Loads a checkpoint written by Save (or by the Engine under any plan) for the same model and
  // global batch; training then continues bit-identically to an uninterrupted run.
  absl::Status Resume(const std::string& dir);

  // Current and peak bytes of the stage's allocator (weights, grads, state, activations); the
  // peak restarts at every step.
  int64_t peak_memory_bytes() const;
  int64_t current_memory_bytes() const;
  std::vector<Parameter*> Parameters() const;

 private:
  explicit Trainer(std::unique_ptr<class Engine> engine);
  std::unique_ptr<class Engine> engine_;
};

// Mean loss of the model in checkpoint `dir` over `batches` batches of `data` drawn from a
// held-out stream (sample indices from 2^40, far from any training step). `graph` must be the
// model the checkpoint was written for (its fingerprint); its weights come from `dir`, read as
// ReadCheckpoint reads (a checkpoint directory's newest one that verifies and fits the model).
// Before reading or instantiating anything, a model too big for this machine is refused
// (CheckEvaluationMemory, run_memory.h: FailedPrecondition naming what it would need).
struct EvalResult {
  double loss = 0;
  double perplexity = 0;
  int64_t tokens = 0;
  std::string model;
  int64_t step = 0;
  // The evaluated batches' tokens and next-token targets, [B, T] i32 each (`eval --dump`), so
  // another implementation can check the loss on the same tokens.
  std::vector<Tensor> inputs, targets;
  std::string path;                   // the checkpoint evaluated (a step checkpoint of a directory)
  std::vector<std::string> warnings;  // what reading it skipped (ReadCheckpoint)
};
absl::StatusOr<EvalResult> EvaluateCheckpoint(const LayerGraph& graph, const std::string& dir,
                                              const Dataset& data, int64_t batches);
// The same held-out loss for weights in memory (Engine::Weights(): every parameter by global
// name, tied copies as their owner) instead of a checkpoint: what `train --eval-every` runs on
// its validation data. `stage` caches the instantiated model between calls (null: made here).
absl::StatusOr<EvalResult> EvaluateWeights(
    const LayerGraph& graph, const std::vector<std::pair<std::string, Tensor>>& weights,
    const Dataset& data, int64_t batches, std::unique_ptr<Stage>* stage);
// The graph of a checkpoint whose model is a GPT (its manifest's model.gpt architecture) or a
// preset (model.preset, recorded only when the trained graph was exactly that preset's), checked
// by fingerprint. InvalidArgument naming the model for a custom one, whose LayerGraph only its
// author can build.
absl::StatusOr<LayerGraph> CheckpointPresetModel(const std::string& dir);
// EvaluateCheckpoint of a preset checkpoint on OpenDataset(`data`) with the checkpoint's seed:
// what `pipewright eval` runs.
absl::StatusOr<EvalResult> EvaluateCheckpoint(const std::string& dir, const std::string& data,
                                              int64_t batches);

// Text from a checkpoint's byte-level language model (`pipewright generate`).
//
// Note [Sampling]. Each new token comes from the logits at the last position of a window of
// the latest tokens (the prompt's bytes, then what was generated; a causal model's last position
// sees exactly its window): temperature 0 takes the most likely token (the smaller id on a tie);
// otherwise the top_k most likely (0: all) are drawn from with probabilities softmax(logit /
// temperature), by a SplitMix64 stream from `seed`, so a seed gives the same text on every
// machine whose kernels give the same logits.
//
// The window, with a KV cache (kv_cache, the default, when every layer up to the logits has an
// incremental decoder: all the built-in ones do, Note [Incremental decoding] in layer.h): the
// last min(T, prompt length) tokens (T = the model's seq_len) are run once (a prefill), and then
// each new token costs one position: every transformer block appends that position's keys and
// values to its cache, the embedding adds the position embedding of the token's position in
// the window, and the final norm and LM head run on that one row. The learned positions end at
// T, so when a new token finds the window full (T positions), the window becomes the last
// max(1, T / 2) tokens (the new one included), prefilled again at positions 0 .. T/2 - 1, and
// decoding continues cached: windows grow from T/2 to T tokens, and a window refill costs one
// prefill of T/2 positions every T/2 tokens. Without the cache (kv_cache false, or a model with
// a layer that has no decoder, e.g. a custom one) every token recomputes the forward of a window
// that slides by one: the last min(T, length) tokens. The two agree (to fp32 rounding) while the
// text fits T; past it the cached windows are shorter, so the texts may differ.
//
// The device: the CPU, or a GPU (device = cuda:N), where the weights are copied after reading
// and every layer runs its CUDA kernels (the decoding attention too: kernels/cuda/
// attention_decode.cu); only the last position's logits come back to the host, where the token
// is drawn as on the CPU. The logits agree with the CPU's to fp32 rounding, so a greedy text is
// the same unless two logits are within rounding of each other.
inline constexpr int64_t kMaxGenerateTokens = int64_t{1} << 20;
struct GenerateOptions {
  std::string prompt;  // bytes; empty: a newline
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  uint64_t seed = 1;
  // Decode with a KV cache where the model allows (above); false recomputes the window for
  // every token (the reference path: slower, windows that slide by one).
  bool kv_cache = true;
  Device device = Device::Cpu();  // cpu, or cuda:N (above)
};
struct GenerateResult {
  std::string model, path;  // the checkpoint read (a step checkpoint of a directory)
  int64_t step = 0;
  std::string prompt, text;  // text: the generated bytes only
  int64_t tokens = 0;
  double seconds = 0;                 // generation only, not the checkpoint's reading
  bool kv_cache = false;              // whether the cached path ran (Note [Sampling])
  std::string device;                 // where it ran: "cpu", "cuda:0"...
  std::vector<std::string> warnings;  // what reading it skipped (ReadCheckpoint)
};
// `emit` (optional) receives each token's bytes as it is generated. InvalidArgument for options
// out of range or a model that is not a byte-level language model; as EvaluateCheckpoint for a
// checkpoint that cannot be read or does not fit this machine.
absl::StatusOr<GenerateResult> GenerateFromCheckpoint(
    const std::string& dir, const GenerateOptions& options,
    const std::function<void(const std::string&)>& emit = nullptr);

}  // namespace pipewright

#endif  // PIPEWRIGHT_TRAIN_H_
