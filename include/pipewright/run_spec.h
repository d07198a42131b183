// What the Engine runs, as data: a lowered, validated Schedule (every rank's program), the layer
// range of each of its virtual stages, per-stage recomputation and the data-parallel width.
// Three ways to make one, all ending in the same checks:
//
//   // From a generator, stages balanced by FLOPs:
//   PW_ASSIGN_OR_RETURN(Schedule s, GenerateSchedule({ScheduleKind::k1F1B, 4, 8, 1}));
//   PW_ASSIGN_OR_RETURN(RunSpec run, RunSpecFromSchedule(graph, std::move(s), /*dp=*/2));
//   // From a plan (`pipewright plan`, PlanFromJson): its schedule, split and recomputation:
//   PW_ASSIGN_OR_RETURN(RunSpec run, RunSpecFromPlan(plan));
//   // From a hand-written program (`train --program FILE`):
//   PW_ASSIGN_OR_RETURN(Schedule s, ParseProgram(text));
//   PW_ASSIGN_OR_RETURN(RunSpec run, RunSpecFromSchedule(graph, std::move(s), 1));
#ifndef PIPEWRIGHT_RUN_SPEC_H_
#define PIPEWRIGHT_RUN_SPEC_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/model.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"

namespace pipewright {

inline constexpr int kMaxTensorParallel = 1024;

struct RunSpec {
  Schedule schedule;      // lowered and validated; programs.size() = pp
  int data_parallel = 1;  // replicas of the whole pipeline
  // Ranks each pipeline rank's layers are split over (Note [Tensor parallelism] in
  // pipewright/tensor_parallel.h); 1 = no tensor parallelism.
  int tensor_parallel = 1;
  // Note [Sequence parallelism] (pipewright/tensor_parallel.h): the activations between the
  // products split along the sequence too; needs tensor_parallel > 1.
  bool sequence_parallel = false;
  std::vector<int> boundaries;       // num_stages + 1 increasing layer indices, 0 .. num_layers
  std::vector<Recompute> recompute;  // per virtual stage

  int pipeline_parallel() const { return static_cast<int>(schedule.programs.size()); }
  int num_stages() const { return schedule.num_stages; }
  int micro_batches() const { return schedule.spec.micro_batches; }  // per replica
  // "gpipe", "1f1b", ... or "custom" for a hand-written program.
  std::string ScheduleName() const { return ScheduleKindName(schedule.spec.kind); }
  // "none", "full", or the per-stage list "none,full,..." when the stages differ.
  std::string RecomputeSummary() const;
};

// The checks every RunSpec passes before it runs (Engine::Create calls it): the schedule is
// lowered and proven deadlock-free (Validate), data_parallel >= 1, tensor_parallel in
// [1, kMaxTensorParallel], the boundaries split
// `num_layers` layers into num_stages non-empty contiguous ranges, one recompute entry per stage.
// InvalidArgument naming the field otherwise.
absl::Status CheckRunSpec(const RunSpec& run, int num_layers);

// `schedule` from a generator or ParseProgram: lowered here when it is not yet (LowerComm),
// validated; `boundaries` empty = BalancedBoundaries of the graph's FLOPs; `recompute` applies
// to every stage.
absl::StatusOr<RunSpec> RunSpecFromSchedule(const LayerGraph& graph, Schedule schedule,
                                            int data_parallel,
                                            Recompute recompute = Recompute::kNone,
                                            std::vector<int> boundaries = {});

// A plan's schedule (generated once, from its kind, pp, micro-batches and chunks, then lowered),
// its stages' layer ranges and recomputation, and its data-parallel width. The plan should come
// from PlanFromJson (validated against the model); the result passes CheckRunSpec.
absl::StatusOr<RunSpec> RunSpecFromPlan(const Plan& plan);

}  // namespace pipewright

#endif  // PIPEWRIGHT_RUN_SPEC_H_
