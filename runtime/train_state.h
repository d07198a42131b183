// Checkpoint manifest shared by the single-stage Trainer and the pipeline Engine, so a
// checkpoint written by either (under any plan) resumes in the other.
#ifndef PIPEWRIGHT_RUNTIME_TRAIN_STATE_H_
#define PIPEWRIGHT_RUNTIME_TRAIN_STATE_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/checkpoint.h"
#include "pipewright/data.h"
#include "pipewright/model.h"
#include "pipewright/optimizer.h"
#include "pipewright/precision.h"
#include "pipewright/train.h"

namespace pipewright::internal {

struct ManifestInfo {
  const LayerGraph* graph = nullptr;
  const TrainOptions* options = nullptr;
  std::string data_source;  // Dataset::Describe()
  BatchLayout layout;
  int pp = 1, dp = 1, tp = 1, chunks = 1;
  bool sequence_parallel = false;
  std::string schedule = "1f1b";
  int64_t step = 0;            // next step to run
  int64_t optimizer_step = 0;  // optimizer updates applied
  LrSchedule lr;
  const LossScaler* scaler = nullptr;  // recorded when enabled (fp16)
  // Written as "grad_sync" when options->grad_compression is enabled: the compression, dp and tp
  // the checkpoint's grad_sync.safetensors (every replica's state, per tensor-parallel part)
  // belongs to.
};
// The manifest's JSON text (docs/checkpoint.md). model.preset is written only when the graph is
// exactly that preset's (same name and fingerprint), so a custom model is never mistaken for a
// preset; model.layers records every node's name, kind and configuration.
std::string BuildManifest(const ManifestInfo& info);

struct ResumePoint {
  int64_t step = 0;
  int64_t optimizer_step = 0;
  // The fp16 loss scaler's state, when the checkpoint has one ("precision.loss_scale").
  bool has_loss_scale = false;
  float loss_scale = 1.0f;
  int64_t loss_scale_good_steps = 0, skipped_steps = 0;
  // "grad_sync": the gradient compression whose per-replica state the checkpoint holds ("" when
  // none), and the replica count it was written with.
  std::string grad_compression;
  int grad_sync_dp = 0;
  int grad_sync_tp = 1;  // the tensor-parallel size (each part's state is its own)
  // Settings of this run that differ from the checkpoint's but may (a longer schedule, other
  // data, another dp): one line each, saying what changes (docs/checkpoint.md, "Resume checks").
  std::vector<std::string> warnings;
};
// This run's settings a resume compares with the checkpoint's manifest, beyond the model, the
// data position and the optimizer kind.
struct RunSettings {
  uint64_t seed = 0;
  std::string data_source;  // Dataset::Describe()
  LrSchedule lr;
  OptimizerConfig optimizer;
  Precision precision = Precision::kFp32;
  BatchLayout layout;
};
// Restores `scaler` from `at` when both use loss scaling (a checkpoint from an fp32/bf16 run
// starts fp16 at the configured initial scale, and vice versa the state is ignored).
void RestoreLossScaler(const ResumePoint& at, LossScaler* scaler);
// Checks a checkpoint's manifest against this run: format, model fingerprint, data position
// (same global batch) and optimizer kind; with `run`, also the seed (refused when it differs:
// the sample order depends on it) and, as warnings, the learning-rate schedule, the optimizer's
// hyperparameters, the precision, the data and the batch layout. Errors name `dir`/manifest.json
// and the field.
absl::StatusOr<ResumePoint> CheckManifest(const std::string& dir, const std::string& manifest_json,
                                          const LayerGraph& graph, const BatchLayout& layout,
                                          OptimizerKind optimizer,
                                          const RunSettings* run = nullptr);
// Checks that every parameter is in `tensors` (from `dir`) with its shape, in f32.
absl::Status CheckParameters(const std::string& dir, const std::map<std::string, Tensor>& tensors,
                             const std::vector<Parameter*>& params);

// The checkpoint ReadCheckpoint(dir) reads whose manifest describes a model this runtime can
// rebuild (a GPT's model.gpt or a preset, checked by fingerprint), with that model's graph
// (runtime/evaluate.cc: eval and the Hugging Face export).
absl::StatusOr<std::pair<Checkpoint, LayerGraph>> ReadCheckpointAndGraph(const std::string& dir);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_TRAIN_STATE_H_
