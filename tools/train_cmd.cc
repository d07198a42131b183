// `pipewright train` and `pipewright eval`.
#include <cblas.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "pipewright/engine.h"
#include "pipewright/plan.h"
#include "pipewright/trace.h"
#include "pipewright/train.h"
#include "runtime/comm/mpi.h"
#include "tools/commands.h"

namespace pipewright::tools {
namespace {

using json = nlohmann::json;

// The presets small enough to instantiate and train on this machine; the analytic giants
// (gpt3-175b, megatron-*) are for `pipewright model` and `plan` only.
const std::vector<std::string>& TrainablePresets() {
  static const std::vector<std::string> kNames = {"mlp", "gpt-tiny", "gpt-small", "gpt2-124m"};
  return kNames;
}

struct TrainFlags {
  std::string preset = "gpt-tiny";
  int pp = 1, dp = 1, chunks = 1;
  std::string schedule = "1f1b", recompute = "none", plan, trace, svg;
  double timeout_s = 60, bucket_mb = 1;
  int64_t micro_batches = 4, micro_batch_size = 0, steps = 60, warmup = 5, base_batch = 32;
  int64_t stop_after = 0;
  uint64_t seed = 1;
  float lr = 3e-3f, clip = 1.0f, weight_decay = 0.1f, min_lr_ratio = 0.1f;
  std::string lr_scaling = "none", optimizer = "adamw", data = "synthetic";
  std::string device = "cpu", precision = "fp32", save, resume, comm = "auto";
  float loss_scale = 65536.0f;
  std::string inject_failure;  // "RANK:STEP", tests of failure handling
  int64_t loss_scale_window = 1000;
  bool json = false;
  // Layout flags the user gave explicitly: they may not be combined with --plan.
  std::vector<std::string> layout_flags;
};

absl::Status CheckFlags(const TrainFlags& f) {
  if (f.pp < 1) return absl::InvalidArgumentError("--pp must be >= 1");
  if (f.dp < 1) return absl::InvalidArgumentError("--dp must be >= 1");
  if (f.chunks < 1) return absl::InvalidArgumentError("--chunks must be >= 1");
  if (f.micro_batches < 1) return absl::InvalidArgumentError("--micro-batches must be >= 1");
  if (f.micro_batch_size < 0) return absl::InvalidArgumentError("--micro-batch-size must be >= 1");
  if (f.steps < 0) return absl::InvalidArgumentError("--steps must be >= 0");
  if (f.stop_after < 0) return absl::InvalidArgumentError("--stop-after must be >= 0");
  if (!(f.lr > 0) || !std::isfinite(f.lr)) return absl::InvalidArgumentError("--lr must be > 0");
  if (f.warmup < 0) return absl::InvalidArgumentError("--warmup must be >= 0");
  if (f.base_batch < 1) return absl::InvalidArgumentError("--base-batch must be >= 1");
  if (f.recompute != "none" && f.recompute != "full") {
    return absl::InvalidArgumentError(
        absl::StrCat("--recompute must be none or full, not '", f.recompute, "'"));
  }
  if (f.precision != "fp32" && f.precision != "bf16" && f.precision != "fp16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--precision must be fp32, bf16 or fp16, not '", f.precision, "'"));
  }
  PW_RETURN_IF_ERROR(Device::Parse(f.device).status());
  if (!(f.timeout_s > 0)) return absl::InvalidArgumentError("--timeout must be > 0 seconds");
  if (!(f.bucket_mb > 0)) return absl::InvalidArgumentError("--bucket-mb must be > 0");
  if (!(f.loss_scale >= 1) || !std::isfinite(f.loss_scale) || f.loss_scale > 16777216.0f) {
    return absl::InvalidArgumentError("--loss-scale must be in [1, 2^24]");
  }
  if (f.loss_scale_window < 1) {
    return absl::InvalidArgumentError("--loss-scale-window must be >= 1");
  }
  if (f.comm != "auto" && f.comm != "local" && f.comm != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("--comm must be auto, local or nccl, not '", f.comm, "'"));
  }
  return absl::OkStatus();
}

