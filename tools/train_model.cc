// What `pipewright train` runs, from its flags (train_model.h).
#include "tools/train_model.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "pipewright/partitioner.h"
#include "pipewright/precision_kind.h"
#include "pipewright/schedule.h"
#include "tools/commands.h"

namespace pipewright::tools {
namespace {

using json = nlohmann::json;

// A preset's or a spec's graph (ModelFromSpec), a preset's LM head tied or untied as --tied
// says.
absl::StatusOr<LayerGraph> PresetGraph(const std::string& preset, int64_t micro_batch_size,
                                       int tied) {
  PW_ASSIGN_OR_RETURN(LayerGraph graph, ModelFromSpec(preset, micro_batch_size));
  if (tied < 0) return graph;
  absl::StatusOr<GptConfig> c = PresetGptConfig(preset);
  if (!c.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tied: preset '", preset, "' is not a GPT (it has no LM head to tie)"));
  }
  c->tied = tied == 1;
  return GptModel(preset, *c, graph.shape().batch);
}

// --split "3,6": the first layer of every stage but the first, so stage s runs layers
// [b_s, b_{s+1}) with b_0 = 0 and a last boundary at the layer count; empty: balanced by FLOPs
// (RunSpecFromSchedule). The stages are the schedule's virtual stages in order (pp x chunks).
absl::StatusOr<std::vector<int>> SplitBoundaries(const std::string& split, int stages, int layers) {
  if (split.empty()) return std::vector<int>{};
  std::vector<int> b = {0};
  for (absl::string_view part : absl::StrSplit(split, ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || part.empty() || part[0] == '+' || part[0] == '-') {
      return absl::InvalidArgumentError(absl::StrCat("--split ", split, ": '", part,
                                                     "' is not a layer index (a decimal number)"));
    }
    if (v <= b.back() || v >= layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--split ", split, ": ", v, " must be greater than ", b.back(),
          " and less than the model's ", layers,
          " layers (each number is the first layer of the next stage, in increasing order)"));
    }
    b.push_back(v);
  }
  b.push_back(layers);
  if (static_cast<int>(b.size()) - 1 != stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("--split ", split, " makes ", b.size() - 1, " stages; the schedule has ",
                     stages, " (pp x chunks): give ", stages - 1, " layer indices"));
  }
  return b;
}

// --chunks for `kind`: interleaved with one chunk would be plain 1F1B, so without --chunks it
// takes 2, as `plan` does.
int ChunksFromFlags(const TrainFlags& f, ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved && f.given.count("--chunks") == 0 ? 2 : f.chunks;
}

