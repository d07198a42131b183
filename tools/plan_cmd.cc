// `pipewright plan`: partition a model over devices (partitioner.h) and write the best plan.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/model.h"
#include "pipewright/partitioner.h"
#include "tools/calibration.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {
namespace {

using json = nlohmann::json;

// The largest global batch the search takes (--global-batch, or --micro-batches x
// --micro-batch-size x dp): its cost grows with the micro-batches it simulates.
constexpr int64_t kMaxGlobalBatch = 65536;
// The largest --device-memory and --reserve: 1 EiB.
constexpr int64_t kMaxDeviceBytes = int64_t{1} << 60;

struct PlanFlags {
  std::string model, preset, out, calibrate;
  int devices = 1;
  std::string device_memory = "80GiB", reserve = "0";
  int pp = 0, dp = 0, chunks = 0, zero = -1;  // zero -1: try 0, 1 and 2
  int tp = 0, devices_per_node = 8;           // tp 0: try every degree
  std::string sequence_parallel;              // "on", "off" or "" (try both)
  std::string schedule, precision = "fp32";
  int64_t micro_batch_size = 0, micro_batches = 0, global_batch = 0;
  double tflops = 100, link_gbps = 25, latency_us = 10, hbm_gbps = 2000, tp_gbps = 450;
  bool no_recompute = false, json = false;
  int threads = 0;  // 0: every core this process may use
};

absl::StatusOr<ModelCosts> LoadModel(const PlanFlags& f) {
  if (f.model.empty() == f.preset.empty()) {
    return absl::InvalidArgumentError("give exactly one of --model FILE and --preset NAME");
  }
  if (IsModelSpec(f.model) || IsModelSpec(f.preset)) {  // "llama:…" or "gpt:…" (docs/models.md)
    PW_ASSIGN_OR_RETURN(LayerGraph g, ModelFromSpec(f.model.empty() ? f.preset : f.model, 0));
    return ToModelCosts(g);
  }
  if (!f.preset.empty()) {
    // With its LM-head tie and, for a GPT, its TransformerShape (ToModelCosts).
    return PresetModelCosts(f.preset, 0);
  }
  PW_ASSIGN_OR_RETURN(std::string text, ReadJsonFile(f.model, "--model"));
  absl::StatusOr<ModelCosts> m = ModelCostsFromJson(text);
  if (!m.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(f.model, ":\n", m.status().message()));
  }
  return m;
}

json PlanRow(const Plan& p) {
  return {{"pipeline_parallel", p.pipeline_parallel},
          {"data_parallel", p.data_parallel},
          {"tensor_parallel", p.tensor_parallel},
          {"sequence_parallel", p.sequence_parallel},
          {"zero", p.zero},
          {"schedule", ScheduleKindName(p.schedule.kind)},
          {"chunks", p.schedule.chunks},
          {"micro_batch_size", p.micro_batch_size},
          {"micro_batches", p.schedule.micro_batches},
          {"step_time_s", p.predicted.step_time_s},
          {"bubble_fraction", p.predicted.bubble_fraction},
          {"samples_per_s", p.predicted.samples_per_s},
          {"peak_memory_bytes", p.predicted.peak_memory_bytes},
          {"bottleneck_stage", p.predicted.bottleneck_stage},
          {"lower_bound_step_time_s", p.predicted.lower_bound_step_time_s},
          {"lower_bound_gap", p.predicted.lower_bound_gap}};
}

void PrintTable(const std::vector<Plan>& plans) {
  std::printf(
      "  #   pp  dp  tp sp zero  schedule     v     b      m    step time   bubble   peak memory  "
      "bottleneck  gap to bound\n");
  for (size_t i = 0; i < plans.size(); ++i) {
    const Plan& p = plans[i];
    std::printf(
        "  %-3zu %3d %3d %3d %2s %4d  %-11s %2d %5lld %6d %12s %7.1f%% %13s  stage %-4d %8.1f%%\n",
        i + 1, p.pipeline_parallel, p.data_parallel, p.tensor_parallel,
        p.sequence_parallel ? "on" : "-", p.zero, ScheduleKindName(p.schedule.kind),
        p.schedule.chunks, static_cast<long long>(p.micro_batch_size), p.schedule.micro_batches,
        HumanSeconds(p.predicted.step_time_s).c_str(), 100 * p.predicted.bubble_fraction,
        HumanBytes(p.predicted.peak_memory_bytes).c_str(), p.predicted.bottleneck_stage,
        100 * p.predicted.lower_bound_gap);
  }
}

