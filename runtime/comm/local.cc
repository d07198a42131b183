// The local backend: the ranks of a world are threads of this process that share one WorldState.
//
// One mutex per world guards everything (mailboxes, collective rendezvous, abort state) of the
// world and of every communicator split from it, and one condition variable is signalled on
// every completion and on abort; Work::Wait re-checks its op under the mutex. Simple and
// adequate for a handful of in-process ranks.
//
// Device tensors: the same protocol with CUDA tensors (several pipeline stages on one GPU). A
// message is a device copy made on the sender's allocator stream; delivering it copies device to
// device on the receiver's stream, ordered by events (Tensor::CopyFrom), so a completed receive
// is ready for the receiver's later work on that stream. AllReduce, ReduceScatter and Broadcast
// stage through host memory: each participant's tensor is copied to the host (waiting for its
// stream), summed there in the same group-rank order as host tensors, and copied back (waited
// for), so the result is bit-identical to the host backend's for the same inputs. AllGather
// concatenates the host copies and copies the result into every output. Host tensors take exactly
// the code path they always did.
//
// P2P: Send copies the payload (eagerly) into the receiver's mailbox, or straight into the
// tensor of a receive that is already pending for the same (source, tag). A receive takes the
// oldest queued message of its (source, tag) or registers itself as pending. A message of the
// wrong size or dtype is consumed by the receive it matched, which fails.
//
// Collectives: the k-th collective call on a rank's communicator joins slot k of its group.
// The last rank to arrive computes the result outside the mutex (every participant's tensor is
// held by a Tensor copy) and completes every participant's op. AllReduce and ReduceScatter are
// the rank-order sum of comm_core.h (Note [rank-order sum]), which the MPI backend shares bit for
// bit. A rank whose arguments are invalid or disagree with an earlier arrival's poisons the slot:
// every participant, past and future, fails with that error, and the slot still counts as
// collective k so later collectives stay matched.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"
#include "runtime/comm/comm_core.h"

