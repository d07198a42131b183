// The MPI backend's Communicator (mpi_internal.h): MpiCommunicator posts operations (P2P messages
// through mpi_transport.cc, collectives through mpi_collectives.cc) under the process-wide mutex,
// and its Work waits by driving the progress engine (mpi_process.cc) until the operation is done,
// the world is aborted or the deadline passes. CreateMpiWorld makes a world over MPI_COMM_WORLD.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"
#include "runtime/comm/comm_core.h"
#include "runtime/comm/mpi.h"
#include "runtime/comm/mpi_internal.h"

namespace pipewright {
namespace mpi_internal {
namespace {

using comm_internal::CollectiveArgs;

// The reference semantics (CommCapabilities' defaults): tagged P2P, eager sends (Send copies),
// host tensors only, the local backend's rank-order sum.
constexpr CommCapabilities kMpiCapabilities{};

// True when group ranks are world ranks (the world's group, or a split that kept every rank in
// order); otherwise errors name peers by both, so a timeout names the process that went silent
// as mpirun numbers it.
bool RanksAreWorldRanks(const Group& g) {
  for (int r = 0; r < static_cast<int>(g.mpi_ranks.size()); ++r) {
    if (g.mpi_ranks[r] != r) return false;
  }
  return true;
}

std::string SendDescription(const Group& g, int peer, int64_t tag) {
  if (RanksAreWorldRanks(g) || peer < 0 || peer >= g.size) {
    return comm_internal::SendDescription(peer, tag);
  }
  return absl::StrCat("Send to rank ", peer, " (world rank ", g.mpi_ranks[peer], ", tag ", tag,
                      ")");
}

std::string RecvDescription(const Group& g, int peer, int64_t tag) {
  if (RanksAreWorldRanks(g) || peer < 0 || peer >= g.size) {
    return comm_internal::RecvDescription(peer, tag);
  }
  return absl::StrCat("Recv from rank ", peer, " (world rank ", g.mpi_ranks[peer], ", tag ", tag,
                      ")");
}

// "; waiting for ranks 0 (world rank 1), 2 (world rank 5)" (see RanksAreWorldRanks).
std::string WaitingFor(const Group& g, const std::vector<int>& missing) {
  if (RanksAreWorldRanks(g) || missing.empty()) return comm_internal::WaitingForRanks(missing);
  std::vector<std::string> names;
  for (int r : missing) names.push_back(absl::StrCat(r, " (world rank ", g.mpi_ranks[r], ")"));
  return absl::StrCat("; waiting for ranks ", absl::StrJoin(names, ", "));
}

absl::Status WaitOp(Group& g, Op& op, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;  // saturates for InfiniteDuration()
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  absl::Duration backoff = absl::Microseconds(20);
  while (true) {
    if (op.done) return op.status;
    if (g.world->aborted) return g.world->abort_status;
    if (g.closed) return g.closed_status;
    if (ProgressAllLocked()) p.cv.SignalAll();
    if (op.done) return op.status;
    if (g.world->aborted) return g.world->abort_status;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      std::vector<int> missing;
      if (std::shared_ptr<Coll> c = op.coll.lock(); c && c->phase != 3) {
        for (int r = 0; r < static_cast<int>(c->got.size()); ++r) {
          if (!c->got[r] && c->reqs[r] == MPI_REQUEST_NULL) missing.push_back(r);
        }
      }
      return comm_internal::TimedOut(absl::StrCat(op.label, ": ", op.description), timeout,
                                     WaitingFor(g, missing));
    }
    // Like MPI_Wait, spin (yielding the core) while data is moving, and for the first 50 us,
    // when an answer is likely to come soon; sleep with a growing backoff otherwise.
    if (now - start < absl::Microseconds(50) || ActivityLocked() == Activity::kTransfer) {
      p.mu.Unlock();
      std::this_thread::yield();
      p.mu.Lock();
      backoff = absl::Microseconds(20);
      continue;
    }
    p.cv.WaitWithTimeout(&p.mu, std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(1));
  }
}

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<Group> group, std::shared_ptr<Op> op)
      : group_(std::move(group)), op_(std::move(op)) {}