// Note [Minimal plans]. A plan file without "format" is a hand-written split:
//   {"stages": [{"layers": [0, 3]}, {"layers": [3, 6], "recompute": "full"}, ...]}
// Each stage names its layers [begin, end) (contiguous, from 0 to the model's layer count, in
// model order: the schedule's virtual stages) and optionally its recompute (else --recompute).
// Everything else comes from the flags as for a run without a plan: the model (--preset,
// --tied, --micro-batch-size), the schedule (--schedule, --chunks, --micro-batches), --dp and
// --zero; pp is the number of stages / chunks. The plan is then completed (devices pp x dp,
// this model's fingerprint) and its predictions computed (Predict with the planner's default
// device), so it runs and reports exactly as a full plan.
absl::StatusOr<LoadedModel> CompleteMinimalPlan(const TrainFlags& f, const json& doc) {
  const std::string where = f.plan + " (a minimal plan: docs/plan.md, \"Minimal plans\")";
  for (const auto& [key, value] : doc.items()) {
    if (key != "stages") {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": unknown key '", key,
          "'; a plan without \"format\" has only stages[].layers (and stages[].recompute): the "
          "model, schedule and dp come from the flags"));
    }
  }
  if (!doc.contains("stages") || !doc["stages"].is_array() || doc["stages"].empty() ||
      doc["stages"].size() > static_cast<size_t>(kMaxPlanStages)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": stages must be an array of 1 to ",
                                                   kMaxPlanStages, " {\"layers\": [begin, end]}"));
  }
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetGraph(f.preset, f.micro_batch_size, f.tied));
  const int layers = graph.num_layers();
  PW_ASSIGN_OR_RETURN(const Recompute flag_recompute, ParseRecompute(f.recompute));
  Plan plan;
  int expect = 0;
  const json& stages = doc["stages"];
  for (size_t k = 0; k < stages.size(); ++k) {
    const std::string at = absl::StrCat(where, ": stages[", k, "]");
    const json& st = stages[k];
    if (!st.is_object()) return absl::InvalidArgumentError(at + ": not an object");
    for (const auto& [key, value] : st.items()) {
      if (key != "layers" && key != "recompute") {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ": unknown key '", key, "' (keys: layers, recompute)"));
      }
    }
    const json& l = st.value("layers", json());
    if (!l.is_array() || l.size() != 2 || !l[0].is_number_integer() || !l[1].is_number_integer()) {
      return absl::InvalidArgumentError(at + ".layers: expected [begin, end], two integers");
    }
    const int64_t begin = l[0].get<int64_t>(), end = l[1].get<int64_t>();
    if (begin != expect || end <= begin || end > layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".layers: [", begin, ", ", end, "] must start at ", expect,
          " (stages are contiguous, in model order) and end after it, at most at the model's ",
          layers, " layers (", f.preset, ")"));
    }
    PlanStage& s = plan.stages.emplace_back();
    s.index = static_cast<int>(k);
    s.begin = static_cast<int>(begin);
    s.end = static_cast<int>(end);
    s.recompute = flag_recompute;
    if (st.contains("recompute")) {
      const json& r = st["recompute"];
      absl::StatusOr<Recompute> parsed = r.is_string() ? ParseRecompute(r.get<std::string>())
                                                       : absl::InvalidArgumentError("not a string");
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ".recompute: ", parsed.status().message()));
      }
      s.recompute = *parsed;
    }
    expect = s.end;
  }
  if (expect != layers) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the stages end at layer ", expect,
                                                   "; the model (", f.preset, ") has ", layers));
  }
  PW_ASSIGN_OR_RETURN(const ScheduleKind kind, ParseScheduleKind(f.schedule));
  const int chunks = ChunksFromFlags(f, kind);
  const int S = static_cast<int>(plan.stages.size());
  // V schedules place two chunks per rank whatever --chunks says.
  const int per_rank = IsVShaped(kind) && chunks <= 1 ? 2 : chunks;
  if (S % per_rank != 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", S, " stages do not divide into ",
                                                   per_rank, " chunks per rank (", f.schedule,
                                                   ")"));
  }
  const int pp = S / per_rank;
  if (f.given.count("--pp") > 0 && f.pp != pp) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pp ", f.pp, " conflicts with ", where, ": ", S, " stages make pp ", pp));
  }
  const ModelCosts costs = ToModelCosts(graph);
  plan.model_name = f.preset;
  plan.num_layers = layers;
  plan.fingerprint = costs.fingerprint;
  plan.pipeline_parallel = pp;
  plan.data_parallel = f.dp;
  plan.tensor_parallel = f.tp;
  plan.sequence_parallel = f.sequence_parallel;
  plan.devices = pp * f.dp * f.tp;
  plan.zero = std::max(0, f.zero);
  plan.schedule = {kind, pp, static_cast<int>(f.micro_batches), per_rank};
  plan.micro_batch_size = graph.shape().batch;
  for (PlanStage& s : plan.stages) s.rank = StageRank(plan.schedule, s.index);
  DeviceSpec device;
  device.count = plan.devices;
  plan.device_memory_bytes = device.memory_bytes;
  PW_ASSIGN_OR_RETURN(const Precision precision, ParsePrecision(f.precision));
  if (absl::Status s = Predict(costs, device, precision, plan); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", s.message()));
  }
  std::vector<std::string> problems = ValidatePlan(plan, &costs);
  if (!problems.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " does not make a valid plan:\n", absl::StrJoin(problems, "\n")));
  }
  return LoadedModel{std::move(graph), std::move(plan)};
}

}  // namespace