namespace pipewright {
namespace {

using comm_internal::CollectiveArgs;
using comm_internal::CollectiveKind;

// The reference semantics (CommCapabilities' defaults), on device tensors too. Stream-ordered:
// P2P device copies are ordered by events on the tensors' allocator streams, collectives copy to
// the host on those streams and wait, so the work queued before an operation is posted is
// complete before its data is read.
constexpr CommCapabilities kLocalCapabilities{.device_memory = true, .stream_ordered = true};

struct WorldState {
  absl::Mutex mu;
  absl::CondVar cv;  // signalled on every completion and on abort
  bool aborted ABSL_GUARDED_BY(mu) = false;
  absl::Status abort_status ABSL_GUARDED_BY(mu);
  int next_group_id ABSL_GUARDED_BY(mu) = 1;  // 0 is the world itself
};

struct Collective;

// State of one operation, shared by its Work and by whatever completes it. Guarded by the
// world's mutex.
struct OpState {
  std::string label;        // "rank 1" (or "rank 1 (world rank 3, group 2)")
  std::string description;  // "Recv from rank 0 (tag 17)"
  bool done = false;
  absl::Status status;
  std::weak_ptr<Collective> collective;  // while the op waits in a collective rendezvous
  std::unique_ptr<Communicator> split_result;
};

// One rank's contribution to a collective.
struct Arrival {
  std::shared_ptr<OpState> op;
  CollectiveArgs args;  // AllReduce, Broadcast, AllGather, ReduceScatter
  int color = 0;        // Split
  int key = 0;          // Split
};

// Rendezvous slot of the seq-th collective of a group.
struct Collective {
  int64_t seq = 0;
  CollectiveKind kind = CollectiveKind::kBarrier;  // of the first arrival
  int first_rank = -1;
  int arrived = 0;
  std::vector<bool> present;
  std::vector<Arrival> arrivals;  // indexed by group rank
  absl::Status status;            // non-OK once poisoned
};

struct PendingRecv {
  std::shared_ptr<OpState> op;
  Tensor tensor;  // the receiver's tensor; shares its storage
};

// (destination, source, tag)
using MailKey = std::tuple<int, int, int64_t>;

// The state of one communicator group (the world, or one color of a Split).
struct GroupState {
  std::shared_ptr<WorldState> world;
  int id = 0;
  int size = 0;
  std::vector<int> world_ranks;  // group rank -> world rank
  // Invariant: for a key, messages or pending receives are queued, never both.
  std::map<MailKey, std::deque<Tensor>> messages;
  std::map<MailKey, std::deque<PendingRecv>> pending;
  std::map<int64_t, std::shared_ptr<Collective>> collectives;
};

// Takes the oldest entry queued under `key`; nullopt when there is none.
template <typename V>
std::optional<V> PopFront(std::map<MailKey, std::deque<V>>& queues, const MailKey& key) {
  auto it = queues.find(key);
  if (it == queues.end()) return std::nullopt;
  V front = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) queues.erase(it);
  return front;
}

bool SameLayout(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.numel() == b.numel();
}

bool OnHost(const Tensor& t) { return t.device().is_cpu(); }

// dst = src (same nbytes). Host to host is the memcpy it always was; anything touching a GPU
// goes through Tensor::CopyFrom (stream-ordered device copies, waited-for host copies).
absl::Status CopyInto(Tensor& dst, const Tensor& src) {
  PW_CHECK(dst.nbytes() == src.nbytes());
  if (OnHost(dst) && OnHost(src)) {
    if (dst.nbytes() > 0 && dst.raw() != src.raw()) {
      std::memcpy(dst.raw(), src.raw(), dst.nbytes());
    }
    return absl::OkStatus();
  }
  return dst.CopyFrom(src);
}

// A copy of a message for the mailbox: a host clone, or a device copy with the sender's
// allocator (queued on its stream).
absl::StatusOr<Tensor> CloneMessage(const Tensor& t) {
  if (OnHost(t)) return t.Clone();
  return t.CopyTo(t.allocator());
}

// The host contents of `t`: `t` itself on the host, else a host copy (waits for its stream).
absl::StatusOr<Tensor> HostView(const Tensor& t) {
  if (OnHost(t)) return t;
  return t.CopyTo(DefaultCpuAllocator());
}

class LocalWork final : public Work {
 public:
  LocalWork(std::shared_ptr<WorldState> world, std::shared_ptr<OpState> op)
      : world_(std::move(world)), op_(std::move(op)) {}

  absl::Status Wait(absl::Duration timeout) override { return WaitOp(*world_, *op_, timeout); }

  bool Done() override {
    absl::MutexLock lock(&world_->mu);
    return op_->done || world_->aborted;
  }

  // Note [Spin before blocking]. A message usually arrives within microseconds of the wait
  // (the sender is a rank thread of this process), and waking a thread blocked on the world's
  // condition variable costs tens of microseconds on a busy machine — on a pipeline's critical
  // path, at every hop. So a wait first polls for up to kSpinWait, yielding between polls, and
  // only then blocks.
  static constexpr absl::Duration kSpinWait = absl::Microseconds(50);

  static absl::Status WaitOp(WorldState& world, OpState& op, absl::Duration timeout) {
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + timeout;  // saturates for InfiniteDuration()
    const absl::Time spin_until = start + std::min(kSpinWait, timeout);
    while (absl::Now() < spin_until) {
      {
        absl::MutexLock lock(&world.mu);
        if (op.done) return op.status;
        if (world.aborted) return world.abort_status;
      }
      std::this_thread::yield();
    }
    absl::MutexLock lock(&world.mu);
    while (true) {
      if (op.done) return op.status;
      if (world.aborted) return world.abort_status;
      if (absl::Now() >= deadline) {
        std::vector<int> missing;
        if (std::shared_ptr<Collective> c = op.collective.lock()) {
          for (int r = 0; r < static_cast<int>(c->present.size()); ++r) {
            if (!c->present[r]) missing.push_back(r);
          }
        }
        return comm_internal::TimedOut(absl::StrCat(op.label, ": ", op.description), timeout,
                                       comm_internal::WaitingForRanks(missing));
      }
      world.cv.WaitWithDeadline(&world.mu, deadline);
    }
  }

