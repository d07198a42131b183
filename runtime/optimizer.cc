#include "pipewright/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/ops.h"

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
    : config_(config), allocator_(allocator), params_(std::move(params)) {
  for (Parameter* p : params_) {
    m_.push_back(Tensor::Zeros(p->value.shape(), DType::kF32, allocator));
    if (config_.kind == OptimizerKind::kAdamW) {
      v_.push_back(Tensor::Zeros(p->value.shape(), DType::kF32, allocator));
    }
  }
}

absl::Status Optimizer::Step(float lr, float grad_scale) {
  const ops::Exec e{allocator_};
  if (config_.kind != OptimizerKind::kAdamW && grad_scale != 1.0f) {
    PW_RETURN_IF_ERROR(ScaleGrads(params_, grad_scale, allocator_));
  }
  if (config_.kind == OptimizerKind::kAdamW) {
    std::vector<ops::AdamWItem> items;
    for (size_t i = 0; i < params_.size(); ++i) {
      Parameter* p = params_[i];
      items.push_back(
          {&p->value, &p->grad, &m_[i], &v_[i], p->weight_decay ? config_.weight_decay : 0.0f});
    }
    PW_RETURN_IF_ERROR(
        ops::AdamW(e, items, lr, config_.beta1, config_.beta2, config_.eps, step_ + 1, grad_scale));
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      Parameter* p = params_[i];
      PW_RETURN_IF_ERROR(ops::SgdMomentum(e, p->value, p->grad, m_[i], lr, config_.momentum,
                                          p->weight_decay ? config_.weight_decay : 0.0f));
    }
  }
  ++step_;
  return absl::OkStatus();
}

int64_t Optimizer::StateBytes() const {
  int64_t n = 0;
  for (const Tensor& t : m_) n += static_cast<int64_t>(t.nbytes());
  for (const Tensor& t : v_) n += static_cast<int64_t>(t.nbytes());
  return n;
}

std::vector<std::pair<std::string, Tensor>> Optimizer::State() const {
  std::vector<std::pair<std::string, Tensor>> out;
  bool adam = config_.kind == OptimizerKind::kAdamW;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i]->tied_to.empty()) continue;  // a tied copy's state is its owner's
    out.emplace_back(absl::StrCat(adam ? "exp_avg." : "momentum_buffer.", params_[i]->name), m_[i]);
    if (adam) out.emplace_back(absl::StrCat("exp_avg_sq.", params_[i]->name), v_[i]);
  }
  return out;
}

absl::Status Optimizer::LoadState(const std::map<std::string, Tensor>& state, int64_t step) {
  // Every (state tensor, saved name) pair; a tied copy loads its owner's state.
  const bool adam = config_.kind == OptimizerKind::kAdamW;
  std::vector<std::pair<Tensor*, std::string>> wanted;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = StoredName(*params_[i]);
    wanted.emplace_back(&m_[i], absl::StrCat(adam ? "exp_avg." : "momentum_buffer.", name));
    if (adam) wanted.emplace_back(&v_[i], absl::StrCat("exp_avg_sq.", name));
  }
  // Validate everything first so a failure leaves the optimizer untouched.
  for (const auto& [t, name] : wanted) {
    auto it = state.find(name);
    if (it == state.end()) {
      return absl::NotFoundError(absl::StrCat("optimizer state '", name, "' missing"));
    }
    if (it->second.shape() != t->shape() || it->second.dtype() != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state '", name, "' has shape ",
                                                     it->second.ShapeString(), ", expected ",
                                                     t->ShapeString()));
    }
  }
  for (const auto& [t, name] : wanted) {
    PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{allocator_}, state.at(name), *t));
  }
  step_ = step;
  return absl::OkStatus();
}

void ZeroGrads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) p->grad.SetZero();
}

absl::StatusOr<double> GradSquaredNorm(const std::vector<Parameter*>& params, Allocator* exec) {
  std::vector<const Tensor*> grads;
  for (Parameter* p : params) {
    if (p->tied_to.empty()) grads.push_back(&p->grad);  // a tied copy's owner counts the sum
  }
  return ops::SumSquares(ops::Exec{exec}, grads);
}

absl::Status ScaleGrads(const std::vector<Parameter*>& params, float scale, Allocator* exec) {
  if (scale == 1.0f) return absl::OkStatus();
  for (Parameter* p : params) PW_RETURN_IF_ERROR(ops::Scale(ops::Exec{exec}, p->grad, scale));
  return absl::OkStatus();
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
  if (name == "sqrt") return LrScaling::kSqrt;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown lr scaling '", name, "' (none, linear, sqrt)"));
}

float ScaleLearningRate(float base_lr, int64_t global_batch, int64_t base_batch,
                        LrScaling scaling) {
  if (scaling == LrScaling::kNone || base_batch <= 0) return base_lr;
  const double ratio = static_cast<double>(global_batch) / static_cast<double>(base_batch);
  if (scaling == LrScaling::kSqrt) return static_cast<float>(base_lr * std::sqrt(ratio));
  return base_lr * static_cast<float>(global_batch) / static_cast<float>(base_batch);
}

}  // namespace pipewright
