// The action IR: names, text form of one action and of a whole schedule, stage placement.
#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "pipewright/schedule.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

struct KindName {
  ActionKind kind;
  const char* name;
};

// Longest names first so that prefix matching never takes "F" out of "SEND_F".
constexpr KindName kKindNames[] = {
    {ActionKind::kOptimizerStep, "OPTIMIZER_STEP"},
    {ActionKind::kReduceGrads, "REDUCE_GRADS"},
    {ActionKind::kSendF, "SEND_F"},
    {ActionKind::kRecvF, "RECV_F"},
    {ActionKind::kSendB, "SEND_B"},
    {ActionKind::kRecvB, "RECV_B"},
    {ActionKind::kF, "F"},
    {ActionKind::kB, "B"},
    {ActionKind::kI, "I"},
    {ActionKind::kW, "W"},
};

// Parses a non-negative decimal integer that is the whole of `s`.
bool ParseCount(absl::string_view s, int* out) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(s, out);
}

}  // namespace

const char* ActionKindName(ActionKind kind) {
  for (const KindName& k : kKindNames) {
    if (k.kind == kind) return k.name;
  }
  return "?";
}

bool IsCompute(ActionKind kind) {
  return kind == ActionKind::kF || kind == ActionKind::kB || kind == ActionKind::kI ||
         kind == ActionKind::kW;
}

bool IsComm(ActionKind kind) {
  return kind == ActionKind::kSendF || kind == ActionKind::kRecvF || kind == ActionKind::kSendB ||
         kind == ActionKind::kRecvB;
}

std::string Action::ToString() const {
  switch (kind) {
    case ActionKind::kOptimizerStep:
      return "OPTIMIZER_STEP";
    case ActionKind::kReduceGrads:
      return absl::StrCat("REDUCE_GRADS@s", virtual_stage);
    default:
      return absl::StrCat(ActionKindName(kind), micro_batch, "@s", virtual_stage);
  }
}

absl::StatusOr<Action> ParseAction(absl::string_view token) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("bad action '", token, "': ", why,
                                                   " (expected e.g. F3@s1, SEND_B0@s2, "
                                                   "REDUCE_GRADS@s1, OPTIMIZER_STEP)"));
  };
  Action a;
  absl::string_view rest = token;
  bool matched = false;
  for (const KindName& k : kKindNames) {
    if (absl::ConsumePrefix(&rest, k.name)) {
      a.kind = k.kind;
      matched = true;
      break;
    }
  }
  if (!matched) return bad("unknown action kind");
  if (a.kind == ActionKind::kOptimizerStep) {
    if (!rest.empty()) return bad("OPTIMIZER_STEP takes no micro-batch or stage");
    a.virtual_stage = 0;
    a.micro_batch = 0;
    return a;
  }
  size_t at = rest.find('@');
  if (at == absl::string_view::npos) return bad("missing '@s<stage>'");
  absl::string_view mb = rest.substr(0, at);
  absl::string_view stage = rest.substr(at + 1);
  if (a.kind == ActionKind::kReduceGrads) {
    if (!mb.empty()) return bad("REDUCE_GRADS takes no micro-batch");
    a.micro_batch = 0;
  } else {
    if (mb.empty()) return bad("missing micro-batch number");
    if (!ParseCount(mb, &a.micro_batch)) {
      return bad("micro-batch must be a non-negative integer");
    }
  }
  if (!absl::ConsumePrefix(&stage, "s")) return bad("stage must be written s<N>");
  if (stage.empty()) return bad("missing stage number");
  if (!ParseCount(stage, &a.virtual_stage)) {
    return bad("stage must be a non-negative integer");
  }
  return a;
}

const char* ScheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
    case ScheduleKind::kZbH1:
      return "zb-h1";
    case ScheduleKind::kZbV:
      return "zb-v";
    case ScheduleKind::kDualPipeV:
      return "dualpipev";
    case ScheduleKind::kCustom:
      return "custom";
  }
  return "?";
}

absl::StatusOr<ScheduleKind> ParseScheduleKind(absl::string_view name) {
  for (ScheduleKind k :
       {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved, ScheduleKind::kZbH1,
        ScheduleKind::kZbV, ScheduleKind::kDualPipeV, ScheduleKind::kCustom}) {
    if (name == ScheduleKindName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown schedule '", name,
                   "': expected one of gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipev, custom"));
}