  absl::Status Wait(absl::Duration timeout) override { return WaitOp(*group_, *op_, timeout); }

  bool Done() override {
    ProcessState& p = Proc();
    absl::MutexLock lock(&p.mu);
    if (!op_->done && !group_->world->aborted && !group_->closed && ProgressAllLocked()) {
      p.cv.SignalAll();
    }
    return op_->done || group_->world->aborted || group_->closed;
  }

 private:
  std::shared_ptr<Group> group_;
  std::shared_ptr<Op> op_;
};

void ConfigureTags(Group& g, int tag_ub, const MpiWorldOptions& options) {
  const int64_t direct_max = static_cast<int64_t>(tag_ub) - 1;
  g.max_direct_tag =
      options.max_direct_tag < 0 ? direct_max : std::min(options.max_direct_tag, direct_max);
  g.overflow_tag = static_cast<int>(g.max_direct_tag + 1);
  g.coll_tag_period = (static_cast<int64_t>(tag_ub) + 1) / 2;
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<Group> group) : g_(std::move(group)) {}

  ~MpiCommunicator() override {
    std::thread join;
    {
      absl::MutexLock lock(&Proc().mu);
      CloseGroupLocked(g_, absl::StatusCode::kCancelled, "the communicator was destroyed", &join);
    }
    if (join.joinable()) join.join();
  }

  int rank() const override { return g_->rank; }
  int size() const override { return g_->size; }
  CommBackend kind() const override { return CommBackend::kMpi; }
  CommCapabilities capabilities() const override { return kMpiCapabilities; }

  std::unique_ptr<Work> Send(const Tensor& t, int peer, int64_t tag) override {
    std::shared_ptr<Op> op = NewOp(SendDescription(*g_, peer, tag));
    absl::Status valid = CheckP2P(t, peer, tag, *op);
    std::shared_ptr<Buffer> packet;
    if (valid.ok()) {  // copy outside the lock
      PacketHeader h;
      h.kind = static_cast<int32_t>(PacketKind::kP2P);
      h.tag = tag;
      h.dtype = static_cast<int32_t>(t.dtype());
      h.numel = t.numel();
      SetShape(h, t);
      absl::StatusOr<std::shared_ptr<Buffer>> b = MakePacket(h, t.raw(), t.nbytes(), "");
      if (b.ok()) {
        packet = *std::move(b);
      } else {
        valid = comm_internal::Annotate(b.status(), absl::StrCat(op->label, ": ", op->description));
      }
    }
    absl::MutexLock lock(&Proc().mu);
    if (absl::Status refused = RefusedLocked(valid); !refused.ok()) {
      Complete(*op, refused);
    } else {
      absl::Status s = SendP2P(*g_, peer, tag, std::move(packet));
      if (!s.ok()) AbortLocked(*g_->world, s, /*notify=*/true);
      Complete(*op, s);
      Proc().cv.SignalAll();
    }
    return std::make_unique<MpiWork>(g_, std::move(op));
  }

  std::unique_ptr<Work> Recv(Tensor& t, int peer, int64_t tag) override {
    std::shared_ptr<Op> op = NewOp(RecvDescription(*g_, peer, tag));
    absl::Status valid = CheckP2P(t, peer, tag, *op);
    absl::MutexLock lock(&Proc().mu);
    if (absl::Status s = RefusedLocked(valid); !s.ok()) {
      Complete(*op, s);
    } else {
      auto r = std::make_shared<RecvOp>();
      r->op = op;
      r->tensor = t;
      r->peer = peer;
      r->tag = tag;
      const P2PKey key{peer, tag};
      if (tag <= g_->max_direct_tag) {
        g_->direct_pending[key].push_back(std::move(r));
      } else if (auto it = g_->overflow_unexpected.find(key); it != g_->overflow_unexpected.end()) {
        std::shared_ptr<Buffer> b = std::move(it->second.front());
        it->second.pop_front();
        if (it->second.empty()) g_->overflow_unexpected.erase(it);
        DeliverStaged(*r, *b);
      } else {
        g_->overflow_pending[key].push_back(std::move(r));
      }
      ProgressAllLocked();
      Proc().cv.SignalAll();
    }
    return std::make_unique<MpiWork>(g_, std::move(op));
  }

  std::unique_ptr<Work> AllReduce(Tensor& t) override {
    CollectiveArgs args;
    args.tensor = t;
    return Join(CollectiveKind::kAllReduce, std::move(args), 0, 0, nullptr);
  }

  std::unique_ptr<Work> AllGather(const Tensor& in, Tensor& out) override {
    return JoinInOut(CollectiveKind::kAllGather, in, out);
  }

  std::unique_ptr<Work> ReduceScatter(const Tensor& in, Tensor& out) override {
    return JoinInOut(CollectiveKind::kReduceScatter, in, out);
  }

  std::unique_ptr<Work> Broadcast(Tensor& t, int root) override {
    CollectiveArgs args;
    args.tensor = t;
    args.root = root;
    return Join(CollectiveKind::kBroadcast, std::move(args), 0, 0, nullptr);
  }

  std::unique_ptr<Work> Barrier() override {
    return Join(CollectiveKind::kBarrier, CollectiveArgs{}, 0, 0, nullptr);
  }

  void Abort(const absl::Status& status) override {
    absl::MutexLock lock(&Proc().mu);
    if (g_->closed) return;
    AbortLocked(*g_->world, status.ok() ? absl::AbortedError("aborted") : status, /*notify=*/true);
  }

  absl::Status abort_status() const override {
    absl::MutexLock lock(&Proc().mu);
    World& w = *g_->world;
    if (!w.aborted && !w.closed) {
      bool progressed = false;
      absl::Status s = ProbeAbortNotices(w, &progressed);
      if (!s.ok()) AbortLocked(w, s, /*notify=*/true);
    }
    return w.aborted ? w.abort_status : absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    {
      absl::MutexLock lock(&Proc().mu);
      if (absl::Status s = UsableLocked(); !s.ok()) return s;
      if (g_->split_broken) {
        return absl::FailedPreconditionError(
            absl::StrCat(g_->label,
                         ": Split: an earlier Split of this communicator failed midway, so the "
                         "ranks' communicator duplications are out of step; it cannot be split "
                         "again"));
      }
    }
    std::shared_ptr<Coll> coll;
    std::unique_ptr<Work> work = Join(CollectiveKind::kSplit, CollectiveArgs{}, color, key, &coll);
    absl::Status s = work->Wait(timeout);
    absl::MutexLock lock(&Proc().mu);
    if (!s.ok()) {
      if (s.code() == absl::StatusCode::kDeadlineExceeded) g_->split_broken = true;
      return s;
    }
    // Every rank is in this Split: duplicate the parent's communicators (non-blocking, so the
    // deadline still holds if a rank gave up meanwhile).
    MPI_Comm dup[2] = {MPI_COMM_NULL, MPI_COMM_NULL};
    MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    s = PW_MPI_STATUS(MPI_Comm_idup(g_->p2p, &dup[0], &reqs[0]));
    if (s.ok()) s = PW_MPI_STATUS(MPI_Comm_idup(g_->coll, &dup[1], &reqs[1]));
    absl::Duration backoff = absl::Microseconds(10);
    while (s.ok()) {
      int flag = 0;
      s = PW_MPI_STATUS(MPI_Testall(2, reqs, &flag, MPI_STATUSES_IGNORE));
      if (!s.ok() || flag) break;
      if (ProgressAllLocked()) Proc().cv.SignalAll();
      if (g_->world->aborted) {
        s = g_->world->abort_status;
        break;
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        s = absl::DeadlineExceededError(
            absl::StrCat(g_->label, ": Split (collective #", coll->seq, ") timed out after ",
                         comm_internal::FormatSeconds(timeout),
                         " in MPI_Comm_idup (a rank left the Split early)"));
        break;
      }
      Proc().cv.WaitWithTimeout(&Proc().mu, std::min(backoff, deadline - now));
      backoff = std::min(backoff * 2, absl::Milliseconds(1));
    }
    if (!s.ok()) {
      g_->split_broken = true;
      for (MPI_Request r : reqs) {
        if (r != MPI_REQUEST_NULL) g_->pending_idups.push_back(r);
      }
      if (s.code() != absl::StatusCode::kDeadlineExceeded && !g_->world->aborted) {
        AbortLocked(*g_->world, s, /*notify=*/true);
      }
      return s;
    }
    if (color < 0) {
      MPI_Comm_free(&dup[0]);
      MPI_Comm_free(&dup[1]);
      return std::unique_ptr<Communicator>();
    }
    std::vector<std::pair<int, int>> members;  // (key, parent rank)
    for (int r = 0; r < g_->size; ++r) {
      if (coll->colors[r] == color) members.push_back({coll->keys[r], r});
    }
    std::sort(members.begin(), members.end());
    World& w = *g_->world;
    auto ng = std::make_shared<Group>();
    ng->world = g_->world;
    ng->id = w.next_group_id++;
    ng->size = static_cast<int>(members.size());
    for (int i = 0; i < ng->size; ++i) {
      if (members[i].second == g_->rank) ng->rank = i;
      ng->mpi_ranks.push_back(g_->mpi_ranks[members[i].second]);
    }
    ng->p2p = dup[0];
    ng->coll = dup[1];
    ng->max_direct_tag = g_->max_direct_tag;
    ng->overflow_tag = g_->overflow_tag;
    ng->coll_tag_period = g_->coll_tag_period;
    ng->label = absl::StrCat("rank ", ng->rank, " (world rank ", w.rank, ", group ", ng->id, ")");
    s = SetErrorsReturn(ng->p2p);
    if (s.ok()) s = SetErrorsReturn(ng->coll);
    if (!s.ok()) {
      MPI_Comm_free(&ng->p2p);
      MPI_Comm_free(&ng->coll);
      AbortLocked(w, s, /*notify=*/true);
      return s;
    }
    w.groups.push_back(ng);
    return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(std::move(ng)));
  }

 private:
  std::shared_ptr<Op> NewOp(std::string description) const {
    auto op = std::make_shared<Op>();
    op->label = g_->label;
    op->description = std::move(description);
    return op;
  }

  absl::Status UsableLocked() const {
    if (g_->closed) return g_->closed_status;
    if (g_->world->aborted) return g_->world->abort_status;
    return absl::OkStatus();
  }

  // Why an operation whose own arguments checked `valid` is not posted (the communicator is
  // closed, the world aborted, or the arguments are invalid), or OK.
  absl::Status RefusedLocked(const absl::Status& valid) const {
    PW_RETURN_IF_ERROR(UsableLocked());
    return valid;
  }

  absl::Status CheckP2P(const Tensor& t, int peer, int64_t tag, const Op& op) const {
    return comm_internal::CheckP2P(t, peer, tag, g_->size,
                                   absl::StrCat(op.label, ": ", op.description), kind(),
                                   kMpiCapabilities);
  }

  // A collective of an input and an output tensor (AllGather, ReduceScatter).
  std::unique_ptr<Work> JoinInOut(CollectiveKind kind, const Tensor& in, Tensor& out) {
    CollectiveArgs args;
    args.tensor = in;
    args.out = out;
    return Join(kind, std::move(args), 0, 0, nullptr);
  }

  // Starts collective #seq: builds and sends the phase-1 packets and registers the state.
  std::unique_ptr<Work> Join(CollectiveKind kind, CollectiveArgs args, int color, int key,
                             std::shared_ptr<Coll>* coll_out) {
    const int64_t seq = next_seq_++;
    std::shared_ptr<Op> op = NewOp(comm_internal::CollectiveDescription(kind, seq));
    auto c = std::make_shared<Coll>();
    c->seq = seq;
    c->kind = kind;
    c->op = op;
    c->root = args.root;
    if (coll_out) *coll_out = c;
    const absl::Status valid = comm_internal::CheckCollective(
        kind, args, g_->size, absl::StrCat(op->label, ": ", op->description), this->kind(),
        kMpiCapabilities);
    const Tensor& t = args.tensor;
    if (valid.ok()) {
      c->tensor = t;
      c->out = args.out;
    }

    PacketHeader& h = c->mine;
    h.kind = static_cast<int32_t>(PacketKind::kCollective);
    h.tag = seq;
    h.coll_kind = static_cast<int32_t>(kind);
    h.root = args.root;
    h.color = color;
    h.key = key;
    h.sender = g_->rank;
    h.code = static_cast<int32_t>(valid.code());
    if (t.defined()) {
      h.dtype = static_cast<int32_t>(t.dtype());
      h.numel = t.numel();
    }
    SetShape(h, t);
    c->my_error = std::string(valid.message());

    // Phase-1 packets, built outside the lock.
    absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> packets =
        Phase1Packets(*g_, *c, t, valid.ok());

    absl::MutexLock lock(&Proc().mu);
    if (absl::Status s = UsableLocked(); !s.ok()) {
      Complete(*op, s);
      return std::make_unique<MpiWork>(g_, std::move(op));
    }
    absl::Status s = packets.status();
    for (int p = 0; p < g_->size && s.ok(); ++p) {
      if (p == g_->rank) continue;
      s = PostSend(*g_, g_->coll, g_->mpi_ranks[p], CollTag(*g_, seq, 1), (*packets)[p],
                   &g_->sends);
    }
    if (!s.ok()) {
      AbortLocked(*g_->world, s, /*notify=*/true);
      Complete(*op, s);
      return std::make_unique<MpiWork>(g_, std::move(op));
    }
    if (!valid.ok()) Complete(*op, valid);  // fails at once; its peers learn it from the packet
    StartPhase(*g_, *c, 1);
    op->coll = c;
    g_->colls.push_back(std::move(c));
    ProgressAllLocked();
    Proc().cv.SignalAll();  // the progress thread polls faster while work is outstanding
    return std::make_unique<MpiWork>(g_, std::move(op));
  }

  std::shared_ptr<Group> g_;
  std::atomic<int64_t> next_seq_{0};
};

}  // namespace
}  // namespace mpi_internal

