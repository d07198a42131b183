// The validator: executes every rank's program against FIFO channels and checks the data
// dependencies of every action (see Validate in schedule.h).
//
// Note [Validator execution]. Ranks run round-robin; each runs until its next action is a
// receive whose channel is empty (sends never block). A receive whose channel holds a
// different message at its head is an error at once: FIFO channels cannot reorder, so that
// receive could never succeed. When no rank can progress and some are unfinished, the
// unfinished ones are deadlocked and the error lists each with the action it waits on.
// Everything else an action needs is local (its own rank ran it earlier or it did not), so a
// missing dependency is reported as an error naming the action, never as a wait.
#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipewright/schedule.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

enum Dir { kDirF = 0, kDirB = 1 };
using ChannelKey = std::tuple<int, int, int>;  // (src rank, dst rank, direction)

class Executor {
 public:
  explicit Executor(const Schedule& s)
      : sched_(s),
        S_(s.num_stages),
        m_(s.spec.micro_batches),
        f_(m_ * S_, -1),
        b_(m_ * S_, false),
        i_(m_ * S_, false),
        w_(m_ * S_, false),
        recv_f_(m_ * S_, false),
        recv_b_(m_ * S_, false),
        sent_f_(m_ * S_, false),
        sent_b_(m_ * S_, false),
        reduced_(S_, false),
        pc_(s.programs.size(), 0),
        opt_done_(s.programs.size(), false) {}

