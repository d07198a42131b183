// Plan and layer-graph value helpers (the JSON forms are in plan_json.cc).
#include "pipewright/plan.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace pipewright {

absl::StatusOr<Recompute> ParseRecompute(absl::string_view name) {
  if (name == "none") return Recompute::kNone;
  if (name == "selective") return Recompute::kSelective;
  if (name == "full") return Recompute::kFull;
  return absl::InvalidArgumentError(
      absl::StrCat("RunSpec.recompute must be none, selective or full, not '", name, "'"));
}

const char* RecomputeName(Recompute r) {
  switch (r) {
    case Recompute::kFull:
      return "full";
    case Recompute::kSelective:
      return "selective";
    default:
      return "none";
  }
}

int64_t ModelCosts::UniqueParams() const {
  int64_t n = 0;
  for (const LayerCost& l : layers) {
    if (l.tied_to.empty()) n += l.params;
  }
  return n;
}

ModelCosts ModelCosts::WithMicroBatchSize(int64_t b) const {
  ModelCosts out = *this;
  if (b == micro_batch_size || micro_batch_size < 1 || b < 1) return out;
  const double r = static_cast<double>(b) / static_cast<double>(micro_batch_size);
  auto scale = [&](int64_t bytes) { return static_cast<int64_t>(std::llround(bytes * r)); };
  out.micro_batch_size = b;
  out.input_bytes = scale(input_bytes);
  for (LayerCost& l : out.layers) {
    l.forward_flops *= r;
    l.backward_flops *= r;
    l.activation_bytes = scale(l.activation_bytes);
    l.selective_saving_bytes = scale(l.selective_saving_bytes);
    l.selective_recompute_flops *= r;
    l.output_bytes = scale(l.output_bytes);
    if (l.forward_time_s) *l.forward_time_s *= r;
    if (l.backward_time_s) *l.backward_time_s *= r;
  }
  return out;
}

std::vector<int> Plan::Boundaries() const {
  std::vector<int> b;
  for (const PlanStage& s : stages) b.push_back(s.begin);
  b.push_back(stages.empty() ? 0 : stages.back().end);
  return b;
}

}  // namespace pipewright
