// RankExecutor: point-to-point activations and gradients (rank_executor.h). Every message is
// tagged with MessageTag (schedule.h); a backend that needs it gets each run of consecutive
// sends and receives as one group.
#include "absl/strings/str_cat.h"
#include "runtime/engine/rank_executor.h"

namespace pipewright::internal {

// The rank's stage of a send or receive and the virtual stage at the other end (the sender
// of a receive, the receiver of a send); InvalidArgument naming the action when either is
// missing.
absl::StatusOr<std::pair<StageRt*, int>> RankExecutor::P2PEnds(const Action& a) {
  const int mb = a.micro_batch;
  StageRt* st = Local(a.virtual_stage);
  if (st == nullptr || mb < 0 || mb >= ctx_->run->micro_batches()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(), " ", a.ToString(), ": stage or micro-batch not on this rank"));
  }
  const bool send = a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB;
  const bool fwd = a.kind == ActionKind::kSendF || a.kind == ActionKind::kRecvF;
  const int other = a.virtual_stage + ((send == fwd) ? 1 : -1);
  if (other < 0 || other >= ctx_->run->num_stages()) {
    return absl::InvalidArgumentError(absl::StrCat(Who(), " ", a.ToString(), ": no stage ", other,
                                                   send ? " to send to" : " to receive from"));
  }
  return std::make_pair(st, other);
}

absl::Status RankExecutor::IssueSend(const Action& a) {
  PW_ASSIGN_OR_RETURN(auto ends, P2PEnds(a));
  auto [st, to_stage] = ends;
  const int mb = a.micro_batch;
  const bool fwd = a.kind == ActionKind::kSendF;
  Tensor& t = fwd ? st->output[mb] : st->grad_in[mb];
  if (!t.defined()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Who(), " ", a.ToString(), ": nothing to send (the ", fwd ? "F" : "backward",
                     " of this micro-batch has not run)"));
  }
  const int peer = PeerOf(to_stage);
  const int64_t tag = MessageTag(ctx_->run->num_stages(), mb, to_stage, fwd);
  Clock::time_point c = Clock::now();
  flight_.Peer(peer, tag, static_cast<int64_t>(t.nbytes()));
  sends_.push_back(groups_.world()->Send(t, peer, tag));
  Record(EventKind::kSend, a, c, peer, tag);
  t = Tensor();
  return absl::OkStatus();
}

absl::Status RankExecutor::PostRecv(const Action& a, PendingRecv* r) {
  PW_ASSIGN_OR_RETURN(auto ends, P2PEnds(a));
  auto [st, from_stage] = ends;
  const bool fwd = a.kind == ActionKind::kRecvF;
  r->action = a;
  r->stage = st;
  r->peer = PeerOf(from_stage);
  r->tag = MessageTag(ctx_->run->num_stages(), a.micro_batch, a.virtual_stage, fwd);
  r->buf = fwd ? Tensor::Empty(st->in_shape, st->in_dtype, alloc_.get())
               : Tensor::Empty(st->out_shape, DType::kF32, alloc_.get());
  flight_.Peer(r->peer, r->tag, static_cast<int64_t>(r->buf.nbytes()));
  r->work = groups_.world()->Recv(r->buf, r->peer, r->tag);
  return absl::OkStatus();
}

absl::Status RankExecutor::FinishRecv(PendingRecv& r) {
  // The flight recorder's current entry is the action that needs the buffer: a hang there
  // names the peer it waits for.
  flight_.Peer(r.peer, r.tag, static_cast<int64_t>(r.buf.nbytes()));
  const Clock::time_point t = Clock::now();
  absl::Status s = WaitOrAbort(*r.work, absl::StrCat(r.action.ToString(), " from rank ", r.peer));
  Record(EventKind::kRecvWait, r.action, t, r.peer, r.tag);
  PW_RETURN_IF_ERROR(s);
  const bool fwd = r.action.kind == ActionKind::kRecvF;
  (fwd ? r.stage->input[r.action.micro_batch] : r.stage->grad_out[r.action.micro_batch]) =
      std::move(r.buf);
  return absl::OkStatus();
}

// Every operation of the group is posted before any is waited for, so two neighbours that send
// to each other cannot deadlock in their send kernels (NCCL).
absl::Status RankExecutor::RunP2PGroup(size_t begin, size_t end) {
  const Program& prog = program();
  std::vector<PendingRecv> recvs;
  groups_.world()->GroupStart();
  absl::Status posted;
  for (size_t i = begin; i < end && posted.ok(); ++i) {
    const Action& a = prog.actions[i];
    if (a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB) {
      posted = IssueSend(a);
    } else {
      recvs.emplace_back();
      posted = PostRecv(a, &recvs.back());
      if (!posted.ok()) recvs.pop_back();
    }
  }
  absl::Status grouped = groups_.world()->GroupEnd();
  PW_RETURN_IF_ERROR(posted);
  if (!grouped.ok()) {
    return absl::Status(grouped.code(),
                        absl::StrCat(Who(), " grouped send/receive: ", grouped.message()));
  }
  for (PendingRecv& r : recvs) recvs_.push_back(std::move(r));
  return absl::OkStatus();
}

// Note [Receives posted ahead]. A RECV action only posts its receive; the wait happens at the
// first action that reads the buffer (the F of the same stage and micro-batch for RECV_F, its B
// or I for RECV_B), as torch.distributed.pipelining does. The transfer then overlaps whatever
// the program runs in between, and a backend that progresses messages only inside its calls
// (MPI) sees the receive early. The recorded receive wait is the time the consumer waited, and
// a hang in it is reported by the consuming action's flight-recorder entry, naming the peer.
absl::Status RankExecutor::AwaitRecv(StageRt& st, int mb, bool forward) {
  const ActionKind kind = forward ? ActionKind::kRecvF : ActionKind::kRecvB;
  for (size_t i = 0; i < recvs_.size(); ++i) {
    PendingRecv& r = recvs_[i];
    if (r.stage != &st || r.action.micro_batch != mb || r.action.kind != kind) continue;
    PendingRecv mine = std::move(r);
    recvs_.erase(recvs_.begin() + static_cast<std::ptrdiff_t>(i));
    return FinishRecv(mine);
  }
  return absl::OkStatus();
}

absl::Status RankExecutor::AwaitAllRecvs() {
  while (!recvs_.empty()) {
    PendingRecv r = std::move(recvs_.front());
    recvs_.erase(recvs_.begin());
    PW_RETURN_IF_ERROR(FinishRecv(r));
  }
  return absl::OkStatus();
}

absl::Status RankExecutor::WaitSends() {
  for (std::unique_ptr<Work>& w : sends_) PW_RETURN_IF_ERROR(WaitOrAbort(*w, "send"));
  sends_.clear();
  return absl::OkStatus();
}

}  // namespace pipewright::internal