using mpi_internal::ConfigureTags;
using mpi_internal::Group;
using mpi_internal::MpiCommunicator;
using mpi_internal::Proc;
using mpi_internal::ProcessState;
using mpi_internal::SetErrorsReturn;
using mpi_internal::StartProgressThreadLocked;
using mpi_internal::World;

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(const MpiWorldOptions& options) {
  PW_ASSIGN_OR_RETURN(MpiProcess proc, InitMpi());
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  if (p.finalized) return absl::FailedPreconditionError("CreateMpiWorld: MPI was finalized");
  int* tag_ub_attr = nullptr;
  int flag = 0;
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub_attr, &flag));
  const int tag_ub = flag && tag_ub_attr != nullptr ? *tag_ub_attr : 32767;  // the MPI minimum

  auto w = std::make_shared<World>();
  w->rank = proc.rank;
  w->size = proc.size;
  w->options = options;
  w->options.max_block_bytes = std::clamp<int64_t>(options.max_block_bytes, 1, INT_MAX);
  if (w->options.drain_timeout < absl::ZeroDuration())
    w->options.drain_timeout = absl::ZeroDuration();
  auto g = std::make_shared<Group>();
  g->world = w;
  g->id = 0;
  g->rank = proc.rank;
  g->size = proc.size;
  for (int r = 0; r < proc.size; ++r) g->mpi_ranks.push_back(r);
  g->label = absl::StrCat("rank ", proc.rank);
  ConfigureTags(*g, tag_ub, options);
  // Collective and blocking: every process creates its world together.
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &w->control));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &g->p2p));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &g->coll));
  for (MPI_Comm c : {w->control, g->p2p, g->coll}) PW_RETURN_IF_ERROR(SetErrorsReturn(c));
  w->groups.push_back(g);
  p.worlds.push_back(w);
  StartProgressThreadLocked();
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(std::move(g)));
}

}  // namespace pipewright