void PrintStages(const Plan& p, const ModelCosts& m) {
  std::printf(
      "  stage rank  layers        first .. last             recompute  fwd ms    bwd ms"
      "  weights+state   activations         total\n");
  for (const PlanStage& s : p.stages) {
    std::string names = absl::StrCat(m.layers[s.begin].name, " .. ", m.layers[s.end - 1].name);
    std::printf("  %5d %4d  [%4d, %4d)  %-24s %-9s %8.3f  %8.3f  %13s %13s %13s%s\n", s.index,
                s.rank, s.begin, s.end, names.c_str(), RecomputeName(s.recompute),
                1e3 * s.forward_s, 1e3 * s.backward_s,
                HumanBytes(s.memory.params + s.memory.grads + s.memory.optimizer).c_str(),
                HumanBytes(s.memory.activations).c_str(), HumanBytes(s.memory.total).c_str(),
                s.index == p.predicted.bottleneck_stage ? "  <- bottleneck" : "");
  }
}

int RunPlan(const PlanFlags& f) {
  // Before the search: an output that cannot be written is known now (WriteFile checks again).
  if (!f.out.empty()) {
    if (absl::Status s = CheckOutputPath(f.out, "--output"); !s.ok()) return ReportError(s);
  }
  absl::StatusOr<ModelCosts> model = LoadModel(f);
  if (!model.ok()) return ReportError(model.status());
  if (!f.calibrate.empty()) {
    absl::StatusOr<nlohmann::json> summary = ReadRunSummary(f.calibrate);
    if (!summary.ok()) return ReportError(summary.status());
    model = CalibrateFromSummary(*model, *summary, f.calibrate);
    if (!model.ok()) return ReportError(model.status());
    if (!f.json) {
      std::fprintf(stderr, "calibrated to %s: measured per-layer times and activation memory\n",
                   f.calibrate.c_str());
    }
  }
  DeviceSpec dev;
  dev.count = f.devices;
  absl::StatusOr<int64_t> memory = ParseByteSize(f.device_memory);
  if (!memory.ok()) return ReportError(memory.status());
  absl::StatusOr<int64_t> reserve = ParseByteSize(f.reserve);
  if (!reserve.ok()) return ReportError(reserve.status());
  dev.memory_bytes = *memory;
  dev.reserve_bytes = *reserve;
  dev.tflops = f.tflops;
  dev.link_bandwidth = f.link_gbps * 1e9;
  dev.link_latency_s = f.latency_us * 1e-6;
  dev.memory_bandwidth = f.hbm_gbps * 1e9;
  dev.devices_per_node = f.devices_per_node;
  dev.tp_bandwidth = f.tp_gbps * 1e9;
  SearchOptions o;
  o.threads = f.threads;
  if (f.pp) o.pp = f.pp;
  if (f.dp) o.dp = f.dp;
  if (f.tp) o.tp = f.tp;
  if (!f.sequence_parallel.empty()) o.sequence_parallel = f.sequence_parallel == "on";
  // Two of pp, dp and tp given fix the third (a divisor of the devices, checked below); with
  // --micro-batches and one of --pp / --dp, tp is --tp or 1, so that dp is known.
  const int64_t tp_or_1 = f.tp ? f.tp : 1;
  if (f.pp && f.dp && !f.tp && f.devices % (int64_t{f.pp} * f.dp) == 0) {
    o.tp = static_cast<int>(f.devices / (int64_t{f.pp} * f.dp));
  }
  if (f.pp && !f.dp && (f.tp || f.micro_batches)) {
    o.dp = static_cast<int>(f.devices / (f.pp * tp_or_1));
    o.tp = static_cast<int>(tp_or_1);
  }
  if (f.dp && !f.pp && (f.tp || f.micro_batches)) {
    o.pp = static_cast<int>(f.devices / (f.dp * tp_or_1));
    o.tp = static_cast<int>(tp_or_1);
  }
  if (f.chunks) o.chunks = f.chunks;
  if (f.micro_batch_size) o.micro_batch_size = f.micro_batch_size;
  if (!f.schedule.empty()) {
    absl::StatusOr<ScheduleKind> k = ParseScheduleKind(f.schedule);
    if (!k.ok()) return ReportError(k.status());
    o.schedule = *k;
  }
  absl::StatusOr<Precision> precision = ParsePrecision(f.precision);
  if (!precision.ok()) return ReportError(precision.status());
  o.precision = *precision;
  o.allow_recompute = !f.no_recompute;
  if (f.zero >= 0) o.zero = f.zero;
  o.global_batch = f.global_batch;
  if (f.micro_batches) {
    // --micro-batches fixes the global batch once dp and the micro-batch size are known.
    if (!o.dp || !o.micro_batch_size || f.global_batch) {
      return ReportError(absl::InvalidArgumentError(
          "--micro-batches needs --pp or --dp and --micro-batch-size, and no --global-batch"));
    }
    o.global_batch = int64_t{*o.dp} * f.micro_batches * *o.micro_batch_size;
    if (o.global_batch > kMaxGlobalBatch) {
      return ReportError(absl::InvalidArgumentError(
          absl::StrCat("--micro-batches ", f.micro_batches, " x --micro-batch-size ",
                       *o.micro_batch_size, " x dp ", *o.dp, " = ", o.global_batch,
                       " sequences: the global batch must be at most ", kMaxGlobalBatch)));
    }
  }
  if (o.global_batch == 0) {
    // Default: eight micro-batches of the model's size per device, enough to fill a pipeline.
    o.global_batch = int64_t{f.devices} * 8 * model->micro_batch_size;
  }
  if (o.pp && o.dp && int64_t{*o.pp} * *o.dp * o.tp.value_or(1) != f.devices) {
    return ReportError(absl::InvalidArgumentError(
        absl::StrCat("--pp ", *o.pp, " x --dp ", *o.dp, f.tp ? absl::StrCat(" x --tp ", f.tp) : "",
                     " must equal --devices ", f.devices)));
  }
  absl::StatusOr<SearchResult> r = SearchPlans(*model, dev, o);
  if (!r.ok()) {
    // A model that does not fit is the user's input problem: exit 2 with the explanation.
    if (r.status().code() == absl::StatusCode::kFailedPrecondition) {
      return ReportError(absl::InvalidArgumentError(r.status().message()));
    }
    return ReportError(r.status());
  }
  const Plan& best = r->best.front();
  if (!f.out.empty()) {
    if (absl::Status s = WriteFile(f.out, PlanToJson(best) + "\n", "--output"); !s.ok()) {
      return ReportError(s);
    }
  }
  if (f.json) {
    json rows = json::array();
    for (const Plan& p : r->best) rows.push_back(PlanRow(p));
    json j = {{"model", model->name},
              {"layers", model->num_layers()},
              {"params", model->UniqueParams()},
              {"devices", f.devices},
              {"device_memory_bytes", dev.memory_bytes},
              {"global_batch", best.global_batch()},
              {"candidates", r->candidates},
              {"feasible", r->feasible},
              {"best", rows},
              {"plan", json::parse(PlanToJson(best), nullptr, false)},
              {"output", f.out}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf(
      "pipewright plan: %s (%d layers, %s parameters) on %d devices of %s, %s, global "
      "batch %lld\n  %d configurations tried, %d fit in memory; the best %zu:\n",
      model->name.c_str(), model->num_layers(), HumanCount(model->UniqueParams()).c_str(),
      f.devices, HumanBytes(dev.memory_bytes).c_str(), PrecisionName(o.precision),
      static_cast<long long>(best.global_batch()), r->candidates, r->feasible, r->best.size());
  PrintTable(r->best);
  const std::string zero = best.zero ? absl::StrCat(" zero=", best.zero) : "";
  const std::string tp =
      best.tensor_parallel > 1
          ? absl::StrCat(" tp=", best.tensor_parallel, best.sequence_parallel ? " sp" : "")
          : "";
  std::printf(
      "best: pp=%d dp=%d%s%s %s, %d x %lld per replica: %s per step, %.4g samples/s, "
      "lower bound %s (gap %.1f%%)\n",
      best.pipeline_parallel, best.data_parallel, tp.c_str(), zero.c_str(),
      ScheduleKindName(best.schedule.kind), best.schedule.micro_batches,
      static_cast<long long>(best.micro_batch_size),
      HumanSeconds(best.predicted.step_time_s).c_str(), best.predicted.samples_per_s,
      HumanSeconds(best.predicted.lower_bound_step_time_s).c_str(),
      100 * best.predicted.lower_bound_gap);
  PrintStages(best, model->WithMicroBatchSize(best.micro_batch_size));
  if (!f.out.empty()) std::printf("plan written to %s\n", f.out.c_str());
  return 0;
}

}  // namespace

absl::StatusOr<int64_t> ParseByteSize(const std::string& text) {
  std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  static const std::pair<const char*, double> kUnits[] = {
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0},
      {"kb", 1e3},     {"mb", 1e6},        {"gb", 1e9},           {"tb", 1e12},
      {"b", 1.0}};
  double unit = 1;
  for (const auto& [suffix, scale] : kUnits) {
    if (absl::EndsWith(t, suffix)) {
      t.resize(t.size() - std::strlen(suffix));
      unit = scale;
      break;
    }
  }
  double value = 0;
  const absl::string_view number = absl::StripAsciiWhitespace(t);
  // Decimal only: SimpleAtod (strtod) would also read hex ("0x10") and "nan(...)".
  if (number.empty() || number.find_first_not_of("0123456789.eE+-") != absl::string_view::npos ||
      !absl::SimpleAtod(number, &value) || !std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a size: use bytes or a number with KiB, MiB, GiB, TiB, KB, MB, GB"));
  }
  if (value * unit > 9e18) {  // below 2^63, so that llround is exact and defined
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is too large: at most 9e18 bytes"));
  }
  return static_cast<int64_t>(std::llround(value * unit));
}

