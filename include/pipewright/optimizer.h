// Optimizers (AdamW, SGD with momentum), learning-rate schedules and the linear scaling rule,
// gradient clipping by global norm. Optimizer state is per parameter and named
// "<state>.<parameter name>" so it checkpoints with global, plan-independent names.
#ifndef PIPEWRIGHT_OPTIMIZER_H_
#define PIPEWRIGHT_OPTIMIZER_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/layer.h"

namespace pipewright {

enum class OptimizerKind { kAdamW, kSgd };
absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);  // "adamw" | "sgd"

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;  // AdamW
  float momentum = 0.9f;                           // SGD
  float weight_decay = 0.1f;  // applied only to parameters with weight_decay = true
};

class Optimizer {
 public:
  // The optimizer does not own the parameters; they must outlive it.
  static std::unique_ptr<Optimizer> Create(const OptimizerConfig& config,
                                           std::vector<Parameter*> params,
                                           Allocator* allocator = nullptr);
  // One update of every parameter from its grad times `grad_scale` at learning rate `lr`, on
  // the allocator's device (CUDA: one multi-tensor AdamW launch). The same bits as
  // ScaleGrads(grad_scale) then Step(lr), but AdamW on the CPU reads each gradient once and
  // leaves it unscaled (clipping without a pass of its own). Does not zero grads.
  absl::Status Step(float lr, float grad_scale = 1.0f);
  int64_t step_count() const { return step_; }
  // Bytes of optimizer state (moments or momentum) this optimizer holds.
  int64_t StateBytes() const;
  // The updates taken so far (AdamW's bias correction counts them), for state assembled from
  // elsewhere (asynchronous DP's owners).
  void set_step_count(int64_t step) { step_ = step; }
  // State tensors ("exp_avg.<name>", "exp_avg_sq.<name>" or "momentum_buffer.<name>"), tied
  // copies left out (their state equals their owner's: Note [Tied parameters]).
  std::vector<std::pair<std::string, Tensor>> State() const;
  // Restores state written by State(); every tensor must be present with the right shape. A
  // tied copy takes its owner's (StoredName).
  absl::Status LoadState(const std::map<std::string, Tensor>& state, int64_t step);

 private:
  Optimizer(const OptimizerConfig& config, std::vector<Parameter*> params, Allocator* allocator);
  OptimizerConfig config_;
  Allocator* allocator_ = nullptr;  // where the state lives and the update runs
  std::vector<Parameter*> params_;
  std::vector<Tensor> m_, v_;  // AdamW moments, or SGD momentum buffer in m_
  int64_t step_ = 0;
};

// The gradient helpers run where the gradients live; `exec` is the allocator whose device (and
// CUDA stream) runs them (nullptr: the host).
void ZeroGrads(const std::vector<Parameter*>& params);
// Sum of squares of every gradient, in double (combine across stages before the sqrt). Tied
// copies are skipped: after the tie reduction their owner holds the same summed gradient.
absl::StatusOr<double> GradSquaredNorm(const std::vector<Parameter*>& params,
                                       Allocator* exec = nullptr);
// Multiplies every gradient by `scale`.
absl::Status ScaleGrads(const std::vector<Parameter*>& params, float scale,
                        Allocator* exec = nullptr);
// Scale factor that clips a gradient of global norm `norm` to `max_norm` (1 when not needed or
// max_norm <= 0).
float ClipScale(double norm, float max_norm);
bool GradsFinite(const std::vector<Parameter*>& params);  // host gradients

// Linear warm-up from 0 to `peak` over `warmup_steps`, then cosine decay to min_ratio * peak
// at `total_steps`. Steps count from 0.
struct LrSchedule {
  float peak = 1e-3f;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  float min_ratio = 0.1f;
  float At(int64_t step) const;
};

enum class LrScaling { kNone, kLinear, kSqrt };
absl::StatusOr<LrScaling> ParseLrScaling(absl::string_view name);  // "none" | "linear" | "sqrt"
// The linear scaling rule (Goyal et al. 2017): lr = base_lr * global_batch / base_batch; the
// square-root rule, gentler and the usual one for Adam-family optimizers (Krizhevsky 2014; Malladi
// et al. 2022): lr = base_lr * sqrt(global_batch / base_batch).
float ScaleLearningRate(float base_lr, int64_t global_batch, int64_t base_batch, LrScaling scaling);

}  // namespace pipewright

#endif  // PIPEWRIGHT_OPTIMIZER_H_