// Custom schedules place stage s on rank s mod p (that is, s itself when v = 1), so a
// hand-written interleaved-style program can be checked too.
bool IsVShaped(ScheduleKind kind) {
  return kind == ScheduleKind::kZbV || kind == ScheduleKind::kDualPipeV;
}

int StageRank(const ScheduleSpec& spec, int stage) {
  const int p = spec.ranks < 1 ? 1 : spec.ranks;
  switch (spec.kind) {
    case ScheduleKind::kInterleaved:
    case ScheduleKind::kCustom:
      return stage % p;
    case ScheduleKind::kZbV:
    case ScheduleKind::kDualPipeV:
      return stage < p ? stage : 2 * p - 1 - stage;
    default:
      return stage;
  }
}

std::string ToText(const Schedule& schedule) {
  const ScheduleSpec& s = schedule.spec;
  std::string out = absl::StrCat("# ", ScheduleKindName(s.kind), " ranks=", s.ranks,
                                 " micro_batches=", s.micro_batches, " chunks=", s.chunks,
                                 " stages=", schedule.num_stages, "\n");
  for (const Program& prog : schedule.programs) {
    absl::StrAppend(&out, "rank ", prog.rank, ":");
    for (const Action& a : prog.actions) absl::StrAppend(&out, " ", a.ToString());
    out += "\n";
  }
  return out;
}

// zb-v and dualpipev always have two chunks; a spec that leaves chunks at its default of 1
// means 2.
static int EffectiveChunks(const ScheduleSpec& spec) {
  if (IsVShaped(spec.kind) && spec.chunks <= 1) return 2;
  return spec.chunks;
}

absl::StatusOr<Schedule> ParseSchedule(absl::string_view text, const ScheduleSpec& spec) {
  if (spec.ranks < 1 || spec.micro_batches < 1 || EffectiveChunks(spec) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule spec needs ranks >= 1, micro_batches >= 1 and chunks >= 1 (got ranks=",
        spec.ranks, " micro_batches=", spec.micro_batches, " chunks=", spec.chunks, ")"));
  }
  Schedule sched;
  sched.spec = spec;
  sched.spec.chunks = EffectiveChunks(spec);
  const int p = spec.ranks;
  const int m = spec.micro_batches;
  sched.num_stages = p * sched.spec.chunks;
  for (int s = 0; s < sched.num_stages; ++s) sched.stage_rank.push_back(StageRank(spec, s));
  sched.programs.resize(p);
  for (int r = 0; r < p; ++r) sched.programs[r].rank = r;
  std::vector<bool> seen(p, false);

  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    size_t hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    auto err = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": ", why));
    };
    size_t colon = line.find(':');
    absl::string_view head = absl::StripAsciiWhitespace(line.substr(0, colon));
    if (colon == absl::string_view::npos || !absl::ConsumePrefix(&head, "rank")) {
      return err(absl::StrCat("expected 'rank R: actions...', got '", line, "'"));
    }
    head = absl::StripLeadingAsciiWhitespace(head);
    int rank = -1;
    if (!ParseCount(head, &rank)) return err(absl::StrCat("bad rank number '", head, "'"));
    if (rank >= p) {
      return err(absl::StrCat("rank ", rank, " out of range: the schedule has ", p, " ranks"));
    }
    if (seen[rank]) return err(absl::StrCat("rank ", rank, " appears twice"));
    seen[rank] = true;
    for (absl::string_view tok :
         absl::StrSplit(line.substr(colon + 1), absl::ByAnyChar(" \t\r"), absl::SkipEmpty())) {
      auto parsed = ParseAction(tok);
      if (!parsed.ok()) return err(parsed.status().message());
      const Action& a = *parsed;
      if (a.kind != ActionKind::kOptimizerStep) {
        if (a.virtual_stage >= sched.num_stages) {
          return err(absl::StrCat("'", tok, "': stage ", a.virtual_stage,
                                  " out of range: the schedule has ", sched.num_stages,
                                  " stages (s0..s", sched.num_stages - 1, ")"));
        }
        int owner = sched.stage_rank[a.virtual_stage];
        if (owner != rank) {
          return err(absl::StrCat("'", tok, "' on rank ", rank, ": stage ", a.virtual_stage,
                                  " belongs to rank ", owner));
        }
      }
      if (a.kind != ActionKind::kOptimizerStep && a.kind != ActionKind::kReduceGrads &&
          a.micro_batch >= m) {
        return err(absl::StrCat("'", tok, "': micro-batch ", a.micro_batch,
                                " out of range: the step has ", m, " micro-batches (0..", m - 1,
                                ")"));
      }
      // Lowering also adds REDUCE_GRADS/OPTIMIZER_STEP, so any of them marks the text lowered.
      if (!IsCompute(a.kind)) sched.lowered = true;
      if (a.kind == ActionKind::kI || a.kind == ActionKind::kW) sched.split_backward = true;
      sched.programs[rank].actions.push_back(a);
    }
  }
  return sched;
}

