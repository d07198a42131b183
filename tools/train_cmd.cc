// `pipewright train`: flags become the library's data — a RunSpec (from a
// plan, a hand-written program or a schedule generator), TrainOptions, a Dataset and a World
// from Launch — and the Engine runs them. The flags are registered in train_flags.cc, the reports
// are in train_report.cc.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "pipewright/checkpoint.h"
#include "pipewright/cpu.h"
#include "pipewright/engine.h"
#include "pipewright/input.h"
#include "pipewright/launch.h"
#include "pipewright/plan.h"
#include "pipewright/run_spec.h"
#include "pipewright/trace.h"
#include "pipewright/train.h"
#include "pipewright/train_testing.h"
#include "tools/calibration.h"
#include "tools/commands.h"
#include "tools/flags.h"
#include "tools/metrics.h"
#include "tools/train_flags.h"
#include "tools/train_model.h"
#include "tools/train_report.h"

namespace pipewright::tools {

// The presets small enough to instantiate and train on this machine; the analytic giants
// (gpt3-175b, megatron-*) are for `pipewright model` and `plan` only.
const std::vector<std::string>& TrainablePresets() {
  static const std::vector<std::string> kNames = {"mlp",       "gpt-tiny",   "gpt-small",
                                                  "gpt2-124m", "llama-tiny", "smollm2-135m"};
  return kNames;
}

namespace {

// Whether this process is the run's root (set once the world is launched; true before).
bool train_root_process = true;

}  // namespace

bool TrainRootProcess() { return train_root_process; }

namespace {

using json = nlohmann::json;

// Every preset train runs reads byte-level tokens.
constexpr int64_t kByteVocabulary = 256;

// What no single flag's range says (each flag's own range is checked as it is parsed:
// RegisterTrain, tools/flags.h).
absl::Status CheckFlags(const TrainFlags& f) {
  // Outputs that could never be written (a FIFO would block, a directory fails) are refused
  // before training, not after it.
  if (!f.trace.empty()) PW_RETURN_IF_ERROR(CheckOutputPath(f.trace, "--trace"));
  if (!f.svg.empty()) PW_RETURN_IF_ERROR(CheckOutputPath(f.svg, "--svg"));
  if (!f.calibrate_out.empty()) {
    PW_RETURN_IF_ERROR(CheckOutputPath(f.calibrate_out, "--calibrate-out"));
    if (f.steps == 0) {
      return absl::InvalidArgumentError(
          "--calibrate-out needs a run that takes steps (--steps 0 measures nothing)");
    }
    if (f.tp > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--calibrate-out with --tp ", f.tp,
          ": a tensor-parallel rank measures parts of layers, not the whole layers the model "
          "file describes (calibrate at --tp 1)"));
    }
  }
  if (f.save.empty()) {
    if (f.save_every > 0 || f.keep > 0) {
      return absl::InvalidArgumentError(absl::StrCat(f.save_every > 0 ? "--save-every" : "--keep",
                                                     " needs --save DIR (where to write)"));
    }
    if (f.resume == "auto") {
      return absl::InvalidArgumentError(
          "--resume auto needs --save DIR (it resumes from DIR's newest checkpoint, if any)");
    }
  }
  // (What TrainOptions allow is ValidateTrainOptions's to say, in RunTrain; these are about
  // which flags were given.)
  PW_ASSIGN_OR_RETURN(const DpMode dp_mode, ParseDpMode(f.dp_mode));
  if (dp_mode == DpMode::kSync && f.given.count("--staleness") > 0) {
    return absl::InvalidArgumentError("--staleness needs --dp-mode async");
  }
  if (dp_mode == DpMode::kAsync && f.save_every > 0) {
    return absl::InvalidArgumentError(
        "--save-every does not combine with --dp-mode async (the replicas are at different "
        "steps); an async run saves at its end and when stopped by a signal");
  }
  // What a plan or a program fixes may not be given beside it.
  auto conflicts = [&](const std::string& source, std::initializer_list<const char*> flags,
                       const char* what) -> absl::Status {
    for (const char* flag : flags) {
      if (f.given.count(flag) > 0) {
        return absl::InvalidArgumentError(absl::StrCat(flag, " conflicts with ", source, ": the ",
                                                       source.substr(2), " sets ", what));
      }
    }
    return absl::OkStatus();
  };
  if (!f.plan.empty()) {
    // A full plan also fixes pp, dp, the schedule, the micro-batching and recomputation (checked
    // as it is read: a minimal plan leaves them to the flags; LoadModel, train_model.cc).
    PW_RETURN_IF_ERROR(
        conflicts("--plan", {"--program", "--split"}, "the stages (and their layers)"));
  }
  if (!f.program.empty()) {
    PW_RETURN_IF_ERROR(conflicts("--program", {"--pp", "--schedule", "--chunks", "--micro-batches"},
                                 "the ranks, the stages and the micro-batches"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainOptions> OptionsFromFlags(const TrainFlags& f) {
  TrainOptions o;
  o.steps = f.steps;
  o.seed = f.seed;
  o.lr = f.lr;
  o.warmup_steps = f.warmup;
  o.base_batch = f.base_batch;
  o.min_lr_ratio = f.min_lr_ratio;
  o.clip_norm = f.clip;
  o.optimizer.weight_decay = f.weight_decay;
  PW_ASSIGN_OR_RETURN(o.precision, ParsePrecision(f.precision));
  o.loss_scale.initial_scale = f.loss_scale;
  o.loss_scale.growth_interval = f.loss_scale_window;
  PW_ASSIGN_OR_RETURN(o.lr_scaling, ParseLrScaling(f.lr_scaling));
  PW_ASSIGN_OR_RETURN(o.optimizer.kind, ParseOptimizerKind(f.optimizer));
  o.bucket_bytes = static_cast<int64_t>(f.bucket_mb * 1048576.0);
  PW_ASSIGN_OR_RETURN(o.grad_compression, ParseGradCompression(f.grad_compression));
  o.threads_per_rank = f.threads_per_rank;
  o.data_workers = f.data_workers;
  PW_ASSIGN_OR_RETURN(o.dp_mode, ParseDpMode(f.dp_mode));
  o.zero = std::max(0, f.zero);
  o.zero_buffers = f.zero_buffers;
  o.staleness = f.staleness;
  return o;
}

// --slow-replica R:FACTOR and --inject-failure RANK:STEP. The text is checked here (the factor's
// range included: it is part of the syntax the flag documents); what the run allows (R below dp)
// by ValidateTrainTestingHooks.
absl::StatusOr<TrainTestingHooks> HooksFromFlags(const TrainFlags& f) {
  TrainTestingHooks h;
  if (!f.slow_replica.empty()) {
    std::vector<std::string> parts = absl::StrSplit(f.slow_replica, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &h.slow_replica) ||
        !absl::SimpleAtod(parts[1], &h.slow_factor) || h.slow_replica < 0 ||
        !(h.slow_factor >= 1) || !(h.slow_factor <= 1000)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--slow-replica ", f.slow_replica,
          ": expects REPLICA:FACTOR, a replica index >= 0 and a factor in [1, 1000] (e.g. 1:2)"));
    }
  }
  if (!f.inject_failure.empty()) {
    std::vector<std::string> parts = absl::StrSplit(f.inject_failure, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &h.inject_failure_rank) ||
        !absl::SimpleAtoi(parts[1], &h.inject_failure_step)) {
      return absl::InvalidArgumentError("--inject-failure expects RANK:STEP");
    }
  }
  return h;
}

