// Event-driven simulation of a lowered schedule.
//
// Every rank executes its program strictly in order on its own clock. Compute actions take
// their cost, REDUCE_GRADS / OPTIMIZER_STEP take reduce_time / optimizer_time, sends take no
// time and post a message that becomes available latency + bytes * per_byte later, and a
// receive completes at max(rank clock, availability). The simulation sweeps the ranks, running
// each as far as it can, until all are done or none can move (a deadlock). Because a rank's
// times depend only on its own earlier actions and on message availabilities, the sweep order
// does not change the result.
//
// Conventions (see also simulator.h):
//   * busy counts every action with a duration: F/B/I/W, REDUCE_GRADS and OPTIMIZER_STEP, and
//     bubble_fraction = 1 - sum(busy) / (p * makespan), i.e. the idle share.
//   * a receive's timeline event spans its wait: start = the rank's clock when it reached the
//     receive, end = when the message arrived (equal when no wait). Sends have start == end.
//   * peak_inflight adds 1/v when an F starts and removes 1/v when the matching B ends (W when
//     the backward is split); a removal and an addition at the same instant do not overlap.
#include "pipewright/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pipewright {
namespace {

// The messages of one (direction, receiving stage, micro-batch): the stages fix both ranks. A
// valid schedule sends each once; a repeat queues behind the first (FIFO), in `more`.
struct MsgSlot {
  double first = 0;
  uint32_t posted = 0, used = 0;
};

// The slots by key, (direction * S + stage) * M + micro-batch: a flat array where the programs'
// messages fill it (a valid schedule's send and receive every key), else a hash map, so memory
// follows the programs whatever sizes the spec claims.
class MsgSlots {
 public:
  MsgSlots(uint64_t keys, size_t messages) {
    if (keys <= messages + 1024) {
      dense_.resize(keys);
    } else {
      sparse_.reserve(messages);
    }
  }
  MsgSlot& Get(uint64_t key) { return dense_.empty() ? sparse_[key] : dense_[key]; }
  MsgSlot* Find(uint64_t key) {
    if (!dense_.empty()) return &dense_[key];
    auto it = sparse_.find(key);
    return it == sparse_.end() ? nullptr : &it->second;
  }

