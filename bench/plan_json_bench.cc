// Google Benchmark timings of the plan reader (partitioner/plan_json.cc) on large and hostile
// plans, to show it stays linear (docs/benchmarks.md, "Plan reader"):
//   build/bin/plan_json_bench
//   build/bin/plan_json_bench --benchmark_filter=ValidateStages
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"

namespace {

using namespace pipewright;

// A valid 1f1b plan of `stages` one-layer stages (pp = stages, dp = 1, one micro-batch).
std::string PlanText(int stages) {
  Plan p;
  p.model_name = "bench";
  p.num_layers = stages;
  p.fingerprint = "sha256:bench";
  p.devices = stages;
  p.device_memory_bytes = int64_t{80} << 30;
  p.pipeline_parallel = stages;
  p.schedule = {ScheduleKind::k1F1B, stages, 1, 1};
  for (int i = 0; i < stages; ++i) {
    PlanStage s;
    s.index = i;
    s.rank = i;
    s.begin = i;
    s.end = i + 1;
    s.forward_s = 0.01;
    s.backward_s = 0.02;
    s.memory = {100, 100, 200, 50, 450};
    p.stages.push_back(s);
  }
  p.predicted.peak_memory_bytes = 450;
  return PlanToJson(p);
}

// ValidatePlanJson of a valid plan of range(0) stages: linear (before issue 34 the callback
// parser rescanned the stage list after every stage: 10^5 stages took 6 s).
void BM_ValidateStages(benchmark::State& state) {
  const std::string text = PlanText(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    std::vector<std::string> problems = ValidatePlanJson(text);
    if (!problems.empty()) state.SkipWithError(problems[0].c_str());
    benchmark::DoNotOptimize(problems);
  }
  state.SetComplexityN(state.range(0));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(text.size()));
}
BENCHMARK(BM_ValidateStages)
    ->RangeMultiplier(4)
    ->Range(1 << 10, kMaxPlanStages)
    ->Unit(benchmark::kMillisecond)
    ->Complexity(benchmark::oN);

// A plan of range(0) stages beyond the limit: refused when stage kMaxPlanStages + 1 is parsed,
// so the time no longer grows with the stages (10^6 stages: no answer in 90 s before).
void BM_RefuseTooManyStages(benchmark::State& state) {
  const std::string one = PlanText(1);
  const std::string stage = R"({"index":0,"rank":0,"layers":[0,1],"recompute":"none",)"
                            R"("predicted":{"forward_s":0.01,"backward_s":0.02,"memory_bytes":)"
                            R"({"params":100,"grads":100,"optimizer":200,"activations":50,)"
                            R"("total":450}}})";
  std::string list = "[";
  for (int64_t i = 0; i < state.range(0); ++i) {
    if (i > 0) list += ',';
    list += stage;
  }
  list += ']';
  std::string text = one;
  const size_t begin = text.find("\"stages\": [") + 10;
  const size_t end = text.find("\n  ],", begin) + 4;
  text.replace(begin, end - begin, list);
  for (auto _ : state) {
    std::vector<std::string> problems = ValidatePlanJson(text);
    if (problems.size() != 1) state.SkipWithError("expected the one stage-limit problem");
    benchmark::DoNotOptimize(problems);
  }
}
BENCHMARK(BM_RefuseTooManyStages)->Arg(100000)->Arg(1000000)->Unit(benchmark::kMillisecond);

// One object with range(0) unknown keys (ordered_json inserted each key by a linear search).
void BM_ManyKeys(benchmark::State& state) {
  std::string text = PlanText(4);
  std::string keys;
  for (int64_t i = 0; i < state.range(0); ++i) absl::StrAppend(&keys, "\"k", i, "\": 0, ");
  text.insert(text.find("\"count\"", text.find("\"devices\"")), keys);
  for (auto _ : state) {
    std::vector<std::string> problems = ValidatePlanJson(text);
    benchmark::DoNotOptimize(problems);
  }
  state.SetComplexityN(state.range(0));
}
BENCHMARK(BM_ManyKeys)
    ->RangeMultiplier(4)
    ->Range(1 << 12, 1 << 18)
    ->Unit(benchmark::kMillisecond)
    ->Complexity(benchmark::oN);

}  // namespace

BENCHMARK_MAIN();
