// Message numbering shared by the runtime and the FIFO-order check (schedule.h).
//
// Note [Tags and FIFO transports]. The runtime tags every P2P message with MessageTag, so a
// tagged transport (local, MPI) matches each receive with its send whatever the arrival
// order. A transport without tags (NCCL) matches receives to sends in posting order between
// two ranks. Both agree exactly when, for every ordered pair of ranks, the sender's tags come
// in the same order as the receiver's; CheckFifoOrder proves that for one schedule.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/schedule.h"

namespace pipewright {

int64_t MessageTag(int num_stages, int micro_batch, int arriving_stage, bool forward) {
  return (static_cast<int64_t>(micro_batch) * num_stages + arriving_stage) * 2 + (forward ? 0 : 1);
}

absl::Status CheckFifoOrder(const Schedule& sched) {
  const int S = sched.num_stages, P = static_cast<int>(sched.programs.size());
  // sent[from][to] / expected[to][from]: tags in program order.
  std::vector<std::vector<std::vector<int64_t>>> sent(P, std::vector<std::vector<int64_t>>(P)),
      expected(P, std::vector<std::vector<int64_t>>(P));
  for (int r = 0; r < P; ++r) {
    for (const Action& a : sched.programs[r].actions) {
      const bool send = a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB;
      const bool recv = a.kind == ActionKind::kRecvF || a.kind == ActionKind::kRecvB;
      if (!send && !recv) continue;
      const bool fwd = a.kind == ActionKind::kSendF || a.kind == ActionKind::kRecvF;
      const int other = send ? (fwd ? a.virtual_stage + 1 : a.virtual_stage - 1)
                             : (fwd ? a.virtual_stage - 1 : a.virtual_stage + 1);
      if (other < 0 || other >= S) continue;  // Validate reports it
      const int peer = sched.stage_rank[other];
      const int arriving_at = send ? other : a.virtual_stage;
      const int64_t tag = MessageTag(S, a.micro_batch, arriving_at, fwd);
      (send ? sent[r][peer] : expected[r][peer]).push_back(tag);
    }
  }
  for (int from = 0; from < P; ++from) {
    for (int to = 0; to < P; ++to) {
      const std::vector<int64_t>& a = sent[from][to];
      const std::vector<int64_t>& b = expected[to][from];
      for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        if (a[i] != b[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "a transport without message tags (NCCL) matches messages in posting order, but "
              "this schedule's message ",
              i, " from pipeline rank ", from, " to ", to,
              " is posted in a different order by the receiver; run it on the local backend "
              "(WorldOptions.comm = local)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pipewright