  absl::Status Run() {
    const int p = static_cast<int>(sched_.programs.size());
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < p; ++r) {
        const auto& acts = sched_.programs[r].actions;
        while (pc_[r] < acts.size()) {
          bool blocked = false;
          PW_RETURN_IF_ERROR(Step(r, acts[pc_[r]], &blocked));
          if (blocked) break;
          ++pc_[r];
          progress = true;
        }
      }
    }
    std::vector<std::string> stuck;
    for (int r = 0; r < p; ++r) {
      const auto& acts = sched_.programs[r].actions;
      if (pc_[r] < acts.size()) {
        stuck.push_back(absl::StrCat("rank ", r, " waits on ", acts[pc_[r]].ToString()));
      }
    }
    if (!stuck.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("deadlock: ", absl::StrJoin(stuck, "; ")));
    }
    std::vector<std::string> left;
    for (const auto& [key, q] : channels_) {
      for (const Action& a : q) {
        left.push_back(absl::StrCat(a.ToString(), " from rank ", std::get<0>(key), " to rank ",
                                    std::get<1>(key)));
      }
    }
    if (!left.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("unreceived messages: ", Head(left)));
    }
    std::vector<std::string> missing;
    for (int mb = 0; mb < m_; ++mb) {
      for (int s = 0; s < S_; ++s) {
        int k = Idx(mb, s);
        if (f_[k] < 0) missing.push_back(Action{ActionKind::kF, s, mb}.ToString());
        if (!b_[k] && !i_[k]) {
          missing.push_back(
              Action{sched_.split_backward ? ActionKind::kI : ActionKind::kB, s, mb}.ToString());
        }
        if (i_[k] && !w_[k]) missing.push_back(Action{ActionKind::kW, s, mb}.ToString());
      }
    }
    if (!missing.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("missing actions (never run by any rank): ", Head(missing)));
    }
    return absl::OkStatus();
  }

 private:
  static std::string Head(const std::vector<std::string>& v) {
    const size_t kShow = 8;
    std::vector<std::string> head(v.begin(), v.begin() + std::min(v.size(), kShow));
    std::string out = absl::StrJoin(head, ", ");
    if (v.size() > kShow) absl::StrAppend(&out, " and ", v.size() - kShow, " more");
    return out;
  }
  int Idx(int mb, int s) const { return mb * S_ + s; }
  int Owner(int s) const { return sched_.stage_rank[s]; }
  bool GradDone(int k) const { return b_[k] || w_[k]; }

  absl::Status Err(int r, const Action& a, absl::string_view why) const {
    return absl::FailedPreconditionError(absl::StrCat("rank ", r, " ", a.ToString(), ": ", why));
  }

  absl::Status Step(int r, const Action& a, bool* blocked) {
    const int s = a.virtual_stage;
    const int mb = a.micro_batch;
    if (a.kind == ActionKind::kOptimizerStep) {
      if (opt_done_[r]) return Err(r, a, "runs twice");
      for (int st = 0; st < S_; ++st) {
        if (Owner(st) != r) continue;
        for (int j = 0; j < m_; ++j) {
          if (!GradDone(Idx(j, st))) {
            return Err(r, a,
                       absl::StrCat("runs before the weight gradient of micro-batch ", j,
                                    " on stage ", st));
          }
        }
      }
      opt_done_[r] = true;
      return absl::OkStatus();
    }
    if (s < 0 || s >= S_) return Err(r, a, absl::StrCat("stage out of range (", S_, " stages)"));
    if (Owner(s) != r) {
      return Err(r, a, absl::StrCat("stage ", s, " belongs to rank ", Owner(s)));
    }
    if (a.kind == ActionKind::kReduceGrads) {
      if (reduced_[s]) return Err(r, a, "runs twice");
      for (int j = 0; j < m_; ++j) {
        if (!GradDone(Idx(j, s))) {
          return Err(r, a, absl::StrCat("runs before the weight gradient of micro-batch ", j));
        }
      }
      reduced_[s] = true;
      return absl::OkStatus();
    }
    if (mb < 0 || mb >= m_) {
      return Err(r, a, absl::StrCat("micro-batch out of range (", m_, " micro-batches)"));
    }
    if (opt_done_[r] && IsCompute(a.kind)) return Err(r, a, "runs after OPTIMIZER_STEP");
    const int k = Idx(mb, s);
    switch (a.kind) {
      case ActionKind::kF: {
        if (f_[k] >= 0) return Err(r, a, "duplicate forward");
        if (s > 0) {
          bool local = Owner(s - 1) == r && f_[Idx(mb, s - 1)] >= 0;
          if (!local && !recv_f_[k]) {
            return Err(
                r, a,
                absl::StrCat(
                    "its input is not available: stage ", s - 1, " is on rank ", Owner(s - 1),
                    Owner(s - 1) == r ? " and has not run F yet" : " and no RECV_F came first",
                    " (is the schedule lowered?)"));
          }
        }
        f_[k] = r;
        return absl::OkStatus();
      }
      case ActionKind::kB:
      case ActionKind::kI: {
        if (f_[k] < 0) return Err(r, a, "backward before its forward");
        if (b_[k] || i_[k]) return Err(r, a, "duplicate backward");
        if (s + 1 < S_) {
          int kn = Idx(mb, s + 1);
          bool local = Owner(s + 1) == r && (b_[kn] || i_[kn]);
          if (!local && !recv_b_[k]) {
            return Err(r, a,
                       absl::StrCat("its output gradient is not available: stage ", s + 1,
                                    " is on rank ", Owner(s + 1),
                                    Owner(s + 1) == r ? " and has not run its backward"
                                                      : " and no RECV_B came first"));
          }
        }
        (a.kind == ActionKind::kB ? b_ : i_)[k] = true;
        return absl::OkStatus();
      }
      case ActionKind::kW: {
        if (b_[k]) return Err(r, a, "W after a full backward B");
        if (!i_[k])
          return Err(r, a, absl::StrCat("W before ", Action{ActionKind::kI, s, mb}.ToString()));
        if (w_[k]) return Err(r, a, "duplicate W");
        w_[k] = true;
        return absl::OkStatus();
      }
      case ActionKind::kSendF:
      case ActionKind::kSendB: {
        const bool fwd = a.kind == ActionKind::kSendF;
        const int peer = fwd ? s + 1 : s - 1;
        if (peer < 0 || peer >= S_) return Err(r, a, "there is no neighbour stage to send to");
        if (Owner(peer) == r) return Err(r, a, "the neighbour stage is on the same rank");
        if (fwd ? f_[k] < 0 : !(b_[k] || i_[k])) {
          return Err(r, a, fwd ? "sends before its forward ran" : "sends before its backward ran");
        }
        auto& sent = fwd ? sent_f_ : sent_b_;
        if (sent[k]) return Err(r, a, "duplicate send");
        sent[k] = true;
        channels_[{r, Owner(peer), fwd ? kDirF : kDirB}].push_back(a);
        return absl::OkStatus();
      }
      case ActionKind::kRecvF:
      case ActionKind::kRecvB: {
        const bool fwd = a.kind == ActionKind::kRecvF;
        const int peer = fwd ? s - 1 : s + 1;
        if (peer < 0 || peer >= S_) return Err(r, a, "there is no neighbour stage to receive from");
        const int src = Owner(peer);
        if (src == r) return Err(r, a, "the neighbour stage is on the same rank");
        auto& recv = fwd ? recv_f_ : recv_b_;
        if (recv[k]) return Err(r, a, "duplicate receive");
        auto it = channels_.find({src, r, fwd ? kDirF : kDirB});
        if (it == channels_.end() || it->second.empty()) {
          *blocked = true;
          return absl::OkStatus();
        }
        const Action expect{fwd ? ActionKind::kSendF : ActionKind::kSendB, peer, mb};
        if (!(it->second.front() == expect)) {
          return absl::FailedPreconditionError(
              absl::StrCat("rank ", r, " expects ", a.ToString(), " but the channel from rank ",
                           src, " holds ", it->second.front().ToString()));
        }
        it->second.pop_front();
        if (it->second.empty()) channels_.erase(it);
        recv[k] = true;
        return absl::OkStatus();
      }
      default:
        return Err(r, a, "unexpected action");
    }
  }

  const Schedule& sched_;
  const int S_;
  const int m_;
  std::vector<int> f_;  // rank that ran F, or -1
  std::vector<bool> b_, i_, w_, recv_f_, recv_b_, sent_f_, sent_b_, reduced_;
  std::vector<size_t> pc_;
  std::vector<bool> opt_done_;
  std::map<ChannelKey, std::deque<Action>> channels_;
};

}  // namespace

absl::Status Validate(const Schedule& schedule) {
  const int p = schedule.spec.ranks;
  if (p < 1 || schedule.spec.micro_batches < 1 || schedule.num_stages < 1) {
    return absl::InvalidArgumentError("Validate: the spec needs ranks, micro-batches, stages >= 1");
  }
  if (static_cast<int>(schedule.programs.size()) != p) {
    return absl::InvalidArgumentError(
        absl::StrCat("Validate: ", schedule.programs.size(), " programs for ", p, " ranks"));
  }
  if (static_cast<int>(schedule.stage_rank.size()) != schedule.num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("Validate: stage_rank has ",
                                                   schedule.stage_rank.size(), " entries for ",
                                                   schedule.num_stages, " stages"));
  }
  for (int s = 0; s < schedule.num_stages; ++s) {
    if (schedule.stage_rank[s] < 0 || schedule.stage_rank[s] >= p) {
      return absl::InvalidArgumentError(
          absl::StrCat("Validate: stage ", s, " placed on rank ", schedule.stage_rank[s]));
    }
  }
  for (int r = 0; r < p; ++r) {
    if (schedule.programs[r].rank != r) {
      return absl::InvalidArgumentError(
          absl::StrCat("Validate: program ", r, " is labelled rank ", schedule.programs[r].rank));
    }
  }
  Executor ex(schedule);
  return ex.Run();
}

}  // namespace pipewright
