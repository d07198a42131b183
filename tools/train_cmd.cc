// `pipewright train` and `pipewright eval`.
#include <cblas.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "pipewright/train.h"
#include "tools/commands.h"

namespace pipewright::tools {
namespace {

using json = nlohmann::json;

struct TrainFlags {
  std::string preset = "gpt-tiny";
  int pp = 1, dp = 1, chunks = 1;
  std::string schedule = "1f1b", recompute = "none", plan, trace;
  int64_t micro_batches = 4, micro_batch_size = 0, steps = 60, warmup = 5, base_batch = 32;
  int64_t stop_after = 0;
  uint64_t seed = 1;
  float lr = 3e-3f, clip = 1.0f, weight_decay = 0.1f, min_lr_ratio = 0.1f;
  std::string lr_scaling = "none", optimizer = "adamw", data = "synthetic";
  std::string device = "cpu", precision = "fp32", save, resume;
  bool json = false;
};

absl::Status Unsupported(const std::string& what) {
  return absl::UnimplementedError(
      absl::StrCat(what,
                   " is not yet supported: this build trains a single CPU stage "
                   "(--pp 1 --dp 1); pipelined runs arrive with the runtime issue"));
}

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
  if (f.pp != 1 || f.dp != 1) {
    return Unsupported(absl::StrCat("--pp ", f.pp, " --dp ", f.dp));
  }
  if (f.chunks != 1) return Unsupported("--chunks > 1");
  if (f.recompute != "none") return Unsupported("--recompute full");
  if (!f.plan.empty()) return Unsupported("--plan");
  if (!f.trace.empty()) return Unsupported("--trace");
  if (f.precision != "fp32") return Unsupported(absl::StrCat("--precision ", f.precision));
  if (f.device != "cpu" && f.device.rfind("cpu:", 0) != 0) {
    return Unsupported(absl::StrCat("--device ", f.device,
                                    CudaDeviceCount() == 0 ? " (and no CUDA GPU is present)" : ""));
  }
  return absl::OkStatus();
}

int RunTrain(const TrainFlags& f) {
  if (absl::Status s = CheckFlags(f); !s.ok()) return ReportError(s);
  openblas_set_num_threads(1);
  auto graph = PresetModel(f.preset, f.micro_batch_size);
  if (!graph.ok()) return ReportError(graph.status());
  TrainOptions o;
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
  auto scaling = ParseLrScaling(f.lr_scaling);
  if (!scaling.ok()) return ReportError(scaling.status());
  o.lr_scaling = *scaling;
  auto kind = ParseOptimizerKind(f.optimizer);
  if (!kind.ok()) return ReportError(kind.status());
  o.optimizer.kind = *kind;
  auto trainer = Trainer::Create(*graph, o);
  if (!trainer.ok()) return ReportError(trainer.status());
  Trainer& t = **trainer;
  if (!f.resume.empty()) {
    if (absl::Status s = t.Resume(f.resume); !s.ok()) return ReportError(s);
  }
  const Cost cost = graph->TotalCost();
  if (!f.json) {
    std::printf("pipewright train: %s (%lld layers, %.2fM parameters), data %s\n",
                graph->name().c_str(), static_cast<long long>(graph->num_layers()),
                cost.params / 1e6, f.data.c_str());
    std::printf("  pp=1 dp=1, %lld micro-batches x %lld sequences x %lld tokens, peak lr %.3g\n",
                static_cast<long long>(f.micro_batches),
                static_cast<long long>(graph->shape().batch),
                static_cast<long long>(graph->shape().seq_len), t.PeakLr());
  }
  ProgressBar bar(f.steps, !f.json);
  std::vector<double> losses;
  double total_time = 0, data_wait = 0;
  int64_t first_step = t.step();
  absl::Time start = absl::Now();
  while (t.step() < f.steps && (f.stop_after == 0 || t.step() - first_step < f.stop_after)) {
    auto r = t.Step();
    if (!r.ok()) {
      bar.Finish();
      return ReportError(r.status());
    }
    losses.push_back(r->loss);
    total_time += r->step_time_s;
    data_wait += r->data_wait_s;
    if (f.json) {
      json line = {{"step", r->step},
                   {"loss", r->loss},
                   {"lr", r->lr},
                   {"grad_norm", r->grad_norm},
                   {"step_time_s", r->step_time_s},
                   {"samples_per_s", r->samples_per_s}};
      std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    } else {
      bar.Update(r->step + 1, absl::StrFormat("loss %.4f lr %.2e %.0f samples/s", r->loss, r->lr,
                                              r->samples_per_s));
    }
  }
  bar.Finish();
  double wall = absl::ToDoubleSeconds(absl::Now() - start);
  if (!f.save.empty()) {
    if (absl::Status s = t.Save(f.save); !s.ok()) return ReportError(s);
  }
  int64_t steps_run = t.step() - first_step;
  double flops_per_step = (cost.forward_flops + cost.backward_flops) * f.micro_batches;
  json summary = {
      {"model", graph->name()},
      {"parameters", cost.params},
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
      {"peak_memory_bytes", t.peak_memory_bytes()},
      {"checkpoint", f.save}};
  if (f.json) {
    std::printf("%s\n", json{{"summary", summary}}.dump().c_str());
  } else {
    std::printf(
        "summary: %lld steps in %.2f s, loss %.4f -> %.4f, %.1f samples/s, %.2f GFLOP/s, "
        "peak memory %.1f MiB, data wait %.3f s%s\n",
        static_cast<long long>(steps_run), wall, summary["first_loss"].get<double>(),
        summary["final_loss"].get<double>(), summary["samples_per_s"].get<double>(),
        summary["model_gflops_per_s"].get<double>(), t.peak_memory_bytes() / 1048576.0, data_wait,
        f.save.empty() ? "" : absl::StrCat(", saved to ", f.save).c_str());
  }
  return 0;
}

}  // namespace

void RegisterTrain(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "Train a model (single CPU stage for now)");
  cmd->add_option("--preset", f->preset, "Model preset: mlp, gpt-tiny, gpt-small")
      ->check(CLI::IsMember({"mlp", "gpt-tiny", "gpt-small"}));
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
  cmd->add_option("--device", f->device, "cpu|cuda");
  cmd->add_option("--precision", f->precision, "fp32|bf16|fp16");
  cmd->add_option("--trace", f->trace, "Write a Chrome trace here");
  cmd->add_option("--save", f->save, "Write a checkpoint directory at the end");
  cmd->add_option("--resume", f->resume, "Continue from a checkpoint directory");
  cmd->add_flag("--json", f->json, "One JSON object per step and a final summary");
  cmd->callback([f, exit_code] { *exit_code = RunTrain(*f); });
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