 private:
  std::shared_ptr<WorldState> world_;
  std::shared_ptr<OpState> op_;
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<GroupState> group, int rank)
      : group_(std::move(group)), rank_(rank) {
    label_ = absl::StrCat("rank ", rank_);
    if (group_->id != 0) {
      absl::StrAppend(&label_, " (world rank ", group_->world_ranks[rank_], ", group ", group_->id,
                      ")");
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  CommBackend kind() const override { return CommBackend::kLocal; }
  CommCapabilities capabilities() const override { return kLocalCapabilities; }

  std::unique_ptr<Work> Send(const Tensor& t, int peer, int64_t tag) override {
    std::shared_ptr<OpState> op = NewOp(comm_internal::SendDescription(peer, tag));
    WorldState& world = *group_->world;
    absl::Status valid = CheckP2P(t, peer, tag, *op);
    absl::MutexLock lock(&world.mu);
    if (world.aborted) {
      Complete(*op, world.abort_status);
    } else if (!valid.ok()) {
      Complete(*op, valid);
    } else {
      const MailKey key{peer, rank_, tag};
      absl::Status sent;
      if (std::optional<PendingRecv> recv = PopFront(group_->pending, key)) {
        Deliver(*recv, t);
        world.cv.SignalAll();
      } else if (absl::StatusOr<Tensor> message = CloneMessage(t); message.ok()) {
        group_->messages[key].push_back(*std::move(message));
      } else {
        sent = comm_internal::Annotate(
            message.status(),
            absl::StrCat(op->label, ": ", op->description, ": copying the message"));
      }
      Complete(*op, std::move(sent));
    }
    return std::make_unique<LocalWork>(group_->world, std::move(op));
  }

  std::unique_ptr<Work> Recv(Tensor& t, int peer, int64_t tag) override {
    std::shared_ptr<OpState> op = NewOp(comm_internal::RecvDescription(peer, tag));
    WorldState& world = *group_->world;
    absl::Status valid = CheckP2P(t, peer, tag, *op);
    absl::MutexLock lock(&world.mu);
    if (world.aborted) {
      Complete(*op, world.abort_status);
    } else if (!valid.ok()) {
      Complete(*op, valid);
    } else {
      const MailKey key{rank_, peer, tag};
      PendingRecv recv{op, t};
      if (std::optional<Tensor> message = PopFront(group_->messages, key)) {
        Deliver(recv, *message);
      } else {
        group_->pending[key].push_back(std::move(recv));
      }
    }
    return std::make_unique<LocalWork>(group_->world, std::move(op));
  }

  std::unique_ptr<Work> AllReduce(Tensor& t) override {
    Arrival a;
    a.args.tensor = t;
    return Join(CollectiveKind::kAllReduce, std::move(a));
  }

  std::unique_ptr<Work> AllGather(const Tensor& in, Tensor& out) override {
    return JoinInOut(CollectiveKind::kAllGather, in, out);
  }

  std::unique_ptr<Work> ReduceScatter(const Tensor& in, Tensor& out) override {
    return JoinInOut(CollectiveKind::kReduceScatter, in, out);
  }

  std::unique_ptr<Work> Broadcast(Tensor& t, int root) override {
    Arrival a;
    a.args.tensor = t;
    a.args.root = root;
    return Join(CollectiveKind::kBroadcast, std::move(a));
  }

  std::unique_ptr<Work> Barrier() override { return Join(CollectiveKind::kBarrier, Arrival{}); }

  void Abort(const absl::Status& status) override {
    WorldState& world = *group_->world;
    absl::MutexLock lock(&world.mu);
    if (world.aborted) return;
    world.aborted = true;
    world.abort_status = status.ok() ? absl::AbortedError("aborted") : status;
    world.cv.SignalAll();
  }

  absl::Status abort_status() const override {
    WorldState& world = *group_->world;
    absl::MutexLock lock(&world.mu);
    return world.aborted ? world.abort_status : absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      absl::Duration timeout) override {
    Arrival a;
    a.color = color;
    a.key = key;
    std::shared_ptr<OpState> op;
    Join(CollectiveKind::kSplit, std::move(a), &op);
    PW_RETURN_IF_ERROR(LocalWork::WaitOp(*group_->world, *op, timeout));
    absl::MutexLock lock(&group_->world->mu);
    return std::move(op->split_result);  // nullptr for a negative color
  }

 private:
  std::shared_ptr<OpState> NewOp(std::string description) const {
    auto op = std::make_shared<OpState>();
    op->label = label_;
    op->description = std::move(description);
    return op;
  }

  static void Complete(OpState& op, absl::Status status) {
    op.done = true;
    op.status = std::move(status);
    op.collective.reset();
  }

  absl::Status CheckP2P(const Tensor& t, int peer, int64_t tag, const OpState& op) const {
    return comm_internal::CheckP2P(t, peer, tag, group_->size,
                                   absl::StrCat(op.label, ": ", op.description), kind(),
                                   kLocalCapabilities);
  }

  // Copies `message` into the pending receive that matched it and completes the receive (with
  // an error if the layouts differ; the message is consumed either way). World mutex held.
  static void Deliver(PendingRecv& recv, const Tensor& message) {
    if (!SameLayout(recv.tensor, message)) {
      Complete(*recv.op,
               absl::InvalidArgumentError(absl::StrCat(
                   recv.op->label, ": ", recv.op->description, ": message of ", message.nbytes(),
                   " bytes (", message.ShapeString(), ") does not match the receive buffer of ",
                   recv.tensor.nbytes(), " bytes (", recv.tensor.ShapeString(), ")")));
      return;
    }
    Complete(*recv.op,
             comm_internal::Annotate(CopyInto(recv.tensor, message),
                                     absl::StrCat(recv.op->label, ": ", recv.op->description)));
  }

  // Checks one arrival on its own; returns the error that poisons the slot, if any.
  absl::Status CheckArrival(CollectiveKind kind, const Arrival& a, const OpState& op) const {
    return comm_internal::CheckCollective(kind, a.args, group_->size,
                                          absl::StrCat(op.label, ": ", op.description),
                                          this->kind(), kLocalCapabilities);
  }

  // Checks an arrival against the slot's first arrival.
  absl::Status CheckAgainstFirst(const Collective& c, CollectiveKind kind, const Arrival& a) const {
    const Arrival& first = c.arrivals[c.first_rank];
    return comm_internal::CheckAgreement(
        c.seq, comm_internal::CallOf(kind, a.args.tensor, a.args.root), label_,
        comm_internal::CallOf(c.kind, first.args.tensor, first.args.root),
        absl::StrCat("rank ", c.first_rank));
  }

  static void Poison(Collective& c, const absl::Status& status) {
    c.status = status;
    for (Arrival& a : c.arrivals) {
      if (a.op && !a.op->done) Complete(*a.op, status);
    }
  }

  // Joins a collective of an input and an output tensor (AllGather, ReduceScatter).
  std::unique_ptr<Work> JoinInOut(CollectiveKind kind, const Tensor& in, Tensor& out) {
    Arrival a;
    a.args.tensor = in;
    a.args.out = out;
    return Join(kind, std::move(a));
  }

  std::unique_ptr<Work> Join(CollectiveKind kind, Arrival a,
                             std::shared_ptr<OpState>* op_out = nullptr) {
    const int64_t seq = next_seq_++;
    std::shared_ptr<OpState> op = NewOp(comm_internal::CollectiveDescription(kind, seq));
    if (op_out) *op_out = op;
    a.op = op;
    WorldState& world = *group_->world;
    absl::Status valid = CheckArrival(kind, a, *op);

    std::shared_ptr<Collective> ready;  // set when this rank completes the rendezvous
    {
      absl::MutexLock lock(&world.mu);
      if (world.aborted) {
        Complete(*op, world.abort_status);
        return std::make_unique<LocalWork>(group_->world, std::move(op));
      }
      std::shared_ptr<Collective>& slot = group_->collectives[seq];
      if (!slot) {
        slot = std::make_shared<Collective>();
        slot->seq = seq;
        slot->kind = kind;
        slot->first_rank = rank_;
        slot->present.assign(group_->size, false);
        slot->arrivals.resize(group_->size);
      }
      std::shared_ptr<Collective> c = slot;
      PW_CHECK(!c->present[rank_]);
      if (valid.ok() && c->status.ok() && c->first_rank != rank_) {
        valid = CheckAgainstFirst(*c, kind, a);
      }
      c->present[rank_] = true;
      ++c->arrived;
      const bool last = c->arrived == group_->size;
      if (last) group_->collectives.erase(seq);
      if (!c->status.ok()) {
        Complete(*op, c->status);
        c->arrivals[rank_] = Arrival{};
      } else if (!valid.ok()) {
        c->arrivals[rank_] = std::move(a);
        Poison(*c, valid);
        c->arrivals.clear();  // release the tensors
        c->arrivals.resize(group_->size);
        world.cv.SignalAll();
      } else {
        op->collective = c;
        c->arrivals[rank_] = std::move(a);
        if (last) {
          if (kind == CollectiveKind::kSplit) {
            FinishSplit(*c);
            world.cv.SignalAll();
          } else {
            ready = c;
          }
        }
      }
    }

    if (ready) {
      // Every rank has arrived and the slot left the map: no one else touches the arrivals'
      // tensors (they stay referenced), so compute outside the mutex.
      const absl::Status computed = comm_internal::Annotate(
          Compute(*ready), comm_internal::CollectiveDescription(ready->kind, ready->seq));
      absl::MutexLock lock(&world.mu);
      // An abort that came during the computation wins: the op never completed for its waiters.
      const absl::Status result = world.aborted ? world.abort_status : computed;
      for (Arrival& arrival : ready->arrivals) Complete(*arrival.op, result);
      ready->arrivals.clear();
      world.cv.SignalAll();
    }
    return std::make_unique<LocalWork>(group_->world, std::move(op));
  }

  // Device tensors are staged through host memory (HostView), and results copied back with
  // CopyInto; for host tensors both are the plain tensors and memcpy they always were.
  static absl::Status Compute(Collective& c) {
    std::vector<Arrival>& in = c.arrivals;
    switch (c.kind) {
      case CollectiveKind::kAllReduce: {
        std::vector<Tensor> host(in.size());
        std::vector<const void*> terms(in.size());
        for (size_t r = 0; r < in.size(); ++r) {
          PW_ASSIGN_OR_RETURN(host[r], HostView(in[r].args.tensor));
          terms[r] = host[r].raw();
        }
        // Note [rank-order sum]: the same bytes then go to every rank.
        const Tensor& first = host[0];
        PW_ASSIGN_OR_RETURN(Tensor acc, Tensor::TryEmpty(first.shape(), first.dtype()));
        comm_internal::RankOrderSum(acc.dtype(), acc.raw(), terms, acc.numel());
        for (Arrival& a : in) PW_RETURN_IF_ERROR(CopyInto(a.args.tensor, acc));
        return absl::OkStatus();
      }
      case CollectiveKind::kReduceScatter: {
        // Rank d's `out` = chunk d of the rank-order sum (Note [rank-order sum]): the same float
        // operations on the same elements as AllReduce's, so the same bits. A host `out` is summed
        // into directly unless it overlaps a term (in place: `out` a view of chunk d of that
        // rank's `in`), which is summed into a temporary first.
        std::vector<Tensor> host(in.size());
        for (size_t r = 0; r < in.size(); ++r) {
          PW_ASSIGN_OR_RETURN(host[r], HostView(in[r].args.tensor));
        }
        const DType dtype = host[0].dtype();
        const int64_t n = in[0].args.out.numel();
        if (n == 0) return absl::OkStatus();
        const size_t bytes = static_cast<size_t>(n) * DTypeSize(dtype);
        std::vector<const void*> terms(in.size());
        for (size_t d = 0; d < in.size(); ++d) {
          for (size_t r = 0; r < in.size(); ++r) {
            terms[r] = static_cast<const char*>(host[r].raw()) + d * bytes;
          }
          Tensor& out = in[d].args.out;
          if (OnHost(out) && !comm_internal::OverlapsAny(out.raw(), bytes, terms, bytes)) {
            comm_internal::RankOrderSum(dtype, out.raw(), terms, n);
            continue;
          }
          PW_ASSIGN_OR_RETURN(Tensor chunk, Tensor::TryEmpty({n}, dtype));
          comm_internal::RankOrderSum(dtype, chunk.raw(), terms, n);
          PW_RETURN_IF_ERROR(CopyInto(out, chunk));
        }
        return absl::OkStatus();
      }
      case CollectiveKind::kAllGather: {
        // Rank r's input at [r * bytes, (r + 1) * bytes) of one host buffer, copied to everyone.
        const Tensor& in0 = in[0].args.tensor;
        const size_t bytes = in0.nbytes();
        PW_ASSIGN_OR_RETURN(
            Tensor gathered,
            Tensor::TryEmpty({static_cast<int64_t>(in.size()) * in0.numel()}, in0.dtype()));
        for (size_t r = 0; r < in.size(); ++r) {
          PW_ASSIGN_OR_RETURN(const Tensor src, HostView(in[r].args.tensor));
          if (bytes > 0) {
            std::memcpy(static_cast<char*>(gathered.raw()) + r * bytes, src.raw(), bytes);
          }
        }
        for (Arrival& a : in) PW_RETURN_IF_ERROR(CopyInto(a.args.out, gathered));
        return absl::OkStatus();
      }
      case CollectiveKind::kBroadcast: {
        const Tensor& root = in[in[0].args.root].args.tensor;
        PW_ASSIGN_OR_RETURN(const Tensor src, HostView(root));
        for (Arrival& a : in) {
          if (a.args.tensor.raw() != root.raw()) PW_RETURN_IF_ERROR(CopyInto(a.args.tensor, src));
        }
        return absl::OkStatus();
      }
      case CollectiveKind::kBarrier:
        return absl::OkStatus();
      case CollectiveKind::kSplit:
        PW_CHECK(false);  // finished under the mutex
    }
    return absl::OkStatus();
  }

  // Builds the communicators of a Split and completes every participant. Mutex held.
  void FinishSplit(Collective& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(group_->world->mu) {
    WorldState& world = *group_->world;
    std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, parent rank)
    for (int r = 0; r < group_->size; ++r) {
      if (c.arrivals[r].color >= 0) by_color[c.arrivals[r].color].push_back({c.arrivals[r].key, r});
    }
    for (auto& [color, members] : by_color) {
      std::sort(members.begin(), members.end());
      auto g = std::make_shared<GroupState>();
      g->world = group_->world;
      g->id = world.next_group_id++;
      g->size = static_cast<int>(members.size());
      for (const auto& [key, parent_rank] : members) {
        g->world_ranks.push_back(group_->world_ranks[parent_rank]);
      }
      for (int new_rank = 0; new_rank < g->size; ++new_rank) {
        c.arrivals[members[new_rank].second].op->split_result =
            std::make_unique<LocalCommunicator>(g, new_rank);
      }
    }
    for (Arrival& a : c.arrivals) Complete(*a.op, absl::OkStatus());
    c.arrivals.clear();
  }

  std::shared_ptr<GroupState> group_;
  int rank_;
  std::string label_;
  int64_t next_seq_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateLocalWorld(int size) {
  std::vector<std::unique_ptr<Communicator>> comms;
  if (size <= 0) return comms;
  auto group = std::make_shared<GroupState>();
  group->world = std::make_shared<WorldState>();
  group->id = 0;
  group->size = size;
  for (int r = 0; r < size; ++r) group->world_ranks.push_back(r);
  comms.reserve(size);
  for (int r = 0; r < size; ++r) comms.push_back(std::make_unique<LocalCommunicator>(group, r));
  return comms;
}

}  // namespace pipewright