json RankJson(const RankTimes& t) {
  return {{"rank", t.global_rank},
          {"pipeline_rank", t.pipeline_rank},
          {"replica", t.replica},
          {"stages", t.stages},
          {"compute_s", t.compute},
          {"recompute_s", t.recompute},
          {"p2p_wait_s", t.p2p_wait},
          {"all_reduce_s", t.all_reduce},
          {"optimizer_s", t.optimizer},
          {"data_wait_s", t.data_wait},
          {"idle_s", t.idle},
          {"wall_s", t.wall},
          {"stage_forward_s", t.stage_f},
          {"stage_backward_s", t.stage_b},
          {"stage_weight_s", t.stage_w},
          {"peak_memory_bytes", t.peak_memory_bytes},
          {"peak_activation_bytes", t.peak_activation_bytes},
          {"static_memory_bytes", t.static_memory_bytes}};
}

void PrintRankTable(const RunSummary& s) {
  const double n = std::max<int64_t>(1, s.steps);
  std::printf(
      "  rank  pp dp  stages      compute  recompute   p2p wait  all-reduce  optimizer  data wait"
      "       idle   peak MiB  act MiB\n");
  for (const RankTimes& t : s.ranks) {
    std::string stages;
    for (int st : t.stages) stages += absl::StrCat(stages.empty() ? "" : ",", st);
    std::printf(
        "  %4d  %2d %2d  %-8s %8.1fms %8.1fms %8.1fms %9.1fms %8.1fms %8.1fms %8.1fms"
        " %10.2f %8.2f%s\n",
        t.global_rank, t.pipeline_rank, t.replica, stages.c_str(), 1e3 * t.compute / n,
        1e3 * t.recompute / n, 1e3 * t.p2p_wait / n, 1e3 * t.all_reduce / n, 1e3 * t.optimizer / n,
        1e3 * t.data_wait / n, 1e3 * t.idle / n, t.peak_memory_bytes / 1048576.0,
        t.peak_activation_bytes / 1048576.0,
        t.global_rank == s.bottleneck_rank ? "  <- bottleneck" : "");
  }
  std::printf(
      "  (per step)  bubble measured %.1f%%, simulator %.1f%%; step %.1f ms, simulator "
      "%.1f ms\n  bottleneck: %s\n",
      100 * s.measured_bubble, 100 * s.predicted_bubble, 1e3 * s.measured_step_s,
      1e3 * s.predicted_step_s, s.bottleneck_reason.c_str());
}

// A plan from `pipewright plan`, checked against the model it will run: the preset named by
// the plan (or --preset) at the plan's micro-batch size.
struct LoadedPlan {
  Plan plan;
  LayerGraph graph;
};

absl::StatusOr<LoadedPlan> LoadPlan(const TrainFlags& f, bool preset_given) {
  if (!f.layout_flags.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.layout_flags.front(),
                     " conflicts with --plan: the plan sets pp, dp, the schedule, "
                     "the micro-batching and recomputation"));
  }
  PW_ASSIGN_OR_RETURN(std::string text, ReadFile(f.plan, "--plan"));
  absl::StatusOr<Plan> plan = PlanFromJson(text);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(f.plan, ":\n", plan.status().message()));
  }
  const std::string preset = preset_given ? f.preset : plan->model_name;
  const std::vector<std::string>& runnable = TrainablePresets();
  if (std::find(runnable.begin(), runnable.end(), preset) == runnable.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.plan, ": model.name '", preset, "' is not a preset train can run (",
                     absl::StrJoin(runnable, ", "), "); pass --preset"));
  }
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetModel(preset, plan->micro_batch_size));
  const ModelCosts costs = ToModelCosts(graph);
  absl::StatusOr<Plan> checked = PlanFromJson(text, &costs);
  if (!checked.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.plan, " does not fit preset ", preset, ":\n", checked.status().message()));
  }
  return LoadedPlan{*std::move(checked), std::move(graph)};
}

