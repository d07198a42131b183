// What `pipewright train` runs, from its flags: the model (a preset, or the one a plan names)
// and the run spec (a plan's, a hand-written program's, or a generated schedule's, split as
// --split or a minimal plan says).
#ifndef PIPEWRIGHT_TOOLS_TRAIN_MODEL_H_
#define PIPEWRIGHT_TOOLS_TRAIN_MODEL_H_

#include <optional>

#include "absl/status/statusor.h"
#include "pipewright/model.h"
#include "pipewright/plan.h"
#include "pipewright/run_spec.h"
#include "tools/train_flags.h"

namespace pipewright::tools {

// The model that runs: the preset, or the one a plan names (checked against the plan).
struct LoadedModel {
  LayerGraph graph;
  std::optional<Plan> plan;
};

absl::StatusOr<LoadedModel> LoadModel(const TrainFlags& f);

// What runs: the plan's RunSpec, a hand-written program's, or a generated schedule's.
absl::StatusOr<RunSpec> RunFromFlags(const TrainFlags& f, const LoadedModel& model);

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_TRAIN_MODEL_H_