absl::StatusOr<WorldOptions> WorldFromFlags(const TrainFlags& f) {
  WorldOptions w;
  PW_ASSIGN_OR_RETURN(Device d, Device::Parse(f.device));
  w.device = d.is_cuda() ? Device::Cuda(0) : Device::Cpu();
  // "cuda:N" pins every rank to GPU N; plain "cuda" spreads ranks over every visible GPU.
  if (d.is_cuda() && f.device != "cuda") w.cuda_devices = {d.index};
  if (f.comm != "auto") {
    PW_ASSIGN_OR_RETURN(CommBackend b, ParseCommBackend(f.comm));
    w.comm = b;
  }
  w.timeout = absl::Seconds(f.timeout_s);
  return w;
}

// The engine's checkpoint as DIR/step-NNNNNN of --save DIR, DIR/latest then naming it, and all
// but the newest --keep removed (docs/checkpoint.md, "Checkpoint directories").
absl::Status SaveStep(const Engine& t, const TrainFlags& f) {
  return SaveCheckpointStep(
      f.save, t.step(), f.keep, [&](const std::string& path) { return t.Save(path); }, t.is_root());
}

// Note [Preemption]. SIGTERM, SIGINT and SIGUSR1 (what Slurm and mpirun send before they kill a
// job) ask the run to stop: the handler only sets the process-wide flag (RequestStop, an atomic
// store) and says so on stderr with write(2). The flag travels in the next step agreement, so
// every rank of every process stops after the same step; the run then saves its checkpoint
// (with --save) and exits 0. A second signal exits at once with 128 + the signal's number.
extern "C" void OnStopSignal(int sig) {
  if (StopRequested()) _exit(128 + sig);
  RequestStop();
  static const char kMsg[] =
      "pipewright: stop requested: finishing the current step, then saving (with --save) and "
      "exiting; a second signal exits at once\n";
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
}

