// Communication lowering: turns compute-only programs into programs with explicit
// SEND/RECV, REDUCE_GRADS and OPTIMIZER_STEP actions.
//
// Note [Lowering]. For every compute action on rank r:
//   F(mb, s):   RECV_F(mb, s) before it when stage s - 1 lives on another rank (stage 0 has
//               no input to receive); SEND_F(mb, s) after it when stage s + 1 lives on another
//               rank (the last stage sends nothing forward).
//   B/I(mb, s): RECV_B(mb, s) before it when stage s + 1 lives on another rank (the last stage
//               starts the backward from the loss); SEND_B(mb, s) after it when stage s - 1
//               lives on another rank. With a split backward the input gradient comes out of
//               I, so I carries the messages and W has none.
// Neighbours on the same rank (interleaved with p = 1, the tip of the zb-v "V") hand over
// locally. After the last weight-gradient action (B or W) of each stage on the rank (and its
// SEND_B) comes REDUCE_GRADS@s; OPTIMIZER_STEP closes the program.
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "pipewright/schedule.h"
#include "pipewright/status.h"

namespace pipewright {

absl::Status LowerComm(Schedule& schedule) {
  if (schedule.lowered) {
    return absl::FailedPreconditionError("LowerComm: the schedule is already lowered");
  }
  const int S = schedule.num_stages;
  if (static_cast<int>(schedule.stage_rank.size()) != S) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LowerComm: stage_rank has ", schedule.stage_rank.size(), " entries for ", S, " stages"));
  }
  for (const Program& prog : schedule.programs) {
    for (const Action& a : prog.actions) {
      if (!IsCompute(a.kind)) {
        return absl::FailedPreconditionError(
            absl::StrCat("LowerComm: rank ", prog.rank, " already holds ", a.ToString(),
                         "; only compute-only programs can be lowered"));
      }
      if (a.virtual_stage < 0 || a.virtual_stage >= S) {
        return absl::InvalidArgumentError(
            absl::StrCat("LowerComm: rank ", prog.rank, " ", a.ToString(), ": stage out of range"));
      }
    }
  }
  for (Program& prog : schedule.programs) {
    const int r = prog.rank;
    // Index (in the compute program) of the last weight-gradient action of each stage.
    std::map<int, size_t> last_grad;
    for (size_t i = 0; i < prog.actions.size(); ++i) {
      const Action& a = prog.actions[i];
      if (a.kind == ActionKind::kB || a.kind == ActionKind::kW) last_grad[a.virtual_stage] = i;
    }
    std::vector<Action> out;
    out.reserve(prog.actions.size() * 3 + last_grad.size() + 1);
    auto remote = [&](int stage) {
      return stage >= 0 && stage < S && schedule.stage_rank[stage] != r;
    };
    for (size_t i = 0; i < prog.actions.size(); ++i) {
      const Action& a = prog.actions[i];
      const int s = a.virtual_stage;
      const int mb = a.micro_batch;
      switch (a.kind) {
        case ActionKind::kF:
          if (remote(s - 1)) out.push_back({ActionKind::kRecvF, s, mb});
          out.push_back(a);
          if (remote(s + 1)) out.push_back({ActionKind::kSendF, s, mb});
          break;
        case ActionKind::kB:
        case ActionKind::kI:
          if (remote(s + 1)) out.push_back({ActionKind::kRecvB, s, mb});
          out.push_back(a);
          if (remote(s - 1)) out.push_back({ActionKind::kSendB, s, mb});
          break;
        default:
          out.push_back(a);
          break;
      }
      auto it = last_grad.find(s);
      if (it != last_grad.end() && it->second == i) {
        out.push_back({ActionKind::kReduceGrads, s, 0});
      }
    }
    out.push_back({ActionKind::kOptimizerStep, 0, 0});
    prog.actions = std::move(out);
  }
  schedule.lowered = true;
  return absl::OkStatus();
}

}  // namespace pipewright