absl::StatusOr<LoadedModel> LoadModel(const TrainFlags& f) {
  if (f.plan.empty()) {
    PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetGraph(f.preset, f.micro_batch_size, f.tied));
    return LoadedModel{std::move(graph), std::nullopt};
  }
  PW_ASSIGN_OR_RETURN(std::string text, ReadJsonFile(f.plan, "--plan"));
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_object() && !doc.contains("format")) return CompleteMinimalPlan(f, doc);
  for (const char* flag : {"--pp", "--dp", "--tp", "--sequence-parallel", "--schedule", "--chunks",
                           "--micro-batches", "--micro-batch-size", "--recompute"}) {
    if (f.given.count(flag) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag,
          " conflicts with --plan: the plan sets pp, dp, tp, the schedule, the stages' layers, "
          "the micro-batching and recomputation (a minimal plan of only stages[].layers "
          "leaves them to the flags)"));
    }
  }
  absl::StatusOr<Plan> plan = PlanFromJson(text);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(f.plan, ":\n", plan.status().message()));
  }
  const bool named = f.given.count("--preset") > 0 || f.given.count("--model") > 0;
  const std::string preset = named ? f.preset : plan->model_name;
  const std::vector<std::string>& runnable = TrainablePresets();
  if (std::find(runnable.begin(), runnable.end(), preset) == runnable.end() &&
      !IsModelSpec(preset)) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.plan, ": model.name '", preset, "' is neither a preset train can run (",
                     absl::StrJoin(runnable, ", "),
                     ") nor a model spec (gpt:… or llama:…); pass --preset or "
                     "--model"));
  }
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetGraph(preset, plan->micro_batch_size, f.tied));
  const ModelCosts costs = ToModelCosts(graph);
  std::vector<std::string> problems = ValidatePlan(*plan, &costs);
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(f.plan, " does not fit preset ", preset, ":\n",
                                                   absl::StrJoin(problems, "\n")));
  }
  return LoadedModel{std::move(graph), *std::move(plan)};
}

absl::StatusOr<RunSpec> RunFromFlags(const TrainFlags& f, const LoadedModel& model) {
  if (model.plan) return RunSpecFromPlan(*model.plan);
  PW_ASSIGN_OR_RETURN(Recompute recompute, ParseRecompute(f.recompute));
  Schedule schedule;
  if (!f.program.empty()) {
    PW_ASSIGN_OR_RETURN(std::string text, ReadFile(f.program, "--program"));
    absl::StatusOr<Schedule> parsed = ParseProgram(text);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(f.program, ": ", parsed.status().message()));
    }
    schedule = *std::move(parsed);
  } else {
    PW_ASSIGN_OR_RETURN(ScheduleKind kind, ParseScheduleKind(f.schedule));
    const int chunks = ChunksFromFlags(f, kind);
    PW_ASSIGN_OR_RETURN(schedule,
                        GenerateSchedule({kind, f.pp, static_cast<int>(f.micro_batches), chunks}));
  }
  PW_ASSIGN_OR_RETURN(std::vector<int> boundaries,
                      SplitBoundaries(f.split, schedule.num_stages, model.graph.num_layers()));
  absl::StatusOr<RunSpec> run =
      RunSpecFromSchedule(model.graph, std::move(schedule), f.dp, recompute, boundaries);
  if (!run.ok() && !f.program.empty()) {
    return absl::Status(run.status().code(), absl::StrCat(f.program, ": ", run.status().message()));
  }
  if (run.ok()) {
    run->tensor_parallel = f.tp;
    run->sequence_parallel = f.sequence_parallel;
  }
  return run;
}

}  // namespace pipewright::tools