// The plan's per-stage predictions next to what the run measured (replica 0's ranks).
json PlanComparison(const Plan& plan, const RunSummary& s) {
  json rows = json::array();
  for (const PlanStage& st : plan.stages) {
    json row = {{"stage", st.index},
                {"rank", st.rank},
                {"layers", {st.begin, st.end}},
                {"recompute", RecomputeName(st.recompute)},
                {"predicted_forward_s", st.forward_s},
                {"predicted_backward_s", st.backward_s},
                {"predicted_memory_bytes", st.memory.total}};
    for (const RankTimes& t : s.ranks) {
      if (t.replica != 0 || t.pipeline_rank != st.rank) continue;
      for (size_t i = 0; i < t.stages.size(); ++i) {
        if (t.stages[i] != st.index) continue;
        row["measured_forward_s"] = t.stage_f[i];
        row["measured_backward_s"] = t.stage_b[i] + t.stage_w[i];
      }
      row["measured_rank_peak_memory_bytes"] = t.peak_memory_bytes;
    }
    int64_t rank_total = 0;
    for (const PlanStage& o : plan.stages) rank_total += o.rank == st.rank ? o.memory.total : 0;
    row["predicted_rank_memory_bytes"] = rank_total;
    rows.push_back(row);
  }
  return rows;
}

void PrintPlanComparison(const json& rows, double predicted_step, double measured_step) {
  std::printf(
      "  plan vs run (per micro-batch; memory per rank)\n"
      "  stage rank  layers     recompute   forward ms pred/meas   backward ms pred/meas"
      "   memory MiB pred/meas\n");
  for (const json& r : rows) {
    auto ms = [&](const char* k) { return r.contains(k) ? 1e3 * r[k].get<double>() : 0.0; };
    auto mib = [&](const char* k) { return r.contains(k) ? r[k].get<double>() / 1048576.0 : 0.0; };
    std::printf("  %5d %4d  [%3d, %3d)  %-9s %10.2f / %-9.2f %10.2f / %-9.2f %9.2f / %-8.2f\n",
                r["stage"].get<int>(), r["rank"].get<int>(), r["layers"][0].get<int>(),
                r["layers"][1].get<int>(), r["recompute"].get<std::string>().c_str(),
                ms("predicted_forward_s"), ms("measured_forward_s"), ms("predicted_backward_s"),
                ms("measured_backward_s"), mib("predicted_rank_memory_bytes"),
                mib("measured_rank_peak_memory_bytes"));
  }
  std::printf("  step: plan predicted %.1f ms, measured %.1f ms\n", 1e3 * predicted_step,
              1e3 * measured_step);
}