// SIGUSR2 asks every rank of this process to write its flight record (docs/runtime.md, "Flight
// recorder"): the handler sets a flag, a watcher thread does the writing.
std::atomic<bool> flight_requested{false};
extern "C" void OnFlightSignal(int) { flight_requested.store(true); }

class FlightWatcher {
 public:
  FlightWatcher(const Engine& t, std::string dir) : dir_(std::move(dir)) {
    struct sigaction sa = {};
    sa.sa_handler = OnFlightSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR2, &sa, nullptr);
    thread_ = std::thread([this, &t] {
      while (!done_.load()) {
        if (flight_requested.exchange(false)) Dump(t);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }
  ~FlightWatcher() {
    done_.store(true);
    thread_.join();
  }
  FlightWatcher(const FlightWatcher&) = delete;
  FlightWatcher& operator=(const FlightWatcher&) = delete;

  void Dump(const Engine& t) const {
    if (absl::Status s = t.DumpFlightRecords(dir_); !s.ok()) {
      std::fprintf(stderr, "pipewright: %s\n", std::string(s.message()).c_str());
    }
  }

 private:
  std::string dir_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

void InstallStopSignals() {
  struct sigaction sa = {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaction(sig, &sa, nullptr);
}

// A step's line of --json output.
void PrintStepJson(const StepResult& res, Precision precision) {
  json line = {{"step", res.step},
               {"loss", res.loss},
               {"lr", res.lr},
               {"grad_norm", res.grad_norm},
               {"step_time_s", res.step_time_s},
               {"samples_per_s", res.samples_per_s}};
  if (precision == Precision::kFp16) {
    line["loss_scale"] = res.loss_scale;
    line["skipped"] = res.skipped;
  }
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// The last engine step --steps and --stop-after allow.
int64_t LastStep(const Engine& t, const TrainFlags& f) {
  return f.stop_after > 0 ? std::min(f.steps, t.step() + f.stop_after) : f.steps;
}

// --dp-mode async: the replicas run to the last step (or a stop request) in one RunAsync; then,
// on the root process, one line per engine step with the mean of its dp updates (in the order
// they were granted: the loss and norm of replica steps, not of one global batch).
RunRecord RunAsyncSteps(Engine& t, const TrainFlags& f, bool root, Precision precision,
                        MetricsCsv* metrics, int64_t seq_len, AsyncReport* report) {
  RunRecord rec;
  rec.first_step = t.step();
  const absl::Time start = absl::Now();
  absl::StatusOr<AsyncReport> r = t.RunAsync(LastStep(t, f));
  rec.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  if (!r.ok()) {
    rec.failure = r.status();
    return rec;
  }
  *report = *r;
  rec.stopped = r->stop_requested;
  const size_t D = static_cast<size_t>(t.topology().dp);
  for (int64_t s = 0; s < r->steps && (s + 1) * D <= r->updates.size(); ++s) {
    StepResult res;
    res.step = rec.first_step + s;
    for (size_t u = s * D; u < (s + 1) * D; ++u) {
      res.loss += r->updates[u].loss / static_cast<double>(D);
      res.grad_norm += r->updates[u].grad_norm / static_cast<double>(D);
    }
    res.lr = r->updates[s * D].lr;
    res.step_time_s = r->wall_s / static_cast<double>(r->steps);
    res.samples_per_s = static_cast<double>(t.global_batch()) / res.step_time_s;
    rec.Add(res);
    if (root && f.json) PrintStepJson(res, precision);
    if (metrics != nullptr) metrics->Add(res, seq_len, 0, NAN);
  }
  if (r->steps > 0 && rec.losses.empty()) rec.total_time = r->wall_s;  // non-root processes
  return rec;
}

// --valid-data / --eval-every: the held-out loss of the run's current weights (EvaluateWeights
// over Engine::Weights(), so in one process only), printed as its own line.
struct Validation {
  const LayerGraph* graph = nullptr;
  std::shared_ptr<const TokenDataset> data;
  int64_t batches = 4;
  std::unique_ptr<Stage> stage;  // the model instantiated once, its weights refreshed each time
  absl::StatusOr<double> Evaluate(const Engine& t, bool json_lines, StepLog* log) {
    PW_ASSIGN_OR_RETURN(EvalResult r, EvaluateWeights(*graph, t.Weights(), *data, batches, &stage));
    if (json_lines) {
      json line = {{"eval",
                    {{"step", t.step()},
                     {"loss", r.loss},
                     {"perplexity", r.perplexity},
                     {"tokens", r.tokens},
                     {"data", data->Describe()}}}};
      std::printf("%s\n", line.dump().c_str());
    } else {
      log->Finish();  // a bar on a terminal ends its line first
      std::printf("eval at step %lld: loss %.4f, perplexity %.3f over %lld held-out tokens of %s\n",
                  static_cast<long long>(t.step()), r.loss, r.perplexity,
                  static_cast<long long>(r.tokens), data->Describe().c_str());
    }
    std::fflush(stdout);
    return r.loss;
  }
};

// Steps until --steps (or --stop-after more, or a stop request), printing one line per step on
// the root process; saves every --save-every steps and when stopped.
RunRecord RunSteps(Engine& t, const TrainFlags& f, bool root, const TrainOptions& options,
                   MetricsCsv* metrics, int64_t seq_len, Validation* valid) {
  const Precision precision = options.precision;
  RunRecord rec;
  rec.first_step = t.step();
  rec.last_loss_scale = options.loss_scale.initial_scale;
  StepLog log(rec.first_step, f.steps, f.log_every, !f.json && root);
  const absl::Time start = absl::Now();
  while (t.step() < f.steps && (f.stop_after == 0 || t.step() - rec.first_step < f.stop_after)) {
    absl::StatusOr<StepReport> r = t.Step();
    if (!r.ok()) {
      rec.failure = r.status();
      break;
    }
    const StepResult& res = r->result;
    rec.Add(res);
    double eval_loss = NAN;
    const bool last = t.step() >= f.steps || res.stop_requested ||
                      (f.stop_after > 0 && t.step() - rec.first_step >= f.stop_after);
    if (valid != nullptr && ((f.eval_every > 0 && t.step() % f.eval_every == 0) || last)) {
      absl::StatusOr<double> loss = valid->Evaluate(t, f.json, &log);
      if (!loss.ok()) {
        rec.failure = loss.status();
        break;
      }
      eval_loss = *loss;
    }
    if (metrics != nullptr) {
      int64_t peak = 0;
      for (const RankTimes& rt : r->ranks) peak = std::max(peak, rt.peak_memory_bytes);
      metrics->Add(res, seq_len, peak, eval_loss);
    }
    const bool periodic = f.save_every > 0 && t.step() % f.save_every == 0;
    if (!f.save.empty() && (periodic || res.stop_requested)) {
      if (absl::Status s = SaveStep(t, f); !s.ok()) {
        rec.failure = s;
        break;
      }
      rec.saved_step = t.step();
    }
    if (res.stop_requested) rec.stopped = true;
    // Only the root process prints; every process takes the same steps (and stops after the
    // same one: the step agreement carries the stop request).
    if (!root) {
      if (rec.stopped) break;
      continue;
    }
    if (f.json) {
      PrintStepJson(res, precision);
    } else {
      log.Update(res.step + 1, absl::StrFormat("loss %.4f  lr %.2e  %.0f samples/s", res.loss,
                                               res.lr, res.samples_per_s));
    }
    if (rec.stopped) break;
  }
  log.Finish();
  rec.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  return rec;
}

// The trace (written even after a failure in one process: it shows where each rank was) and
// the measured timeline.
absl::Status WriteOutputs(const Engine& t, const TrainFlags& f, const RunRecord& rec) {
  if (!f.trace.empty() && (rec.failure.ok() || !t.multi_process())) {
    PW_RETURN_IF_ERROR(WriteFile(f.trace, EngineChromeTrace(t.topology(), t.Events()), "--trace"));
  }
  PW_RETURN_IF_ERROR(rec.failure);
  if (!f.svg.empty() && t.step() > rec.first_step) {
    // The last step's measured timeline of every rank, drawn like the simulator's.
    PW_RETURN_IF_ERROR(WriteFile(
        f.svg, MeasuredTimelineSvg(t.schedule(), t.topology(), t.Events(), t.step() - 1), "--svg"));
  }
  return absl::OkStatus();
}

// --data (memory-mapped: a process whose ranks load no data never touches its pages), slowed by
// --data-delay-us for loader benchmarks, and checked against the model's vocabulary.
absl::StatusOr<std::shared_ptr<const TokenDataset>> OpenTrainData(const TrainFlags& f,
                                                                  const LayerGraph& graph) {
  PW_ASSIGN_OR_RETURN(std::shared_ptr<const TokenDataset> data,
                      OpenDataset(f.data, graph.shape().seq_len, f.seed));
  PW_RETURN_IF_ERROR(CheckVocabulary(*data, kByteVocabulary));
  if (f.data_delay_us > 0) data = WithSampleDelay(data, absl::Microseconds(f.data_delay_us));
  return data;
}

// Whether `resume` names `save` or a checkpoint inside it (--resume DIR/step-000040 --save DIR
// rewinds a run in its own directory).
bool ResumesFromSaveDir(const TrainFlags& f) {
  if (f.resume == "auto") return true;
  if (f.resume.empty() || f.save.empty()) return false;
  std::error_code ec;
  const std::filesystem::path save = std::filesystem::weakly_canonical(f.save, ec);
  const std::filesystem::path from = std::filesystem::weakly_canonical(f.resume, ec);
  return from == save || from.parent_path() == save;
}

// Note [Starting on a checkpoint directory]. Before anything is built, the root process takes
// --save DIR's lock (a second writer is refused at once, and an unwritable DIR fails here, not
// after training), then recovers what interrupted saves left (a complete copy of a checkpoint
// whose rename a kill interrupted is put back, the rest removed), and refuses to start a run
// afresh into a DIR that already holds checkpoints: its saves would replace them.
absl::StatusOr<std::optional<CheckpointLock>> PrepareSaveDir(const TrainFlags& f, bool root) {
  if (f.save.empty() || !root) return std::nullopt;
  absl::StatusOr<CheckpointLock> lock = CheckpointLock::Acquire(f.save);
  if (!lock.ok()) {
    return absl::Status(lock.status().code(), absl::StrCat("--save: ", lock.status().message()));
  }
  PW_ASSIGN_OR_RETURN(RecoveryReport recovered, RecoverInterruptedSaves(f.save));
  for (const auto& [from, to] : recovered.restored) {
    std::fprintf(stderr, "restored the complete checkpoint '%s' to '%s' (an interrupted save)\n",
                 from.c_str(), to.c_str());
  }
  for (const std::string& p : recovered.removed) {
    std::fprintf(stderr, "removed '%s', left by an interrupted save\n", p.c_str());
  }
  if (!ResumesFromSaveDir(f) && HoldsCheckpoints(f.save)) {
    absl::StatusOr<std::string> newest = ResolveCheckpointDir(f.save);
    return absl::FailedPreconditionError(absl::StrCat(
        "--save ", f.save, " already holds checkpoints",
        newest.ok() ? absl::StrCat(" (newest: ", *newest, ")") : std::string(),
        ": a run started afresh would replace them. Continue them with --resume auto, or save "
        "into another directory"));
  }
  return std::optional<CheckpointLock>(*std::move(lock));
}

// " (saved by a pp P x dp D run, seed S, data SOURCE)": what the manifest of checkpoint
// `path` records of the run that wrote it; "" when it records none of it.
std::string CheckpointRunDescription(const std::string& path) {
  absl::StatusOr<std::string> text = ReadCheckpointManifest(path);
  if (!text.ok()) return "";
  const json m = json::parse(*text, nullptr, false);
  if (!m.is_object()) return "";
  std::vector<std::string> parts;
  auto number = [&](const char* section, const char* key) -> std::optional<int64_t> {
    if (!m.contains(section) || !m[section].is_object()) return std::nullopt;
    const json& v = m[section].value(key, json());
    if (!v.is_number_unsigned()) return std::nullopt;
    return v.get<int64_t>();
  };
  const std::optional<int64_t> pp = number("plan", "pipeline_parallel"),
                               dp = number("plan", "data_parallel"),
                               tp = number("plan", "tensor_parallel");  // absent before tp
  if (pp && dp) {
    parts.push_back(absl::StrCat("saved by a pp ", *pp, " x dp ", *dp,
                                 tp && *tp > 1 ? absl::StrCat(" x tp ", *tp) : "", " run"));
  }
  if (m.contains("rng") && m["rng"].is_object() && m["rng"].value("seed", json()).is_number()) {
    parts.push_back(absl::StrCat("seed ", m["rng"]["seed"].dump()));
  }
  if (m.contains("data") && m["data"].is_object() &&
      m["data"].value("source", json()).is_string()) {
    parts.push_back(absl::StrCat("data ", m["data"]["source"].get<std::string>()));
  }
  return parts.empty() ? "" : absl::StrCat(" (", absl::StrJoin(parts, ", "), ")");
}

// --resume DIR, or --resume auto: --save DIR when it holds checkpoints (else a fresh start).
// Says on stderr what was resumed and every warning (checkpoints skipped, settings that differ
// from the checkpoint's). nullopt when the run starts at step 0.
absl::StatusOr<std::optional<ResumeInfo>> ResumeFromFlags(Engine& t, const TrainFlags& f,
                                                          bool root) {
  std::string from = f.resume;
  if (from == "auto") {
    if (!HoldsCheckpoints(f.save)) {
      if (root) {
        std::fprintf(stderr, "no checkpoint in '%s' yet: starting at step 0\n", f.save.c_str());
      }
      return std::nullopt;
    }
    from = f.save;
  }
  if (from.empty()) return std::nullopt;
  ResumeInfo info;
  if (absl::Status s = t.Resume(from, &info); !s.ok()) {
    if (f.resume == "auto" && (absl::IsDataLoss(s) || absl::IsNotFound(s))) {
      // Starting over would overwrite what is there: the user decides.
      return absl::DataLossError(absl::StrCat(
          s.message(),
          ". --resume auto does not start over on a directory that holds "
          "checkpoints (its saves would replace them): move them away or save elsewhere"));
    }
    return s;
  }
  if (info.step > f.steps) {
    return absl::InvalidArgumentError(
        absl::StrCat(info.path, " is at step ", info.step, ", past --steps ", f.steps,
                     " (--steps is the total a resumed run continues to)"));
  }
  if (root) {
    for (const std::string& w : info.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
    if (info.step < f.steps) {
      std::fprintf(stderr, "resumed from %s at step %lld%s (the run continues to step %lld)\n",
                   info.path.c_str(), static_cast<long long>(info.step),
                   CheckpointRunDescription(info.path).c_str(), static_cast<long long>(f.steps));
    }
  }
  return info;
}

// Whether this process is a launcher's root (or the only process): set once the World exists.

// The flags with what a resumed run takes from its checkpoint when not given: the seed (every
// sample depends on it; a different one is refused by the resume), and the model when no
// --preset, --plan or --program names one (the preset, its head's tying and its micro-batch
// size, as the manifest records them; said on stderr).
absl::StatusOr<TrainFlags> WithCheckpointDefaults(const TrainFlags& given) {
  TrainFlags f = given;
  const std::string from = f.resume == "auto" ? f.save : f.resume;
  if (from.empty() || !HoldsCheckpoints(from)) return f;
  absl::StatusOr<std::string> manifest = ReadCheckpointManifest(from);
  if (!manifest.ok()) return f;  // the resume itself reports what is wrong
  json m = json::parse(*manifest, nullptr, false);
  if (!m.is_object()) return f;
  if (f.given.count("--seed") == 0 && m.contains("rng") && m["rng"].is_object() &&
      m["rng"].contains("seed") && m["rng"]["seed"].is_number_unsigned()) {
    f.seed = m["rng"]["seed"].get<uint64_t>();
  }
  const bool model_given = f.given.count("--preset") > 0 || f.given.count("--model") > 0 ||
                           !f.plan.empty() || !f.program.empty();
  if (model_given || !m.contains("model") || !m["model"].is_object()) return f;
  const json& model = m["model"];
  if (!model.contains("name") || !model["name"].is_string()) return f;
  const std::string name = model["name"].get<std::string>();
  const std::vector<std::string>& presets = TrainablePresets();
  if (std::find(presets.begin(), presets.end(), name) == presets.end() && !IsModelSpec(name)) {
    return f;
  }
  f.preset = name;
  if (f.given.count("--tied") == 0 && PresetGptConfig(name).ok() && model.contains("layers") &&
      model["layers"].is_array()) {
    for (const json& l : model["layers"]) {
      if (l.is_object() && l.value("kind", "") == "lm_head") {
        f.tied = l.value("config", "").find("tied_to=") != std::string::npos ? 1 : 0;
      }
    }
  }
  if (f.given.count("--micro-batch-size") == 0 && model.contains("micro_batch_size") &&
      model["micro_batch_size"].is_number_unsigned()) {
    f.micro_batch_size =
        std::min<int64_t>(model["micro_batch_size"].get<int64_t>(), kMaxMicroBatchSize);
  }
  if (TrainRootProcess()) {
    std::fprintf(stderr, "model %s%s from the checkpoint's manifest (no --preset given)\n",
                 name.c_str(), f.tied == 1 ? " (tied head)" : "");
  }
  return f;
}

}  // namespace

absl::Status RunTrain(const TrainFlags& given) {
  PW_RETURN_IF_ERROR(CheckFlags(given));
  PW_ASSIGN_OR_RETURN(const TrainFlags f, WithCheckpointDefaults(given));
  // OpenBLAS stays single-threaded (its threads are process-wide): each rank splits its own
  // products over its own threads (--threads-per-rank).
  SetCpuKernelThreads(1);
  PW_ASSIGN_OR_RETURN(LoadedModel model, LoadModel(f));
  PW_ASSIGN_OR_RETURN(RunSpec run, RunFromFlags(f, model));
  PW_ASSIGN_OR_RETURN(TrainOptions options, OptionsFromFlags(f));
  if (model.plan && f.zero < 0) options.zero = model.plan->zero;  // the plan's choice
  PW_ASSIGN_OR_RETURN(const TrainTestingHooks hooks, HooksFromFlags(f));
  // The engine's own checks, before any process is launched or data opened; ReportError says
  // them in flags (FieldFlags, tools/flags.h).
  PW_RETURN_IF_ERROR(ValidateTrainOptions(options, run.data_parallel));
  PW_RETURN_IF_ERROR(ValidateTrainTestingHooks(hooks, run.data_parallel));
  PW_ASSIGN_OR_RETURN(WorldOptions world_options, WorldFromFlags(f));
  PW_ASSIGN_OR_RETURN(std::shared_ptr<const Dataset> data, OpenTrainData(f, model.graph));
  // Under mpirun or srun this process is one rank of the pp x dp grid (docs/cluster.md).
  PW_ASSIGN_OR_RETURN(World world, Launch(world_options));
  const bool root = world.is_root();
  train_root_process = root;
  PW_ASSIGN_OR_RETURN(std::optional<CheckpointLock> lock, PrepareSaveDir(f, root));
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                      Engine::Create(model.graph, std::move(run), options, data, std::move(world)));
  Engine& t = *engine;
  PW_RETURN_IF_ERROR(t.SetTestingHooks(hooks));
  PW_ASSIGN_OR_RETURN(std::optional<ResumeInfo> resumed, ResumeFromFlags(t, f, root));
  // A run already at --steps has nothing to do, and its checkpoint is not written again.
  if (resumed && resumed->step == f.steps) {
    if (root) {
      std::fprintf(
          stderr, "nothing to train: %s is already at --steps %lld%s\n", resumed->path.c_str(),
          static_cast<long long>(f.steps),
          f.calibrate_out.empty() ? "" : " (no step measured: --calibrate-out not written)");
      if (f.json) {
        json summary = {{"steps", 0},
                        {"final_step", resumed->step},
                        {"resumed_from", resumed->path},
                        {"checkpoint", f.save}};
        std::printf("%s\n", json{{"summary", summary}}.dump().c_str());
      }
    }
    return absl::OkStatus();
  }
  std::unique_ptr<Validation> valid;
  if (!f.valid_data.empty() || f.eval_every > 0) {
    if (t.multi_process()) {
      return absl::InvalidArgumentError(
          "--valid-data and --eval-every evaluate in one process (every rank's weights are "
          "there); under a launcher, evaluate the run's checkpoints with `pipewright eval`");
    }
    if (options.dp_mode == DpMode::kAsync) {
      return absl::InvalidArgumentError(
          "--valid-data and --eval-every need --dp-mode sync (asynchronous replicas have no "
          "single set of weights between steps)");
    }
    valid = std::make_unique<Validation>();
    valid->graph = &model.graph;
    valid->batches = f.eval_batches;
    PW_ASSIGN_OR_RETURN(valid->data, OpenDataset(f.valid_data.empty() ? f.data : f.valid_data,
                                                 model.graph.shape().seq_len, f.seed));
    PW_RETURN_IF_ERROR(CheckVocabulary(*valid->data, kByteVocabulary));
  }
  std::unique_ptr<MetricsCsv> metrics;
  if (root && !f.metrics.empty()) {
    // Model FLOPs of one sequence (the graph's costs are per micro-batch), and the devices' peak.
    const Cost cost = model.graph.TotalCost();
    const double per_sample = (cost.forward_flops + cost.backward_flops) /
                              static_cast<double>(std::max<int64_t>(1, model.graph.shape().batch));
    const double devices = static_cast<double>(t.run().pipeline_parallel()) *
                           t.run().data_parallel * t.run().tensor_parallel;
    PW_ASSIGN_OR_RETURN(metrics,
                        MetricsCsv::Open(f.metrics, per_sample, f.peak_tflops * 1e12 * devices));
  }
  InstallStopSignals();
  if (!f.json && root) PrintHeader(model.graph, t, options, data->Describe());
  RunRecord rec;
  AsyncReport async_report;
  {
    FlightWatcher flight(t, !f.flight_dir.empty() ? f.flight_dir : !f.save.empty() ? f.save : ".");
    const int64_t seq_len = model.graph.shape().seq_len;
    rec = options.dp_mode == DpMode::kAsync
              ? RunAsyncSteps(t, f, root, options.precision, metrics.get(), seq_len, &async_report)
              : RunSteps(t, f, root, options, metrics.get(), seq_len, valid.get());
    // What this run resumed from inside --save DIR is saved there already.
    if (rec.saved_step < 0 && resumed && ResumesFromSaveDir(f)) rec.saved_step = resumed->step;
    // A failed step (an error, a timeout, another rank's abort): every rank's last actions.
    if (!rec.failure.ok()) flight.Dump(t);
  }
  // Multi-process: every process joins in collecting the world's times and events, which the
  // root then reports (after a failure the world is aborted and there is nothing to collect).
  if (t.multi_process() && rec.failure.ok()) PW_RETURN_IF_ERROR(t.GatherReports());
  // The final checkpoint, unless the loop just saved this step: every process takes part.
  if (rec.failure.ok() && !f.save.empty() && rec.saved_step != t.step()) {
    rec.failure = SaveStep(t, f);
    if (rec.failure.ok()) rec.saved_step = t.step();
  }
  if (!root) return rec.failure;
  PW_RETURN_IF_ERROR(WriteOutputs(t, f, rec));
  if (rec.stopped) {
    std::fprintf(
        stderr, "stopped by request after step %lld%s\n", static_cast<long long>(t.step()),
        f.save.empty()
            ? " (no --save: nothing written)"
            : absl::StrCat(", checkpoint ", f.save, "/", StepCheckpointName(t.step())).c_str());
  }
  ReportInput in;
  in.graph = &model.graph;
  in.engine = &t;
  in.plan = model.plan ? &*model.plan : nullptr;
  in.record = &rec;
  in.precision = options.precision;
  in.plan_file = f.plan;
  in.trace = f.trace;
  in.svg = f.svg;
  in.checkpoint = f.save;
  in.grad_compression = options.grad_compression;
  in.zero = options.zero;
  if (options.dp_mode == DpMode::kAsync) {
    in.async = &async_report;
    in.staleness = options.staleness;
  }
  const json summary = PrintSummary(in, f.json);
  if (!f.calibrate_out.empty()) {
    PW_ASSIGN_OR_RETURN(
        const ModelCosts calibrated,
        CalibrateFromSummary(ToModelCosts(model.graph), summary, "the run", &t.schedule()));
    PW_RETURN_IF_ERROR(
        WriteFile(f.calibrate_out, ModelCostsToJson(calibrated) + "\n", "--calibrate-out"));
    std::fprintf(stderr, "calibrated model costs: %s (plan with `pipewright plan --model %s`)\n",
                 f.calibrate_out.c_str(), f.calibrate_out.c_str());
  }
  return absl::OkStatus();
}

}  // namespace pipewright::tools