 private:
  std::vector<MsgSlot> dense_;
  absl::flat_hash_map<uint64_t, MsgSlot> sparse_;
};

bool FiniteNonNegative(double x) { return std::isfinite(x) && x >= 0; }

absl::Status CheckCosts(const SimCosts& c, int num_stages) {
  for (double x : {c.f, c.b, c.w, c.comm_latency, c.comm_per_byte, c.message_bytes, c.reduce_time,
                   c.optimizer_time}) {
    if (!FiniteNonNegative(x)) {
      return absl::InvalidArgumentError("simulate: costs must be finite and >= 0");
    }
  }
  const std::pair<const char*, const std::vector<double>*> per_stage[] = {
      {"stage_f", &c.stage_f}, {"stage_b", &c.stage_b}, {"stage_w", &c.stage_w}};
  for (const auto& [name, vec] : per_stage) {
    if (vec->empty()) continue;
    if (static_cast<int>(vec->size()) != num_stages) {
      return absl::InvalidArgumentError(absl::StrCat("simulate: ", name, " has ", vec->size(),
                                                     " entries, expected one per virtual stage (",
                                                     num_stages, ")"));
    }
    for (double x : *vec) {
      if (!FiniteNonNegative(x)) {
        return absl::InvalidArgumentError(
            absl::StrCat("simulate: ", name, " costs must be finite and >= 0"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SimResult> Simulate(const Schedule& schedule, const SimCosts& costs,
                                   const SimOptions& options) {
  if (!schedule.lowered) {
    return absl::FailedPreconditionError(
        "simulate: the schedule is not lowered (run LowerComm first)");
  }
  const int p = static_cast<int>(schedule.programs.size());
  const int S = schedule.num_stages;
  if (p < 1) return absl::InvalidArgumentError("simulate: the schedule has no programs");
  if (S < 1 || static_cast<int>(schedule.stage_rank.size()) != S) {
    return absl::InvalidArgumentError(absl::StrCat(
        "simulate: stage_rank has ", schedule.stage_rank.size(), " entries for ", S, " stages"));
  }
  for (int s = 0; s < S; ++s) {
    if (schedule.stage_rank[s] < 0 || schedule.stage_rank[s] >= p) {
      return absl::InvalidArgumentError(absl::StrCat("simulate: stage ", s, " is placed on rank ",
                                                     schedule.stage_rank[s], " of ", p));
    }
  }
  if (absl::Status st = CheckCosts(costs, S); !st.ok()) return st;
  const double v = std::max(1, schedule.spec.chunks);
  const int M = std::max(1, schedule.spec.micro_batches);

  // Static checks of every action, so the main loop can index freely.
  for (int r = 0; r < p; ++r) {
    for (const Action& a : schedule.programs[r].actions) {
      if (a.kind == ActionKind::kOptimizerStep) continue;
      if (a.virtual_stage < 0 || a.virtual_stage >= S) {
        return absl::InvalidArgumentError(absl::StrCat(
            "simulate: rank ", r, " action ", a.ToString(), " names a stage outside [0, ", S, ")"));
      }
      if (IsComm(a.kind) && (a.micro_batch < 0 || a.micro_batch >= M)) {
        return absl::InvalidArgumentError(
            absl::StrCat("simulate: rank ", r, " action ", a.ToString(),
                         " names a micro-batch outside [0, ", M, ")"));
      }
      const bool bad_neighbour = (a.kind == ActionKind::kRecvF && a.virtual_stage == 0) ||
                                 (a.kind == ActionKind::kSendF && a.virtual_stage == S - 1) ||
                                 (a.kind == ActionKind::kRecvB && a.virtual_stage == S - 1) ||
                                 (a.kind == ActionKind::kSendB && a.virtual_stage == 0);
      if (bad_neighbour) {
        return absl::InvalidArgumentError(absl::StrCat("simulate: rank ", r, " action ",
                                                       a.ToString(), " has no neighbour stage"));
      }
    }
  }

  auto duration = [&](const Action& a) -> double {
    const int s = a.virtual_stage;
    const double f = costs.stage_f.empty() ? costs.f / v : costs.stage_f[s];
    const double b = costs.stage_b.empty() ? costs.b / v : costs.stage_b[s];
    const double w = costs.stage_w.empty() ? costs.w / v : costs.stage_w[s];
    switch (a.kind) {
      case ActionKind::kF:
        return f;
      case ActionKind::kB:
        return schedule.split_backward ? b : b + w;
      case ActionKind::kI:
        return b;
      case ActionKind::kW:
        return w;
      case ActionKind::kReduceGrads:
        return costs.reduce_time;
      case ActionKind::kOptimizerStep:
        return costs.optimizer_time;
      default:
        return 0.0;
    }
  };
  const double msg_delay = costs.comm_latency + costs.message_bytes * costs.comm_per_byte;

  // Message slots by (direction, receiving stage, micro-batch), one per message the programs
  // send or receive: memory in proportion to the programs, whatever the spec's sizes say.
  size_t messages = 0;
  for (const Program& prog : schedule.programs) {
    for (const Action& a : prog.actions) messages += IsComm(a.kind) ? 1 : 0;
  }
  MsgSlots slots(static_cast<uint64_t>(2) * S * M, messages);
  std::map<uint64_t, std::vector<double>> more;  // availability of repeated sends, FIFO
  auto slot_of = [&](bool fwd, int stage, int mb) {
    return (static_cast<uint64_t>(fwd ? 0 : 1) * S + stage) * M + mb;
  };
  std::vector<size_t> pc(p, 0);
  std::vector<double> clock(p, 0.0);
  std::vector<std::vector<SimEvent>> events(p);
  // Without a timeline, what the result needs of each rank's events as they happen.
  std::vector<double> busy(p, 0.0), inflight(p, 0.0), peak(p, 0.0);

  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& acts = schedule.programs[r].actions;
      while (pc[r] < acts.size()) {
        const Action& a = acts[pc[r]];
        SimEvent ev{r, a, clock[r], clock[r]};
        if (a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB) {
          const bool fwd = a.kind == ActionKind::kSendF;
          const uint64_t k = slot_of(fwd, a.virtual_stage + (fwd ? 1 : -1), a.micro_batch);
          MsgSlot& m = slots.Get(k);
          if (m.posted++ == 0) {
            m.first = clock[r] + msg_delay;
          } else {
            more[k].push_back(clock[r] + msg_delay);
          }
        } else if (a.kind == ActionKind::kRecvF || a.kind == ActionKind::kRecvB) {
          const uint64_t k = slot_of(a.kind == ActionKind::kRecvF, a.virtual_stage, a.micro_batch);
          MsgSlot* m = slots.Find(k);
          if (m == nullptr || m->used >= m->posted) break;  // blocked
          ev.end = std::max(clock[r], m->used == 0 ? m->first : more[k][m->used - 1]);
          ++m->used;
        } else {
          ev.end = clock[r] + duration(a);
        }
        clock[r] = ev.end;
        const ActionKind kind = a.kind;
        if (!IsComm(kind)) busy[r] += ev.end - ev.start;
        if (kind == ActionKind::kF) {
          inflight[r] += 1.0 / v;
          peak[r] = std::max(peak[r], inflight[r]);
        } else if (kind == ActionKind::kB || (kind == ActionKind::kW && schedule.split_backward)) {
          inflight[r] -= 1.0 / v;
        }
        if (options.timeline) events[r].push_back(ev);
        ++pc[r];
        progress = true;
      }
    }
  }

  std::vector<std::string> stuck;
  for (int r = 0; r < p; ++r) {
    if (pc[r] < schedule.programs[r].actions.size()) {
      stuck.push_back(
          absl::StrCat("rank ", r, " waits on ", schedule.programs[r].actions[pc[r]].ToString()));
    }
  }
  if (!stuck.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("deadlock: ", absl::StrJoin(stuck, "; ")));
  }

  SimResult result;
  result.ranks.resize(p);
  double total_busy = 0;
  for (int r = 0; r < p; ++r) {
    SimRank& sr = result.ranks[r];
    sr.busy = busy[r];
    sr.peak_inflight = peak[r];
    // Snap values that are whole multiples of 1/v up to rounding (e.g. 5.499999 -> 5.5).
    const double snapped = std::round(sr.peak_inflight * v) / v;
    if (std::fabs(snapped - sr.peak_inflight) < 1e-9) sr.peak_inflight = snapped;
    total_busy += sr.busy;
    if (pc[r] > 0) result.makespan = std::max(result.makespan, clock[r]);
  }
  result.bubble_fraction =
      result.makespan > 0 ? 1.0 - total_busy / (static_cast<double>(p) * result.makespan) : 0.0;
  for (int r = 0; r < p; ++r) {
    std::stable_sort(events[r].begin(), events[r].end(),
                     [](const SimEvent& x, const SimEvent& y) { return x.start < y.start; });
    result.timeline.insert(result.timeline.end(), events[r].begin(), events[r].end());
  }
  return result;
}

}  // namespace pipewright
