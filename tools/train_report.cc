// `pipewright train`'s header and summary (train_report.h).
#include "tools/train_report.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tools/commands.h"

namespace pipewright::tools {
namespace {

using json = nlohmann::json;

json RankJson(const RankTimes& t) {
  return {{"rank", t.global_rank},
          {"pipeline_rank", t.pipeline_rank},
          {"replica", t.replica},
          {"tensor_rank", t.tensor_rank},
          {"threads", t.threads},
          {"stages", t.stages},
          {"compute_s", t.compute},
          {"tensor_parallel_s", t.tensor_parallel},
          {"recompute_s", t.recompute},
          {"p2p_wait_s", t.p2p_wait},
          {"all_reduce_s", t.all_reduce},
          {"agreement_s", t.agreement},
          {"optimizer_s", t.optimizer},
          {"data_wait_s", t.data_wait},
          {"idle_s", t.idle},
          {"wall_s", t.wall},
          {"stage_forward_s", t.stage_f},
          {"stage_backward_s", t.stage_b},
          {"stage_weight_s", t.stage_w},
          {"peak_memory_bytes", t.peak_memory_bytes},
          {"peak_activation_bytes", t.peak_activation_bytes},
          {"static_memory_bytes", t.static_memory_bytes},
          {"optimizer_state_bytes", t.optimizer_state_bytes},
          {"gradient_bytes", t.gradient_bytes},
          {"grad_bytes_sent", t.grad_bytes_sent},
          {"grad_bytes_uncompressed", t.grad_bytes_uncompressed}};
}

void PrintRankTable(const RunSummary& s) {
  const double n = std::max<int64_t>(1, s.steps);
  // A tensor-parallel run adds its ranks' tp column.
  const bool tp = std::any_of(s.ranks.begin(), s.ranks.end(),
                              [](const RankTimes& t) { return t.tensor_rank > 0; });
  std::printf(
      "  rank  pp dp%s  stages      compute%s  recompute   p2p wait  all-reduce  agreement  "
      "optimizer"
      "  data wait       idle   peak MiB  act MiB  optim MiB  grad MiB\n",
      tp ? " tp" : "", tp ? "    tp comm" : "");
  for (const RankTimes& t : s.ranks) {
    std::string stages;
    for (int st : t.stages) stages += absl::StrCat(stages.empty() ? "" : ",", st);
    std::printf(
        "  %4d  %2d %2d%s  %-8s %8.1fms%s %8.1fms %8.1fms %9.1fms %8.1fms %8.1fms %8.1fms %8.1fms"
        " %10.2f %8.2f %10.2f %9.2f%s\n",
        t.global_rank, t.pipeline_rank, t.replica,
        tp ? absl::StrFormat(" %2d", t.tensor_rank).c_str() : "", stages.c_str(),
        1e3 * t.compute / n,
        tp ? absl::StrFormat(" %8.1fms", 1e3 * t.tensor_parallel / n).c_str() : "",
        1e3 * t.recompute / n, 1e3 * t.p2p_wait / n, 1e3 * t.all_reduce / n, 1e3 * t.agreement / n,
        1e3 * t.optimizer / n, 1e3 * t.data_wait / n, 1e3 * t.idle / n,
        t.peak_memory_bytes / 1048576.0, t.peak_activation_bytes / 1048576.0,
        t.optimizer_state_bytes / 1048576.0, t.gradient_bytes / 1048576.0,
        t.global_rank == s.bottleneck_rank ? "  <- bottleneck" : "");
  }
  std::printf(
      "  (per step)  bubble measured %.1f%%, simulator %.1f%%; step %.1f ms, simulator "
      "%.1f ms\n  bottleneck: %s\n",
      100 * s.measured_bubble, 100 * s.predicted_bubble, 1e3 * s.measured_step_s,
      1e3 * s.predicted_step_s, s.bottleneck_reason.c_str());
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

std::string StageSplit(const std::vector<int>& bounds) {
  std::string split;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    split += absl::StrFormat("%s[%d,%d)", i ? " " : "", bounds[i], bounds[i + 1]);
  }
  return split;
}

}  // namespace

std::string ParameterCount(const LayerGraph& graph) {
  const ModelCosts costs = ToModelCosts(graph);
  const int64_t unique = costs.UniqueParams();
  int64_t stored = 0;
  for (const LayerCost& l : costs.layers) stored += l.params;
  return absl::StrFormat("%.2fM parameters%s", static_cast<double>(unique) / 1e6,
                         stored != unique ? " (tied)" : "");
}

// How many of the last losses the summary's mean covers: a tenth of the run, 1 to 10 steps.
std::vector<std::string> StageRecompute(const RunSpec& run) {
  std::vector<std::string> out;
  for (Recompute r : run.recompute) out.push_back(RecomputeName(r));
  return out;
}

size_t TailSteps(size_t n) { return std::clamp<size_t>(n / 10, 1, 10); }
double TailMean(const std::vector<double>& losses) {
  if (losses.empty()) return 0;
  const size_t k = std::min(losses.size(), TailSteps(losses.size()));
  double sum = 0;
  for (size_t i = losses.size() - k; i < losses.size(); ++i) sum += losses[i];
  return sum / static_cast<double>(k);
}

void PrintHeader(const LayerGraph& graph, const Engine& t, const TrainOptions& o,
                 const std::string& data) {
  const RunSpec& run = t.run();
  std::printf("pipewright train: %s (%lld layers, %s), data %s\n", graph.name().c_str(),
              static_cast<long long>(graph.num_layers()), ParameterCount(graph).c_str(),
              data.c_str());
  std::printf(
      "  pp=%d dp=%d%s %s chunks=%d recompute=%s; stages %s\n  %lld micro-batches x %lld "
      "sequences x %lld tokens per replica, global batch %lld, peak lr %.3g\n",
      run.pipeline_parallel(), run.data_parallel,
      run.tensor_parallel > 1 ? absl::StrCat(" tp=", run.tensor_parallel,
                                             run.sequence_parallel ? " (sequence-parallel)" : "")
                                    .c_str()
                              : "",
      run.ScheduleName().c_str(), run.schedule.spec.chunks, run.RecomputeSummary().c_str(),
      StageSplit(run.boundaries).c_str(), static_cast<long long>(run.micro_batches()),
      static_cast<long long>(graph.shape().batch), static_cast<long long>(graph.shape().seq_len),
      static_cast<long long>(t.global_batch()), t.PeakLr());
  std::string precision = PrecisionName(o.precision);
  if (o.precision == Precision::kFp16) {
    absl::StrAppend(&precision,
                    absl::StrFormat(" (dynamic loss scale from %g)", o.loss_scale.initial_scale));
  }
  std::string dp = "none (dp=1)";
  if (run.data_parallel > 1) {
    dp = o.dp_mode == DpMode::kAsync
             ? absl::StrCat("async, staleness ", o.staleness)
             : absl::StrCat("sync, ZeRO-", o.zero, ", gradients ",
                            o.grad_compression.kind == GradCompression::Kind::kNone
                                ? "fp32"
                                : GradCompressionName(o.grad_compression));
  }
  std::printf("  precision %s; data parallelism %s\n", precision.c_str(), dp.c_str());
}

json PrintSummary(const ReportInput& in, bool as_json) {
  const LayerGraph& graph = *in.graph;
  const Engine& t = *in.engine;
  const RunRecord& rec = *in.record;
  const RunSpec& run = t.run();
  const RunSummary rs = t.Summary();
  const Cost cost = graph.TotalCost();
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int64_t steps_run = t.step() - rec.first_step;
  const double flops_per_step =
      (cost.forward_flops + cost.backward_flops) * run.micro_batches() * run.data_parallel;
  const double per_s = rec.total_time > 0 ? steps_run / rec.total_time : 0.0;
  int64_t peak = 0, grad_sent = 0, grad_fp32 = 0;
  json ranks = json::array();
  for (const RankTimes& rt : rs.ranks) {
    peak = std::max(peak, rt.peak_memory_bytes);
    grad_sent += rt.grad_bytes_sent;
    grad_fp32 += rt.grad_bytes_uncompressed;
    ranks.push_back(RankJson(rt));
  }
  // Gradient bytes per rank per step (mean over the ranks; each rank's own are in `ranks`).
  const double rank_steps = static_cast<double>(std::max<size_t>(1, rs.ranks.size())) *
                            static_cast<double>(std::max<int64_t>(1, steps_run));
  const double grad_ratio =
      grad_sent > 0 ? static_cast<double>(grad_fp32) / static_cast<double>(grad_sent) : 1.0;
  json summary = {{"model", graph.name()},
                  {"parameters", ToModelCosts(graph).UniqueParams()},  // a tied head once
                  {"pipeline_parallel", run.pipeline_parallel()},
                  {"data_parallel", run.data_parallel},
                  {"tensor_parallel", run.tensor_parallel},
                  {"sequence_parallel", run.sequence_parallel},
                  {"schedule", run.ScheduleName()},
                  {"chunks", run.schedule.spec.chunks},
                  {"recompute", run.RecomputeSummary()},
                  {"precision", PrecisionName(in.precision)},
                  {"grad_compression", GradCompressionName(in.grad_compression)},
                  {"zero", in.zero},
                  {"grad_bytes_sent_per_rank_step", grad_sent / rank_steps},
                  {"grad_bytes_uncompressed_per_rank_step", grad_fp32 / rank_steps},
                  {"grad_compression_ratio", grad_ratio},
                  {"skipped_steps", rec.skipped_steps},
                  {"stage_boundaries", run.boundaries},
                  {"stage_recompute", StageRecompute(run)},
                  {"micro_batches", run.micro_batches()},
                  {"micro_batch_size", graph.shape().batch},
                  {"steps", steps_run},
                  {"final_step", t.step()},
                  {"global_batch", t.global_batch()},
                  {"first_loss", rec.losses.empty() ? 0.0 : rec.losses.front()},
                  {"final_loss", rec.losses.empty() ? 0.0 : rec.losses.back()},
                  {"final_loss_mean", TailMean(rec.losses)},
                  {"mean_step_time_s", steps_run ? rec.total_time / steps_run : 0.0},
                  {"samples_per_s", per_s * t.global_batch()},
                  {"tokens_per_s", per_s * t.global_batch() * graph.shape().seq_len},
                  {"model_gflops_per_s", per_s * flops_per_step / 1e9},
                  {"data_wait_s", rec.data_wait},
                  {"wall_time_s", rec.wall_s},
                  {"peak_memory_bytes", peak},
                  {"measured_bubble", rs.measured_bubble},
                  {"predicted_bubble", rs.predicted_bubble},
                  {"predicted_step_s", rs.predicted_step_s},
                  {"bottleneck_rank", rs.bottleneck_rank},
                  {"bottleneck", rs.bottleneck_reason},
                  {"cpu_cores", cores},
                  {"threads_per_rank", t.threads_per_rank()},
                  {"ranks", ranks},
                  {"trace", in.trace},
                  {"checkpoint", in.checkpoint}};
  if (in.precision == Precision::kFp16) summary["loss_scale"] = rec.last_loss_scale;
  summary["dp_mode"] = in.async != nullptr ? "async" : "sync";
  if (in.async != nullptr) {
    json replicas = json::array();
    for (const AsyncReplicaReport& a : in.async->replicas) {
      replicas.push_back({{"replica", a.replica},
                          {"steps", a.steps},
                          {"mean_staleness", a.mean_staleness},
                          {"max_staleness", a.max_staleness},
                          {"wait_s", a.wait_s}});
    }
    summary["staleness"] = in.staleness;
    summary["async_replicas"] = replicas;
  }
  json plan_rows;
  if (in.plan != nullptr && steps_run > 0) {
    plan_rows = PlanComparison(*in.plan, rs);
    summary["plan"] = {{"file", in.plan_file},
                       {"predicted_step_s", in.plan->predicted.step_time_s},
                       {"measured_step_s", rs.measured_step_s},
                       {"stages", plan_rows}};
  }
  // A plan promises each device fits in its memory: say where the run did not.
  if (in.plan != nullptr && in.plan->device_memory_bytes > 0 && steps_run > 0) {
    json over = json::array();
    for (const RankTimes& rt : rs.ranks) {
      if (rt.peak_memory_bytes <= in.plan->device_memory_bytes) continue;
      over.push_back(rt.global_rank);
      std::fprintf(stderr,
                   "warning: rank %d's measured peak memory %s exceeds the plan's device memory "
                   "%s (%s)\n",
                   rt.global_rank, HumanBytes(rt.peak_memory_bytes).c_str(),
                   HumanBytes(in.plan->device_memory_bytes).c_str(), in.plan_file.c_str());
    }
    summary["plan"]["ranks_over_device_memory"] = over;
  }
  if (as_json) {
    std::printf("%s\n", json{{"summary", summary}}.dump().c_str());
    return summary;
  }
  std::printf(
      "summary: %lld steps in %.2f s, loss %.4f -> %.4f (mean of the last %zu step%s %.4f), "
      "%.1f samples/s, %.2f GFLOP/s, %d thread%s per rank, peak memory %.1f MiB, data wait "
      "%.3f s%s\n",
      static_cast<long long>(steps_run), rec.wall_s, summary["first_loss"].get<double>(),
      summary["final_loss"].get<double>(), TailSteps(rec.losses.size()),
      TailSteps(rec.losses.size()) == 1 ? "" : "s", summary["final_loss_mean"].get<double>(),
      summary["samples_per_s"].get<double>(), summary["model_gflops_per_s"].get<double>(),
      t.threads_per_rank(), t.threads_per_rank() == 1 ? "" : "s", peak / 1048576.0, rec.data_wait,
      in.checkpoint.empty() ? "" : absl::StrCat(", saved to ", in.checkpoint).c_str());
  if (steps_run > 0) PrintRankTable(rs);
  if (steps_run > 0 && grad_sent > 0) {
    std::printf(
        "  data-parallel traffic: %s%s, %.3f MiB sent per rank per step on the wire (an fp32 "
        "all-reduce of the gradients: %.3f MiB), ratio %.2fx\n",
        GradCompressionName(in.grad_compression).c_str(),
        in.zero > 0 ? absl::StrCat(", ZeRO-", in.zero).c_str() : "",
        grad_sent / rank_steps / 1048576.0, grad_fp32 / rank_steps / 1048576.0, grad_ratio);
  }
  if (in.async != nullptr) {
    std::printf(
        "  async DP (staleness bound %d): each replica's steps, their staleness (steps "
        "ahead of the slowest) and time waiting on the bound\n",
        in.staleness);
    for (const AsyncReplicaReport& a : in.async->replicas) {
      std::printf("    replica %d: %lld steps, staleness mean %.2f max %lld, waited %.3f s\n",
                  a.replica, static_cast<long long>(a.steps), a.mean_staleness,
                  static_cast<long long>(a.max_staleness), a.wait_s);
    }
  }
  if (!plan_rows.is_null()) {
    PrintPlanComparison(plan_rows, in.plan->predicted.step_time_s, rs.measured_step_s);
  }
  const int world = run.pipeline_parallel() * run.data_parallel * run.tensor_parallel;
  const int threads = world * t.threads_per_rank();
  if (cores > 0 && threads > cores) {
    std::printf(
        "  note: %d ranks (%d threads) share %d CPU cores, so measured compute includes "
        "contention; the simulator assumes one device per rank\n",
        world, threads, cores);
  }
  if (!in.trace.empty()) std::printf("  trace: %s\n", in.trace.c_str());
  if (!in.svg.empty()) std::printf("  timeline: %s\n", in.svg.c_str());
  return summary;
}

}  // namespace pipewright::tools