int RunTrain(const TrainFlags& f, bool preset_given) {
  if (absl::Status s = CheckFlags(f); !s.ok()) return ReportError(s);
  openblas_set_num_threads(1);
  std::optional<LoadedPlan> loaded;
  if (!f.plan.empty()) {
    absl::StatusOr<LoadedPlan> l = LoadPlan(f, preset_given);
    if (!l.ok()) return ReportError(l.status());
    loaded = *std::move(l);
  }
  absl::StatusOr<LayerGraph> graph = loaded ? absl::StatusOr<LayerGraph>(loaded->graph)
                                            : PresetModel(f.preset, f.micro_batch_size);
  if (!graph.ok()) return ReportError(graph.status());
  EngineOptions eo;
  TrainOptions& o = eo.train;
  o.preset = f.preset;
  o.micro_batches = f.micro_batches;
  o.steps = f.steps;
  o.seed = f.seed;
  o.data = f.data;
  o.lr = f.lr;
  o.warmup_steps = f.warmup;
  o.base_batch = f.base_batch;
  o.min_lr_ratio = f.min_lr_ratio;
  o.clip_norm = f.clip;
  o.optimizer.weight_decay = f.weight_decay;
  auto precision = ParsePrecision(f.precision);
  if (!precision.ok()) return ReportError(precision.status());
  o.precision = *precision;
  o.loss_scale.initial_scale = f.loss_scale;
  o.loss_scale.growth_interval = f.loss_scale_window;
  auto scaling = ParseLrScaling(f.lr_scaling);
  if (!scaling.ok()) return ReportError(scaling.status());
  o.lr_scaling = *scaling;
  auto kind = ParseOptimizerKind(f.optimizer);
  if (!kind.ok()) return ReportError(kind.status());
  o.optimizer.kind = *kind;
  auto sched = ParseScheduleKind(f.schedule);
  if (!sched.ok()) return ReportError(sched.status());
  auto recompute = ParseRecompute(f.recompute);
  if (!recompute.ok()) return ReportError(recompute.status());
  eo.pp = f.pp;
  eo.dp = f.dp;
  eo.schedule = *sched;
  eo.chunks = f.chunks;
  eo.recompute = *recompute;
  if (loaded) {
    const Plan& p = loaded->plan;
    eo.pp = p.pipeline_parallel;
    eo.dp = p.data_parallel;
    eo.schedule = p.schedule.kind;
    eo.chunks = p.schedule.chunks;
    o.micro_batches = p.schedule.micro_batches;
    eo.stage_boundaries = p.Boundaries();
    for (const PlanStage& st : p.stages) eo.stage_recompute.push_back(st.recompute);
  }
  eo.timeout = absl::Seconds(f.timeout_s);
  {
    Device d = *Device::Parse(f.device);  // checked in CheckFlags
    eo.device = d.is_cuda() ? Device::Cuda(0) : Device::Cpu();
    // "cuda:N" pins every rank to GPU N; plain "cuda" spreads ranks over every visible GPU.
    if (d.is_cuda() && f.device != "cuda") eo.cuda_devices = {d.index};
    eo.comm = f.comm;
  }
  eo.bucket_bytes = static_cast<int64_t>(f.bucket_mb * 1048576.0);
  if (!f.inject_failure.empty()) {
    std::vector<std::string> parts = absl::StrSplit(f.inject_failure, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &eo.inject_failure_rank) ||
        !absl::SimpleAtoi(parts[1], &eo.inject_failure_step)) {
      return ReportError(absl::InvalidArgumentError("--inject-failure expects RANK:STEP"));
    }
  }
  // Started by mpirun or srun: this process is one rank of the pp x dp grid (docs/cluster.md).
  std::unique_ptr<Communicator> mpi_world, process_world;
  bool root = true;
  if (LaunchedByMpi()) {
    absl::StatusOr<MpiProcess> proc = InitMpi();
    if (!proc.ok()) return ReportError(proc.status());
    root = proc->rank == 0;
    // Checked on every process before any collective, so a wrong -np fails fast everywhere.
    if (proc->size != eo.pp * eo.dp) {
      return ReportError(absl::InvalidArgumentError(absl::StrFormat(
          "rank %d: the layout needs pp x dp = %d x %d = %d processes, but %d were started "
          "(mpirun -np %d)",
          proc->rank, eo.pp, eo.dp, eo.pp * eo.dp, proc->size, eo.pp * eo.dp)));
    }
    if (!f.save.empty()) {
      return ReportError(absl::UnimplementedError(
          "--save is not supported in a multi-process run yet (each process holds only its own "
          "stages); run the plan in one process to checkpoint it"));
    }
    absl::StatusOr<std::unique_ptr<Communicator>> w = CreateMpiWorld();
    if (!w.ok()) return ReportError(w.status());
    mpi_world = *std::move(w);
    if (eo.device.is_cuda()) {
      // NCCL bootstrapped through MPI: rank 0 makes the unique id, MPI broadcasts it, and each
      // process drives one GPU, chosen by its rank on the node.
      const int gpus = CudaDeviceCount();
      Tensor id = Tensor::Zeros({32}, DType::kI32);  // NCCL_UNIQUE_ID_BYTES = 128
      absl::Status made = gpus > 0 ? absl::OkStatus()
                                   : absl::FailedPreconditionError(absl::StrCat(
                                         "rank ", proc->rank, " (", proc->hostname,
                                         "): --device cuda but no CUDA GPU is visible"));
      if (made.ok() && root) {
        absl::StatusOr<std::string> uid = NcclUniqueId();
        made = uid.status();
        if (uid.ok()) std::memcpy(id.raw(), uid->data(), std::min<size_t>(uid->size(), 128));
      }
      if (!made.ok()) {
        mpi_world->Abort(made);
        return ReportError(made);
      }
      std::unique_ptr<Work> b = mpi_world->Broadcast(id, 0);
      if (absl::Status s = b->Wait(eo.timeout); !s.ok()) return ReportError(s);
      const int gpu = eo.cuda_devices.empty() ? proc->local_rank % gpus : eo.cuda_devices[0];
      absl::StatusOr<std::unique_ptr<Communicator>> nccl =
          CreateNcclCommunicator(std::string(static_cast<const char*>(id.raw()), 128), proc->rank,
                                 proc->size, gpu, eo.timeout);
      if (!nccl.ok()) {
        mpi_world->Abort(nccl.status());
        return ReportError(nccl.status());
      }
      eo.cuda_devices = {gpu};
      process_world = *std::move(nccl);
    } else {
      process_world = std::move(mpi_world);
    }
  }
  const bool multi_process = process_world != nullptr;
  auto engine = Engine::Create(*graph, eo, std::move(process_world));
  if (!engine.ok()) return ReportError(engine.status());
  Engine& t = **engine;
  if (!f.resume.empty()) {
    if (absl::Status s = t.Resume(f.resume); !s.ok()) return ReportError(s);
  }
  const Cost cost = graph->TotalCost();
  const std::vector<int>& bounds = t.stage_boundaries();
  // What runs: the flags, or the plan.
  const int pp = eo.pp, dp = eo.dp;
  const std::string schedule = ScheduleKindName(eo.schedule);
  std::string recompute_desc = f.recompute;
  if (loaded) {
    recompute_desc.clear();
    for (Recompute r : eo.stage_recompute) {
      absl::StrAppend(&recompute_desc, recompute_desc.empty() ? "" : ",", RecomputeName(r));
    }
  }
  if (!f.json && root) {
    std::printf("pipewright train: %s (%lld layers, %.2fM parameters), data %s\n",
                graph->name().c_str(), static_cast<long long>(graph->num_layers()),
                cost.params / 1e6, f.data.c_str());
    std::string split;
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      split += absl::StrFormat("%s[%d,%d)", i ? " " : "", bounds[i], bounds[i + 1]);
    }
    std::printf(
        "  pp=%d dp=%d %s chunks=%d recompute=%s; stages %s\n  %lld micro-batches x %lld "
        "sequences x %lld tokens per replica, global batch %lld, peak lr %.3g\n",
        pp, dp, schedule.c_str(), t.schedule().spec.chunks, recompute_desc.c_str(), split.c_str(),
        static_cast<long long>(o.micro_batches), static_cast<long long>(graph->shape().batch),
        static_cast<long long>(graph->shape().seq_len), static_cast<long long>(t.global_batch()),
        t.PeakLr());
  }
  ProgressBar bar(f.steps, !f.json && root);
  std::vector<double> losses;
  double total_time = 0, data_wait = 0;
  int64_t skipped_steps = 0;
  float last_loss_scale = o.loss_scale.initial_scale;
  int64_t first_step = t.step();
  absl::Time start = absl::Now();
  absl::Status failure;
  while (t.step() < f.steps && (f.stop_after == 0 || t.step() - first_step < f.stop_after)) {
    auto r = t.Step();
    if (!r.ok()) {
      failure = r.status();
      break;
    }
    const StepResult& res = r->result;
    losses.push_back(res.loss);
    skipped_steps += res.skipped ? 1 : 0;
    last_loss_scale = res.loss_scale;
    total_time += res.step_time_s;
    data_wait += res.data_wait_s;
    if (!root) {
      // Only rank 0 prints; every process takes the same steps.
    } else if (f.json) {
      json line = {{"step", res.step},
                   {"loss", res.loss},
                   {"lr", res.lr},
                   {"grad_norm", res.grad_norm},
                   {"step_time_s", res.step_time_s},
                   {"samples_per_s", res.samples_per_s}};
      if (o.precision == Precision::kFp16) {
        line["loss_scale"] = res.loss_scale;
        line["skipped"] = res.skipped;
      }
      std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    } else {
      bar.Update(res.step + 1, absl::StrFormat("loss %.4f lr %.2e %.0f samples/s", res.loss, res.lr,
                                               res.samples_per_s));
    }
  }
  bar.Finish();
  // Multi-process: every process joins in collecting the world's times and events, which rank 0
  // then reports (after a failure the world is aborted and there is nothing to collect).
  if (multi_process && failure.ok()) {
    if (absl::Status s = t.GatherReports(); !s.ok()) return ReportError(s);
  }
  if (!root) return failure.ok() ? 0 : ReportError(failure);
  // The trace is written even after a failure: it shows where each rank was (in one process).
  if (!f.trace.empty() && (failure.ok() || !multi_process)) {
    if (absl::Status s = WriteFile(f.trace, EngineChromeTrace(t.topology(), t.Events())); !s.ok()) {
      return ReportError(s);
    }
  }
  if (!failure.ok()) return ReportError(failure);
  if (!f.svg.empty() && t.step() > first_step) {
    // The last step's measured timeline of replica 0, drawn like the simulator's.
    SimResult measured = MeasuredTimeline(t.schedule(), t.topology(), t.Events(), t.step() - 1, 0);
    if (absl::Status s = WriteFile(f.svg, ToSvg(t.schedule(), measured)); !s.ok()) {
      return ReportError(s);
    }
  }
  double wall = absl::ToDoubleSeconds(absl::Now() - start);
  if (!f.save.empty()) {
    if (absl::Status s = t.Save(f.save); !s.ok()) return ReportError(s);
  }
  RunSummary rs = t.Summary();
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  int64_t steps_run = t.step() - first_step;
  double flops_per_step = (cost.forward_flops + cost.backward_flops) * o.micro_batches * dp;
  int64_t peak = 0;
  json ranks = json::array();
  for (const RankTimes& rt : rs.ranks) {
    peak = std::max(peak, rt.peak_memory_bytes);
    ranks.push_back(RankJson(rt));
  }
  json summary = {
      {"model", graph->name()},
      {"parameters", cost.params},
      {"pipeline_parallel", pp},
      {"data_parallel", dp},
      {"schedule", schedule},
      {"chunks", t.schedule().spec.chunks},
      {"recompute", recompute_desc},
      {"precision", PrecisionName(o.precision)},
      {"skipped_steps", skipped_steps},
      {"stage_boundaries", bounds},
      {"steps", steps_run},
      {"final_step", t.step()},
      {"global_batch", t.global_batch()},
      {"first_loss", losses.empty() ? 0.0 : losses.front()},
      {"final_loss", losses.empty() ? 0.0 : losses.back()},
      {"mean_step_time_s", steps_run ? total_time / steps_run : 0.0},
      {"samples_per_s", total_time > 0 ? steps_run * t.global_batch() / total_time : 0.0},
      {"tokens_per_s",
       total_time > 0 ? steps_run * t.global_batch() * graph->shape().seq_len / total_time : 0.0},
      {"model_gflops_per_s", total_time > 0 ? steps_run * flops_per_step / total_time / 1e9 : 0.0},
      {"data_wait_s", data_wait},
      {"wall_time_s", wall},
      {"peak_memory_bytes", peak},
      {"measured_bubble", rs.measured_bubble},
      {"predicted_bubble", rs.predicted_bubble},
      {"predicted_step_s", rs.predicted_step_s},
      {"bottleneck_rank", rs.bottleneck_rank},
      {"bottleneck", rs.bottleneck_reason},
      {"cpu_cores", cores},
      {"ranks", ranks},
      {"trace", f.trace},
      {"checkpoint", f.save}};
  if (o.precision == Precision::kFp16) summary["loss_scale"] = last_loss_scale;
  json plan_rows;
  if (loaded && steps_run > 0) {
    plan_rows = PlanComparison(loaded->plan, rs);
    summary["plan"] = {{"file", f.plan},
                       {"predicted_step_s", loaded->plan.predicted.step_time_s},
                       {"measured_step_s", rs.measured_step_s},
                       {"stages", plan_rows}};
  }
  if (f.json) {
    std::printf("%s\n", json{{"summary", summary}}.dump().c_str());
  } else {
    std::printf(
        "summary: %lld steps in %.2f s, loss %.4f -> %.4f, %.1f samples/s, %.2f GFLOP/s, "
        "peak memory %.1f MiB, data wait %.3f s%s\n",
        static_cast<long long>(steps_run), wall, summary["first_loss"].get<double>(),
        summary["final_loss"].get<double>(), summary["samples_per_s"].get<double>(),
        summary["model_gflops_per_s"].get<double>(), peak / 1048576.0, data_wait,
        f.save.empty() ? "" : absl::StrCat(", saved to ", f.save).c_str());
    if (steps_run > 0) PrintRankTable(rs);
    if (!plan_rows.is_null()) {
      PrintPlanComparison(plan_rows, loaded->plan.predicted.step_time_s, rs.measured_step_s);
    }
    if (cores > 0 && pp * dp > cores) {
      std::printf(
          "  note: %d ranks share %d CPU cores, so measured compute includes contention; "
          "the simulator assumes one device per rank\n",
          pp * dp, cores);
    }
    if (!f.trace.empty()) std::printf("  trace: %s\n", f.trace.c_str());
    if (!f.svg.empty()) std::printf("  timeline: %s\n", f.svg.c_str());
  }
  return 0;
}

}  // namespace

