#include "pipewright/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_kernels.h"

namespace pipewright {

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  if (name == "adamw") return OptimizerKind::kAdamW;
  if (name == "sgd") return OptimizerKind::kSgd;
  return absl::InvalidArgumentError(absl::StrCat("unknown optimizer '", name, "' (adamw, sgd)"));
}

std::unique_ptr<Optimizer> Optimizer::Create(const OptimizerConfig& config,
                                             std::vector<Parameter*> params, Allocator* allocator) {
  return std::unique_ptr<Optimizer>(new Optimizer(config, std::move(params), allocator));
}

Optimizer::Optimizer(const OptimizerConfig& config, std::vector<Parameter*> params,
                     Allocator* allocator)
    : config_(config), params_(std::move(params)) {
  for (Parameter* p : params_) {
    m_.push_back(Tensor::Zeros(p->value.shape(), DType::kF32, allocator));
    if (config_.kind == OptimizerKind::kAdamW) {
      v_.push_back(Tensor::Zeros(p->value.shape(), DType::kF32, allocator));
    }
  }
}

void Optimizer::Step(float lr) {
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter* p = params_[i];
    float wd = p->weight_decay ? config_.weight_decay : 0.0f;
    size_t n = p->value.numel();
    if (config_.kind == OptimizerKind::kAdamW) {
      cpu::AdamWUpdate(p->value.data<float>(), p->grad.data<float>(), m_[i].data<float>(),
                       v_[i].data<float>(), n, lr, config_.beta1, config_.beta2, config_.eps, wd,
                       step_);
    } else {
      cpu::SgdMomentumUpdate(p->value.data<float>(), p->grad.data<float>(), m_[i].data<float>(), n,
                             lr, config_.momentum, wd);
    }
  }
}

std::vector<std::pair<std::string, Tensor>> Optimizer::State() const {
  std::vector<std::pair<std::string, Tensor>> out;
  bool adam = config_.kind == OptimizerKind::kAdamW;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(absl::StrCat(adam ? "exp_avg." : "momentum_buffer.", params_[i]->name), m_[i]);
    if (adam) out.emplace_back(absl::StrCat("exp_avg_sq.", params_[i]->name), v_[i]);
  }
  return out;
}

absl::Status Optimizer::LoadState(const std::map<std::string, Tensor>& state, int64_t step) {
  // Validate everything first so a failure leaves the optimizer untouched.
  std::vector<std::pair<Tensor*, const Tensor*>> copies;
  auto named = State();
  for (size_t i = 0; i < named.size(); ++i) {
    auto it = state.find(named[i].first);
    if (it == state.end()) {
      return absl::NotFoundError(absl::StrCat("optimizer state '", named[i].first, "' missing"));
    }
    if (it->second.shape() != named[i].second.shape() || it->second.dtype() != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", named[i].first,
                                                     "' has shape ", it->second.ShapeString(),
                                                     ", expected ", named[i].second.ShapeString()));
    }
  }
  bool adam = config_.kind == OptimizerKind::kAdamW;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = params_[i]->name;
    const Tensor& m = state.at(absl::StrCat(adam ? "exp_avg." : "momentum_buffer.", name));
    std::copy_n(m.data<float>(), m.numel(), m_[i].data<float>());
    if (adam) {
      const Tensor& v = state.at(absl::StrCat("exp_avg_sq.", name));
      std::copy_n(v.data<float>(), v.numel(), v_[i].data<float>());
    }
  }
  step_ = step;
  return absl::OkStatus();
}

void ZeroGrads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) p->grad.SetZero();
}

double GradSquaredNorm(const std::vector<Parameter*>& params) {
  double s = 0;
  for (Parameter* p : params) s += cpu::SumSquares(p->grad.data<float>(), p->grad.numel());
  return s;
}

void ScaleGrads(const std::vector<Parameter*>& params, float scale) {
  if (scale == 1.0f) return;
  for (Parameter* p : params) cpu::Scale(p->grad.data<float>(), p->grad.numel(), scale);
}

float ClipScale(double norm, float max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0f;
  return static_cast<float>(max_norm / (norm + 1e-6));
}

bool GradsFinite(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) {
    if (!cpu::AllFinite(p->grad.data<float>(), p->grad.numel())) return false;
  }
  return true;
}

float LrSchedule::At(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return peak * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
  }
  int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / decay_steps);
  double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(peak * (min_ratio + (1.0 - min_ratio) * cosine));
}

absl::StatusOr<LrScaling> ParseLrScaling(absl::string_view name) {
  if (name == "none") return LrScaling::kNone;
  if (name == "linear") return LrScaling::kLinear;
  return absl::InvalidArgumentError(absl::StrCat("unknown lr scaling '", name, "' (none, linear)"));
}

float ScaleLearningRate(float base_lr, int64_t global_batch, int64_t base_batch,
                        LrScaling scaling) {
  if (scaling == LrScaling::kNone || base_batch <= 0) return base_lr;
  return base_lr * static_cast<float>(global_batch) / static_cast<float>(base_batch);
}

}  // namespace pipewright
