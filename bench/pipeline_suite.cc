#include "bench/pipeline_suite.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "pipewright/cpu.h"
#include "pipewright/engine.h"
#include "pipewright/simulator.h"

namespace pipewright::bench {
namespace {

constexpr int kDelayLayers = 8;

// Embedding -> 8 Delay layers -> LM head -> loss; the tiny real layers at both ends take
// microseconds. Each virtual stage of S gets 8 / S delay layers.
absl::StatusOr<LayerGraph> DelayModel(double stage_seconds, int stages) {
  const int64_t dim = 16;
  ModelBuilder b("delay-pipeline", {.batch = 1, .seq_len = 8});
  b.Add("embed", layers::Embedding(256, 8, dim));
  const double per_layer = stage_seconds * stages / kDelayLayers;
  for (int i = 0; i < kDelayLayers; ++i) {
    b.Add(absl::StrCat("delay.", i), layers::Delay(dim, per_layer, per_layer, per_layer));
  }
  b.Add("lm_head", layers::LmHead(dim, 256));
  b.Add("loss", layers::CrossEntropyLoss());
  return b.Build();
}

// An engine of `graph` on this process's threads, running `schedule` over `boundaries` (empty:
// balanced), with synthetic data.
absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const LayerGraph& graph,
                                                   const ScheduleSpec& schedule,
                                                   std::vector<int> boundaries, int steps) {
  PW_ASSIGN_OR_RETURN(Schedule sched, GenerateSchedule(schedule));
  PW_ASSIGN_OR_RETURN(RunSpec run, RunSpecFromSchedule(graph, std::move(sched), 1, Recompute::kNone,
                                                       std::move(boundaries)));
  TrainOptions o;
  o.steps = steps;
  o.warmup_steps = 0;
  o.threads_per_rank = 1;  // pipeline scaling at one core per rank, whatever the core count
  PW_ASSIGN_OR_RETURN(World world, World::InProcess({}));
  return Engine::Create(graph, std::move(run), o, SyntheticDataset(graph.shape().seq_len, o.seed),
                        std::move(world));
}

}  // namespace

absl::StatusOr<std::vector<OverheadRow>> RunOverheadSuite(const OverheadConfig& config) {
  SetCpuKernelThreads(1);
  struct Kind {
    ScheduleKind kind;
    int chunks;
  };
  const Kind kinds[] = {{ScheduleKind::kGpipe, 1},       {ScheduleKind::k1F1B, 1},
                        {ScheduleKind::kInterleaved, 2}, {ScheduleKind::kZbH1, 1},
                        {ScheduleKind::kZbV, 2},         {ScheduleKind::kDualPipeV, 2}};
  const int p = config.stages;
  if (p < 1 || kDelayLayers % (2 * p) != 0) {
    return absl::InvalidArgumentError("the overhead suite runs 1, 2 or 4 stages");
  }
  std::vector<OverheadRow> rows;
  for (const Kind& k : kinds) {
    // dualpipev needs m >= 2p; with fewer micro-batches its row is left out.
    if (k.kind == ScheduleKind::kDualPipeV && config.micro_batches < 2 * p) continue;
    const int S = p * k.chunks;
    // Whole-rank cost stays stage_seconds per pass; a chunk costs 1/v of it.
    PW_ASSIGN_OR_RETURN(LayerGraph graph, DelayModel(config.stage_seconds / k.chunks, S));
    std::vector<int> bounds = {0};
    for (int s = 1; s < S; ++s) bounds.push_back(1 + s * kDelayLayers / S);
    bounds.push_back(graph.num_layers());
    PW_ASSIGN_OR_RETURN(auto engine, MakeEngine(graph, {k.kind, p, config.micro_batches, k.chunks},
                                                std::move(bounds), config.steps + 1));
    std::vector<double> times;
    for (int i = 0; i <= config.steps; ++i) {
      PW_ASSIGN_OR_RETURN(StepReport r, engine->Step());
      if (i > 0) times.push_back(r.result.step_time_s);
    }
    SimCosts costs;
    costs.f = costs.b = costs.w = config.stage_seconds;
    PW_ASSIGN_OR_RETURN(SimResult sim, Simulate(engine->schedule(), costs));
    OverheadRow row;
    row.schedule = ScheduleKindName(k.kind);
    row.stages = p;
    row.micro_batches = config.micro_batches;
    row.chunks = engine->schedule().spec.chunks;
    row.measured_step_s = Median(times);
    row.predicted_step_s = sim.makespan;
    row.ratio = row.measured_step_s / row.predicted_step_s;
    row.measured_bubble = engine->Summary().measured_bubble;
    row.predicted_bubble = sim.bubble_fraction;
    rows.push_back(row);
  }
  return rows;
}

absl::StatusOr<ScalingResult> RunScalingSuite(int micro_batches, int steps) {
  SetCpuKernelThreads(1);
  if (micro_batches < 1 || steps < 1) {
    return absl::InvalidArgumentError("the scaling suite needs micro-batches and steps >= 1");
  }
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetModel("gpt-small", 0));
  ScalingResult out;
  for (int pp : {1, 2}) {
    PW_ASSIGN_OR_RETURN(
        auto engine, MakeEngine(graph, {ScheduleKind::k1F1B, pp, micro_batches, 1}, {}, steps + 1));
    std::vector<double> times;
    for (int i = 0; i <= steps; ++i) {
      PW_ASSIGN_OR_RETURN(StepReport r, engine->Step());
      if (i > 0) times.push_back(r.result.step_time_s);
    }
    ScalingRow row;
    row.stages = pp;
    row.micro_batches = micro_batches;
    row.step_s = Median(times);
    row.tokens_per_s = engine->global_batch() * graph.shape().seq_len / row.step_s;
    out.rows.push_back(row);
  }
  out.speedup = out.rows[0].step_s / out.rows[1].step_s;
  out.ideal = 2.0 * micro_batches / (micro_batches + 1);
  out.efficiency = out.speedup / out.ideal;
  return out;
}

}  // namespace pipewright::bench