void RegisterTrain(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "Train a model: pp x dp ranks on CPU threads");
  cmd->add_option("--preset", f->preset, "Model preset: mlp, gpt-tiny, gpt-small, gpt2-124m")
      ->check(CLI::IsMember(TrainablePresets()));
  cmd->add_option("--pp", f->pp, "Pipeline-parallel stages");
  cmd->add_option("--dp", f->dp, "Data-parallel replicas");
  cmd->add_option("--schedule", f->schedule, "Pipeline schedule")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}));
  cmd->add_option("--chunks", f->chunks, "Model chunks per rank (interleaved)");
  cmd->add_option("--micro-batches", f->micro_batches, "Micro-batches per step (per replica)");
  cmd->add_option("--micro-batch-size", f->micro_batch_size,
                  "Sequences per micro-batch (0: the preset's default)");
  cmd->add_option("--recompute", f->recompute, "Activation recomputation: none|full");
  cmd->add_option("--plan", f->plan, "Partition plan JSON");
  cmd->add_option("--steps", f->steps, "Total optimizer steps (a resumed run continues to it)");
  cmd->add_option("--stop-after", f->stop_after,
                  "Stop after this many steps in this run (the LR schedule still spans --steps)");
  cmd->add_option("--data", f->data, "synthetic, or a text file (byte-level tokens)");
  cmd->add_option("--seed", f->seed, "Seed for weights and data");
  cmd->add_option("--lr", f->lr, "Peak learning rate for --base-batch sequences");
  cmd->add_option("--lr-scaling", f->lr_scaling, "none|linear: scale --lr with the global batch");
  cmd->add_option("--base-batch", f->base_batch, "Batch that --lr is tuned for");
  cmd->add_option("--warmup", f->warmup, "Linear warm-up steps before cosine decay");
  cmd->add_option("--min-lr-ratio", f->min_lr_ratio, "Final lr as a fraction of the peak");
  cmd->add_option("--clip", f->clip, "Clip gradients to this global norm (0: off)");
  cmd->add_option("--optimizer", f->optimizer, "adamw|sgd");
  cmd->add_option("--weight-decay", f->weight_decay, "Decoupled weight decay");
  cmd->add_option("--device", f->device,
                  "cpu | cuda (ranks over every visible GPU) | cuda:N (every rank on GPU N)");
  cmd->add_option("--inject-failure", f->inject_failure,
                  "RANK:STEP: make that global rank fail in its first backward of that step "
                  "(tests of failure handling)")
      ->group("");  // hidden from --help
  cmd->add_option("--comm", f->comm,
                  "auto | local | nccl: how ranks talk (auto: NCCL when every rank has its own "
                  "GPU)");
  cmd->add_option("--precision", f->precision,
                  "fp32|bf16|fp16: bf16/fp16 run matrix products on 16-bit inputs with fp32 "
                  "accumulation and fp32 master weights");
  cmd->add_option("--loss-scale", f->loss_scale, "fp16: initial dynamic loss scale (65536)");
  cmd->add_option("--loss-scale-window", f->loss_scale_window,
                  "fp16: finite steps in a row before the loss scale doubles (1000)");
  cmd->add_option("--trace", f->trace, "Write a Chrome trace of every rank here");
  cmd->add_option("--svg", f->svg, "Write the last step's measured timeline (SVG) here");
  cmd->add_option("--timeout", f->timeout_s,
                  "Seconds a receive or collective may wait before the run fails");
  cmd->add_option("--bucket-mb", f->bucket_mb, "Gradient all-reduce bucket size (MiB)");
  cmd->add_option("--save", f->save, "Write a checkpoint directory at the end");
  cmd->add_option("--resume", f->resume, "Continue from a checkpoint directory");
  cmd->add_flag("--json", f->json, "One JSON object per step and a final summary");
  cmd->callback([f, cmd, exit_code] {
    for (const char* flag : {"--pp", "--dp", "--schedule", "--chunks", "--micro-batches",
                             "--micro-batch-size", "--recompute"}) {
      if (!f->plan.empty() && cmd->get_option(flag)->count() > 0) f->layout_flags.push_back(flag);
    }
    *exit_code = RunTrain(*f, cmd->get_option("--preset")->count() > 0);
  });
}

