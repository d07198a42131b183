// Single-stage training (pp = 1, dp = 1): the layer code the pipeline engine runs, driven
// through whole steps with gradient accumulation over micro-batches, clipping, an optimizer and
// an LR schedule, plus checkpoint save/resume and evaluation. The multi-rank Engine (engine.h,
// runtime issue) generalises this loop; both share Stage, Optimizer and the data loader.
#ifndef PIPEWRIGHT_TRAIN_H_
#define PIPEWRIGHT_TRAIN_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "pipewright/data.h"
#include "pipewright/model.h"
#include "pipewright/optimizer.h"
#include "pipewright/precision.h"

namespace pipewright {

struct TrainOptions {
  std::string preset = "gpt-tiny";  // recorded in checkpoints so eval can rebuild the model
  int64_t micro_batches = 4;
  int64_t steps = 60;
  uint64_t seed = 1;
  std::string data = "synthetic";
  float lr = 3e-3f;  // for `base_batch` sequences; see lr_scaling
  LrScaling lr_scaling = LrScaling::kNone;
  int64_t base_batch = 32;  // the batch `lr` was tuned for (linear scaling rule)
  int64_t warmup_steps = 5;
  float min_lr_ratio = 0.1f;
  float clip_norm = 1.0f;  // <= 0 disables clipping
  OptimizerConfig optimizer;
  Precision precision = Precision::kFp32;  // mixed precision: precision.h
  LossScaleOptions loss_scale;             // fp16 only
};

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
};

class Trainer {
 public:
  // Instantiates every layer of `graph` on one CPU stage.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const LayerGraph& graph,
                                                         const TrainOptions& options);
  ~Trainer();

  // One optimizer step over micro_batches x micro_batch_size sequences. A non-finite loss or
  // gradient is an error and leaves the weights unchanged, except with fp16 loss scaling,
  // where it skips the step (StepResult::skipped) and backs the scale off.
  absl::StatusOr<StepResult> Step();
  int64_t step() const { return step_; }
  int64_t global_batch() const { return layout_.global_batch(); }
  float PeakLr() const;

  // Checkpoint (docs/checkpoint.md): weights, optimizer moments, step, data position, seed.
  absl::Status Save(const std::string& dir) const;
  // Loads a checkpoint written by Save for the same model and global batch; training then
  // continues bit-identically to an uninterrupted run.
  absl::Status Resume(const std::string& dir);

  // Peak and current bytes of this stage's allocator (weights, grads, state, activations).
  int64_t peak_memory_bytes() const;
  int64_t current_memory_bytes() const;
  std::vector<Parameter*> Parameters() const;

 private:
  Trainer() = default;
  LayerGraph graph_;  // the trainer's own copy
  TrainOptions options_;
  BatchLayout layout_;
  std::unique_ptr<CpuAllocator> allocator_;
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<Optimizer> optimizer_;
  std::shared_ptr<const Dataset> data_;
  std::unique_ptr<DataLoader> loader_;
  LrSchedule schedule_;
  LossScaler scaler_;  // fp16 only
  int64_t step_ = 0;
};

// Mean loss of the model in checkpoint `dir` over `batches` batches of `data` ("synthetic" or a
// path) drawn from a held-out stream (seed-independent of training: sample indices from 2^40).
struct EvalResult {
  double loss = 0;
  double perplexity = 0;
  int64_t tokens = 0;
  std::string model;
  int64_t step = 0;
};
absl::StatusOr<EvalResult> EvaluateCheckpoint(const std::string& dir, const std::string& data,
                                              int64_t batches);

}  // namespace pipewright

#endif  // PIPEWRIGHT_TRAIN_H_
