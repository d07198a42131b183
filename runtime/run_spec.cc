// RunSpec: what the engine runs, built from a schedule or a plan and checked once (run_spec.h).
#include "pipewright/run_spec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipewright/partitioner.h"

namespace pipewright {

std::string RunSpec::RecomputeSummary() const {
  bool same = true;
  for (Recompute r : recompute) same = same && r == recompute.front();
  if (recompute.empty()) return "none";
  if (same) return RecomputeName(recompute.front());
  std::vector<std::string> names;
  for (Recompute r : recompute) names.push_back(RecomputeName(r));
  return absl::StrJoin(names, ",");
}

absl::Status CheckRunSpec(const RunSpec& run, int num_layers) {
  const Schedule& sched = run.schedule;
  if (!sched.lowered) {
    return absl::InvalidArgumentError(
        "the run's schedule is not lowered (LowerComm inserts its sends and receives)");
  }
  if (absl::Status s = Validate(sched); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("invalid schedule: ", s.message()));
  }
  if (run.data_parallel < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunSpec.data_parallel = ", run.data_parallel, ": must be >= 1"));
  }
  if (run.tensor_parallel < 1 || run.tensor_parallel > kMaxTensorParallel) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunSpec.tensor_parallel = ", run.tensor_parallel, ": must be in [1, ",
                     kMaxTensorParallel, "]"));
  }
  if (run.sequence_parallel && run.tensor_parallel < 2) {
    return absl::InvalidArgumentError(
        "RunSpec.sequence_parallel splits sequences over the tensor-parallel ranks: it needs "
        "RunSpec.tensor_parallel >= 2");
  }
  const int S = sched.num_stages;
  if (S > num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot split ", num_layers, " layers into ", S,
                     " non-empty stages (pp x chunks must be between 1 and the number of layers)"));
  }
  const std::vector<int>& b = run.boundaries;
  if (static_cast<int>(b.size()) != S + 1 || b.front() != 0 || b.back() != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("stage boundaries must be ", S + 1,
                                                   " layer indices from 0 to ", num_layers,
                                                   " (got [", absl::StrJoin(b, ", "), "])"));
  }
  for (int s = 0; s < S; ++s) {
    if (b[s] >= b[s + 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", s, ": layer range [", b[s], ", ", b[s + 1], ") is empty"));
    }
  }
  if (static_cast<int>(run.recompute.size()) != S) {
    return absl::InvalidArgumentError(absl::StrCat(
        "per-stage recompute lists ", run.recompute.size(), " stages; the schedule has ", S));
  }
  return absl::OkStatus();
}

absl::StatusOr<RunSpec> RunSpecFromSchedule(const LayerGraph& graph, Schedule schedule,
                                            int data_parallel, Recompute recompute,
                                            std::vector<int> boundaries) {
  RunSpec run;
  if (!schedule.lowered) PW_RETURN_IF_ERROR(LowerComm(schedule));
  run.schedule = std::move(schedule);
  run.data_parallel = data_parallel;
  const int S = run.schedule.num_stages;
  if (boundaries.empty()) {
    PW_ASSIGN_OR_RETURN(boundaries, BalancedBoundaries(ToModelCosts(graph), S));
  }
  run.boundaries = std::move(boundaries);
  run.recompute.assign(S, recompute);
  PW_RETURN_IF_ERROR(CheckRunSpec(run, graph.num_layers()));
  return run;
}

absl::StatusOr<RunSpec> RunSpecFromPlan(const Plan& plan) {
  RunSpec run;
  PW_ASSIGN_OR_RETURN(run.schedule, GenerateSchedule(plan.schedule));
  PW_RETURN_IF_ERROR(LowerComm(run.schedule));
  run.data_parallel = plan.data_parallel;
  run.tensor_parallel = plan.tensor_parallel;
  run.sequence_parallel = plan.sequence_parallel;
  run.boundaries = plan.Boundaries();
  for (const PlanStage& st : plan.stages) run.recompute.push_back(st.recompute);
  PW_RETURN_IF_ERROR(CheckRunSpec(run, plan.num_layers));
  return run;
}

}  // namespace pipewright