void RegisterEval(CLI::App& app, int* exit_code) {
  struct EvalFlags {
    std::string checkpoint, data = "synthetic";
    int64_t batches = 16;
    bool json = false;
  };
  auto f = std::make_shared<EvalFlags>();
  CLI::App* cmd = app.add_subcommand("eval", "Evaluate a checkpoint's loss on data");
  cmd->add_option("--checkpoint", f->checkpoint, "Checkpoint directory")->required();
  cmd->add_option("--data", f->data, "synthetic, or a text file");
  cmd->add_option("--batches", f->batches, "Held-out batches to evaluate");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->callback([f, exit_code] {
    openblas_set_num_threads(1);
    auto r = EvaluateCheckpoint(f->checkpoint, f->data, f->batches);
    if (!r.ok()) {
      *exit_code = ReportError(r.status());
      return;
    }
    if (f->json) {
      json j = {{"model", r->model},
                {"step", r->step},
                {"loss", r->loss},
                {"perplexity", r->perplexity},
                {"tokens", r->tokens}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("eval: %s at step %lld: loss %.4f, perplexity %.3f over %lld tokens\n",
                  r->model.c_str(), static_cast<long long>(r->step), r->loss, r->perplexity,
                  static_cast<long long>(r->tokens));
    }
    *exit_code = 0;
  });
}

}  // namespace pipewright::tools