// First pass over a hand-written program: its ranks, largest stage and micro-batch. Lines it
// cannot read are left to ParseSchedule, which reports them precisely.
absl::StatusOr<Schedule> ParseProgram(absl::string_view text) {
  int max_rank = -1, max_stage = -1, max_mb = -1, lines = 0;
  int64_t actions = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    size_t hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    size_t colon = line.find(':');
    if (line.empty() || colon == absl::string_view::npos) continue;
    absl::string_view head = absl::StripAsciiWhitespace(line.substr(0, colon));
    int rank = -1;
    if (!absl::ConsumePrefix(&head, "rank") ||
        !ParseCount(absl::StripLeadingAsciiWhitespace(head), &rank)) {
      continue;
    }
    ++lines;
    max_rank = std::max(max_rank, rank);
    for (absl::string_view tok :
         absl::StrSplit(line.substr(colon + 1), absl::ByAnyChar(" \t\r"), absl::SkipEmpty())) {
      absl::StatusOr<Action> a = ParseAction(tok);
      if (!a.ok() || a->kind == ActionKind::kOptimizerStep) continue;
      ++actions;
      max_stage = std::max(max_stage, a->virtual_stage);
      if (a->kind != ActionKind::kReduceGrads) max_mb = std::max(max_mb, a->micro_batch);
    }
  }
  if (lines == 0) {
    return absl::InvalidArgumentError("the program has no 'rank R: actions...' lines");
  }
  const int p = max_rank + 1;
  if (lines != p) {
    return absl::InvalidArgumentError(absl::StrCat("the program names rank ", max_rank, " but has ",
                                                   lines,
                                                   " rank lines: write one line for every rank 0..",
                                                   max_rank, " (an idle rank as 'rank R:')"));
  }
  // Every stage and every micro-batch needs actions of its own: a larger index is a typo (and
  // sizing tables by it would cost memory and time for nothing).
  if (max_stage >= actions || max_mb >= actions) {
    return absl::InvalidArgumentError(
        absl::StrCat("the program names ", max_stage >= actions ? "stage s" : "micro-batch ",
                     max_stage >= actions ? max_stage : max_mb, " but has only ", actions,
                     " actions: every stage and micro-batch needs actions of its own"));
  }
  const int stages = std::max(max_stage + 1, p);
  if (stages % p != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the program uses stages s0..s", max_stage, " on ", p, " ranks: the number of stages (",
        stages, ") must be a multiple of the ranks (stage s runs on rank s mod ", p, ")"));
  }
  if (max_mb < 0) return absl::InvalidArgumentError("the program runs no micro-batch");
  // Like a plan's: a 60 MB text of F0@s0 B0@s0 F1@s0 B1@s0 ... is a step of millions of
  // micro-batches, which the engine would try to hold.
  if (const int64_t pairs = int64_t{stages} * (int64_t{max_mb} + 1);
      pairs > kMaxStageMicroBatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the program runs ", stages, " stages x ", max_mb + 1, " micro-batches = ", pairs,
        " (stage, micro-batch) pairs; a program has at most ", kMaxStageMicroBatches));
  }
  ScheduleSpec spec{ScheduleKind::kCustom, p, max_mb + 1, stages / p};
  return ParseSchedule(text, spec);
}

}  // namespace pipewright
