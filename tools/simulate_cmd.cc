// `pipewright simulate`: generate (or load) a pipeline schedule, lower and validate it, then
// predict its makespan, bubble and peak memory; optionally write a Chrome trace and an SVG.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "pipewright/schedule.h"
#include "pipewright/simulator.h"
#include "pipewright/status.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {
namespace {

struct SimulateFlags {
  std::string schedule = "1f1b";
  int stages = 0, micro_batches = 0, chunks = 0;  // chunks 0: 2 for zb-v/dualpipev, else 1
  double cost_f = 1, cost_b = 1, cost_w = 0;
  bool cost_w_given = false;  // without --cost-w a split backward halves --cost-b (RunSimulate)
  double comm_latency = 0, comm_per_byte = 0, message_bytes = 0;
  double reduce_time = 0, optimizer_time = 0;
  bool json = false;
  std::string trace, svg, program;
};

absl::StatusOr<Schedule> BuildSchedule(const SimulateFlags& f) {
  ScheduleSpec spec;
  spec.ranks = f.stages;
  spec.micro_batches = f.micro_batches;
  if (!f.program.empty()) {
    PW_ASSIGN_OR_RETURN(std::string text, ReadFile(f.program, "--program"));
    // Without --stages and --micro-batches the text's own shape (ParseProgram): its "rank R:"
    // lines, the stages and micro-batches it names; with them, the placement they give.
    if (f.stages == 0 && f.micro_batches == 0 && f.chunks == 0) {
      absl::StatusOr<Schedule> s = ParseProgram(text);
      if (!s.ok()) {
        return absl::Status(s.status().code(), absl::StrCat(f.program, ": ", s.status().message()));
      }
      return s;
    }
    if (f.stages == 0 || f.micro_batches == 0) {
      return absl::InvalidArgumentError(
          "--program with --stages or --micro-batches needs both (or neither: the program's "
          "own shape)");
    }
    spec.kind = ScheduleKind::kCustom;
    spec.chunks = f.chunks > 0 ? f.chunks : 1;
    // ParseSchedule marks a text that spells out its communication as lowered.
    return ParseSchedule(text, spec);
  }
  if (f.stages == 0 || f.micro_batches == 0) {
    return absl::InvalidArgumentError(
        "simulate needs --stages and --micro-batches (or --program FILE, whose shape is its own)");
  }
  auto kind = ParseScheduleKind(f.schedule);
  if (!kind.ok()) return kind.status();
  if (*kind == ScheduleKind::kCustom) {
    return absl::InvalidArgumentError("--schedule custom needs --program FILE");
  }
  spec.kind = *kind;
  spec.chunks = f.chunks > 0 ? f.chunks : (IsVShaped(*kind) ? 2 : 1);
  return GenerateSchedule(spec);
}

absl::Status RunSimulate(const SimulateFlags& f) {
  // Outputs that cannot be written are refused before any work (WriteFile checks again).
  if (!f.trace.empty()) PW_RETURN_IF_ERROR(CheckOutputPath(f.trace, "--trace"));
  if (!f.svg.empty()) PW_RETURN_IF_ERROR(CheckOutputPath(f.svg, "--svg"));
  auto schedule = BuildSchedule(f);
  if (!schedule.ok()) return schedule.status();
  if (!schedule->lowered) {
    if (absl::Status st = LowerComm(*schedule); !st.ok()) return st;
  }
  if (absl::Status st = Validate(*schedule); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("invalid schedule: ", st.message()));
  }
  SimCosts costs;
  costs.f = f.cost_f;
  costs.b = f.cost_b;
  costs.w = f.cost_w;
  if (!f.cost_w_given && schedule->split_backward) {
    // A zero-bubble schedule needs a real W to show what it does: without --cost-w, --cost-b is
    // the whole backward, split evenly into I and W (a schedule without W runs it inside B).
    costs.b = f.cost_b / 2;
    costs.w = f.cost_b / 2;
  }
  costs.comm_latency = f.comm_latency;
  costs.comm_per_byte = f.comm_per_byte;
  costs.message_bytes = f.message_bytes;
  costs.reduce_time = f.reduce_time;
  costs.optimizer_time = f.optimizer_time;
  auto result = Simulate(*schedule, costs);
  if (!result.ok()) {
    // Costs are checked inside Simulate (InvalidArgument); anything else is a bad schedule.
    if (result.status().code() == absl::StatusCode::kInvalidArgument) return result.status();
    return absl::InvalidArgumentError(std::string(result.status().message()));
  }
  if (!f.trace.empty()) {
    if (absl::Status st = WriteFile(f.trace, ToChromeTrace(*schedule, *result) + "\n", "--trace");
        !st.ok()) {
      return st;
    }
  }
  if (!f.svg.empty()) {
    if (absl::Status st = WriteFile(f.svg, ToSvg(*schedule, *result), "--svg"); !st.ok()) return st;
  }
  const ScheduleSpec& spec = schedule->spec;
  if (f.json) {
    nlohmann::json ranks = nlohmann::json::array();
    for (size_t r = 0; r < result->ranks.size(); ++r) {
      ranks.push_back({{"rank", r},
                       {"busy", result->ranks[r].busy},
                       {"peak_inflight", result->ranks[r].peak_inflight}});
    }
    nlohmann::json j = {{"schedule", ScheduleKindName(spec.kind)},
                        {"stages", spec.ranks},
                        {"micro_batches", spec.micro_batches},
                        {"chunks", spec.chunks},
                        {"makespan", result->makespan},
                        {"bubble_fraction", result->bubble_fraction},
                        {"ranks", ranks}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("schedule %s  p=%d  m=%d  v=%d\n", ScheduleKindName(spec.kind), spec.ranks,
                spec.micro_batches, spec.chunks);
    std::printf("makespan %.6g  bubble %.2f%%\n", result->makespan, 100 * result->bubble_fraction);
    std::printf("%-6s %12s %14s\n", "rank", "busy", "peak_inflight");
    for (size_t r = 0; r < result->ranks.size(); ++r) {
      std::printf("%-6zu %12.6g %14.6g\n", r, result->ranks[r].busy,
                  result->ranks[r].peak_inflight);
    }
    if (!f.trace.empty()) std::printf("wrote trace %s\n", f.trace.c_str());
    if (!f.svg.empty()) std::printf("wrote svg %s\n", f.svg.c_str());
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterSimulate(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<SimulateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "simulate", "Predict a pipeline schedule's makespan, bubble and peak memory");
  cmd->add_option("--schedule", f->schedule,
                  "gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev");
  AddInt(cmd, "--stages", &f->stages, {1, kMaxParallel},
         "Pipeline ranks p (needed unless --program gives them)");
  AddInt(cmd, "--micro-batches", &f->micro_batches, {1, kMaxMicroBatches},
         "Micro-batches per step m (needed unless --program gives them)");
  AddInt(cmd, "--chunks", &f->chunks, {1, 4096},
         "Model chunks per rank v (default 1; zb-v, dualpipev: 2)");
  // Times in any one unit; a whole run's sums stay finite.
  const RealRange time = RealRange::Closed(0, 1e12);
  AddReal(cmd, "--cost-f", &f->cost_f, time, "Forward time of a whole stage");
  AddReal(cmd, "--cost-b", &f->cost_b, time, "Input-gradient backward time of a whole stage");
  CLI::Option* cost_w =
      AddReal(cmd, "--cost-w", &f->cost_w, time,
              "Weight-gradient backward time of a whole stage (B then runs --cost-b + --cost-w "
              "where W is not split off; not given: 0, and for zb-h1, zb-v, dualpipev "
              "--cost-b is the whole backward, split evenly into I and W)");
  AddReal(cmd, "--comm-latency", &f->comm_latency, time, "Latency per P2P message");
  AddReal(cmd, "--comm-per-byte", &f->comm_per_byte, time, "Transfer time per byte");
  AddReal(cmd, "--message-bytes", &f->message_bytes, RealRange::Closed(0, 1e15),
          "Bytes per P2P message");
  AddReal(cmd, "--reduce-time", &f->reduce_time, time, "REDUCE_GRADS time per stage");
  AddReal(cmd, "--optimizer-time", &f->optimizer_time, time, "OPTIMIZER_STEP time");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->add_option("--trace", f->trace, "Write a Chrome trace (Perfetto) to FILE");
  cmd->add_option("--svg", f->svg, "Write an SVG timeline to FILE");
  cmd->add_option("--program", f->program,
                  "Simulate a hand-written schedule (text form, kind custom) from FILE");
  cmd->callback([f, cost_w, exit_code] {
    f->cost_w_given = cost_w->count() > 0;
    absl::Status st = RunSimulate(*f);
    *exit_code = st.ok() ? 0 : ReportError(st);
  });
}

}  // namespace pipewright::tools