void RegisterPlan(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Partition a model over devices: search pp x dp x tp, micro-batch size and schedule");
  cmd->add_option("--model", f->model,
                  "Layer graph JSON (pipewright model -o), or a model spec: llama:… or gpt:… "
                  "(docs/models.md)");
  cmd->add_option("--preset", f->preset, "A built-in model instead of --model");
  AddInt(cmd, "--devices", &f->devices, {1, kMaxParallel}, "Number of devices (pp x dp x tp)")
      ->required();
  AddByteSize(cmd, "--device-memory", &f->device_memory, {1, kMaxDeviceBytes},
              "Memory per device, e.g. 80GiB");
  AddByteSize(cmd, "--reserve", &f->reserve, {0, kMaxDeviceBytes},
              "Memory kept free per device, e.g. 2GiB");
  AddInt(cmd, "--pp", &f->pp, {1, kMaxParallel}, "Pipeline stages (default: try every divisor)");
  AddInt(cmd, "--dp", &f->dp, {1, kMaxParallel},
         "Data-parallel replicas (default: devices / (pp x tp))");
  AddInt(cmd, "--tp", &f->tp, {1, kMaxParallel},
         "Tensor-parallel degree, inside a node (default: try every degree that divides the "
         "devices, the heads, hidden size and vocabulary, up to --devices-per-node)");
  AddInt(cmd, "--devices-per-node", &f->devices_per_node, {1, kMaxParallel},
         "Devices per node: the largest tensor-parallel group (default 8)");
  AddReal(cmd, "--tp-bandwidth", &f->tp_gbps, RealRange::LeftOpen(0, 1e9),
          "Tensor-parallel collectives' bus bandwidth in GB/s per device, inside a node "
          "(default 450: H100 NVLink 4, per direction)");
  cmd->add_option("--sequence-parallel", f->sequence_parallel,
                  "on|off: sequence parallelism with tp >= 2 (default: try both)")
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_option("--schedule", f->schedule,
                  "gpipe|1f1b|interleaved|zb-h1|zb-v|dualpipev (default: all but dualpipev)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}));
  AddInt(cmd, "--chunks", &f->chunks, {1, kMaxParallel},
         "Model chunks per rank for interleaved (default 2)");
  AddInt(cmd, "--micro-batch-size", &f->micro_batch_size, {1, kMaxMicroBatchSize},
         "Sequences per micro-batch (default: try every size that divides the global batch)");
  AddInt(cmd, "--micro-batches", &f->micro_batches, {1, kMaxGlobalBatch},
         "Micro-batches per replica (fixes the global batch; default: from --global-batch)");
  AddInt(cmd, "--global-batch", &f->global_batch, {1, kMaxGlobalBatch},
         "Sequences per step (default: 8 micro-batches per device)");
  cmd->add_option("--precision", f->precision, "fp32|bf16|fp16 (bytes per parameter 16|18)");
  AddReal(cmd, "--device-tflops", &f->tflops, RealRange::LeftOpen(0, 1e9),
          "Sustained TFLOP/s per device (unprofiled layers)");
  AddReal(cmd, "--link-gbps", &f->link_gbps, RealRange::LeftOpen(0, 1e9),
          "P2P / all-reduce GB/s per device");
  AddReal(cmd, "--link-latency-us", &f->latency_us, RealRange::Closed(0, 1e9),
          "Per-message latency (microseconds)");
  AddReal(cmd, "--hbm-gbps", &f->hbm_gbps, RealRange::LeftOpen(0, 1e9),
          "Device memory GB/s (optimizer step)");
  cmd->add_flag("--no-recompute", f->no_recompute, "Never recompute activations to fit");
  AddInt(cmd, "--zero", &f->zero, {0, 2},
         "0: every replica keeps its stage's optimizer state and gradients; 1: ZeRO-1, the "
         "optimizer state split over the dp replicas; 2: ZeRO-2, the gradients too, "
         "reduce-scattered every micro-batch (default: try all three where dp >= 2)");
  cmd->add_option("--calibrate", f->calibrate,
                  "The `train --json` output of a run of this model: plan with its measured "
                  "per-layer times and activation memory (docs/plan.md, \"Calibration\")");
  AddInt(cmd, "--threads", &f->threads, {0, 1024},
         "Threads that partition the candidate configurations at once (0: every core this "
         "process may use); the plans found do not depend on it");
  cmd->add_option("-o,--output", f->out, "Write the best plan here");
  cmd->add_flag("--json", f->json, "Print the five best and the plan as JSON");
  cmd->callback([f, exit_code] { *exit_code = RunPlan(*f); });
}

}  // namespace pipewright::tools
