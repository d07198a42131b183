// Asynchronous data parallelism: shards, the coordinator and the service loop (async_dp.h).
//
// Note [Async DP]. Bounded-staleness asynchronous data parallelism (stale-synchronous parallel,
// Ho et al. 2013) without a parameter-server process:
//  - Ownership. Within each pipeline rank's data-parallel group, every parameter is owned by one
//    replica (AssignOwners: balanced by size, the same on every replica). The owner keeps the
//    master copy and the optimizer state of what it owns (an AsyncShard); every replica keeps a
//    working copy of all of its stage's parameters for its forward and backward.
//  - A replica step. The replica's first pipeline rank claims the step from the coordinator
//    (global rank 0) and broadcasts the grant down its pipeline; every rank pulls its stage's
//    current values from the owners, runs the schedule's program, agrees with its pipeline on
//    the replica's loss and gradient norm (clipping stays exact per replica gradient), pushes
//    each owner its share of the gradients and waits for the acknowledgements — the owner has
//    applied them with the optimizer by then. A replica barrier follows, so a replica's next
//    claim means every stage of its last step is applied.
//  - The bound. A claim says how many steps the replica has done; the coordinator grants the
//    next step when that is at most `staleness` more than the fewest any running replica has
//    done (the slowest), else holds the claim until the slowest catches up. So every update a
//    replica reads includes every replica's updates older than `staleness` steps; staleness 0
//    is lock-step (no replica starts step k + 1 before all have finished step k), like
//    synchronous DP — but each replica's gradient is its own optimizer update, applied in
//    arrival order, so the arithmetic differs (and is not reproducible: the order is a race).
//  - The run's length. Each grant takes the next ticket; a run to engine step N hands out N x dp
//    tickets (the same number of samples as N synchronous steps), to whichever replica is ready,
//    so a fast replica takes more steps than a slow one. Ticket t's learning rate is the
//    schedule's at step t / dp. A stop request ends the run at the next multiple of dp tickets,
//    so the engine's step stays whole.
//  - Service. Each rank runs a service thread beside its own that answers the other replicas'
//    pulls, pushes and (on the coordinator) claims on the data-parallel communicator, posting
//    point-to-point operations concurrently with the rank's thread
//    (CommCapabilities::concurrent_p2p); the shard's mutex orders the two threads' updates. A
//    replica that is done says goodbye to every other owner; a service ends when every other
//    replica has.
//  - Afterwards the owners broadcast their masters and state to every replica (consolidation),
//    so checkpoints, weights and a later run see one model with full optimizer state.
#include "runtime/data_parallel/async_dp.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"

namespace pipewright::internal {

std::vector<int> AssignOwners(const std::vector<Parameter*>& params, int replicas) {
  std::vector<int> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return params[a]->value.numel() > params[b]->value.numel();
  });
  std::vector<int64_t> load(replicas, 0);
  std::vector<int> owner(params.size(), 0);
  for (int i : order) {
    const int o = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = o;
    load[o] += params[i]->value.numel();
  }
  return owner;
}

absl::StatusOr<std::unique_ptr<AsyncShard>> AsyncShard::Create(const OptimizerConfig& config,
                                                               std::vector<Parameter*> owned,
                                                               const Optimizer& from, int replicas,
                                                               Allocator* alloc) {
  std::unique_ptr<AsyncShard> s(new AsyncShard());
  s->owned_ = std::move(owned);
  std::vector<Parameter*> ptrs;
  for (Parameter* p : s->owned_) {
    if (!p->value.device().is_cpu() || p->value.dtype() != DType::kF32) {
      return absl::FailedPreconditionError(
          absl::StrCat("asynchronous DP keeps f32 host parameters; '", p->name, "' is not"));
    }
    auto m = std::make_unique<Parameter>();
    m->name = p->name;
    m->weight_decay = p->weight_decay;
    m->value = Tensor::Empty(p->value.shape(), DType::kF32, alloc);
    std::memcpy(m->value.raw(), p->value.raw(), p->value.nbytes());
    m->grad = Tensor::Zeros(p->value.shape(), DType::kF32, alloc);
    s->numel_ += p->value.numel();
    ptrs.push_back(m.get());
    s->master_.push_back(std::move(m));
  }
  s->opt_ = Optimizer::Create(config, ptrs, alloc);
  std::map<std::string, Tensor> state;
  for (auto& [name, t] : from.State()) state.emplace(name, t);
  PW_RETURN_IF_ERROR(s->opt_->LoadState(state, from.step_count()));
  s->applied_.assign(replicas, 0);
  return s;
}

void AsyncShard::Read(float* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& m : master_) {
    std::memcpy(out, m->value.raw(), m->value.nbytes());
    out += m->value.numel();
  }
}

absl::StatusOr<int64_t> AsyncShard::Apply(int replica, int64_t step, float lr, float scale,
                                          const float* grads) {
  absl::MutexLock lock(&mu_);
  if (replica < 0 || replica >= static_cast<int>(applied_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("gradients from unknown replica ", replica));
  }
  if (step != applied_[replica]) {
    return absl::InternalError(absl::StrCat(
        "replica ", replica, "'s gradients of its step ", step, " arrived when its step ",
        applied_[replica], " was expected: a gradient would be applied twice or not at all"));
  }
  for (const auto& m : master_) {
    std::memcpy(m->grad.raw(), grads, m->grad.nbytes());
    grads += m->grad.numel();
  }
  const int64_t before = opt_->step_count();
  PW_RETURN_IF_ERROR(opt_->Step(lr, scale));
  ++applied_[replica];
  return before;
}

absl::Status AsyncShard::Store(Optimizer& to) const {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < owned_.size(); ++i) {
    std::memcpy(owned_[i]->value.raw(), master_[i]->value.raw(), master_[i]->value.nbytes());
  }
  std::map<std::string, Tensor> mine;
  for (auto& [name, t] : opt_->State()) mine.emplace(name, t);
  for (auto& [name, t] : to.State()) {
    auto it = mine.find(name);
    if (it != mine.end()) std::memcpy(t.raw(), it->second.raw(), t.nbytes());
  }
  return absl::OkStatus();
}

std::vector<int64_t> AsyncShard::applied() const {
  absl::MutexLock lock(&mu_);
  return applied_;
}

int64_t AsyncShard::updates() const {
  absl::MutexLock lock(&mu_);
  return opt_->step_count();
}

AsyncCoordinator::AsyncCoordinator(int replicas, int staleness, int64_t first_ticket,
                                   int64_t end_ticket)
    : replicas_(replicas),
      staleness_(staleness),
      first_ticket_(first_ticket),
      end_ticket_(end_ticket),
      next_ticket_(first_ticket),
      done_(replicas, 0),
      running_(replicas, 1),
      pending_(replicas, 0),
      stats_(replicas),
      staleness_sum_(replicas, 0) {
  for (int r = 0; r < replicas; ++r) stats_[r].replica = r;
}

void AsyncCoordinator::Claim(int r, const double* h) {
  absl::MutexLock lock(&mu_);
  done_[r] = static_cast<int64_t>(h[1]);
  if (h[2] != 0 && !stopping_) {
    // Stop at the next whole engine step (tickets start at a multiple of dp).
    stopping_ = true;
    const int64_t handed = next_ticket_ - first_ticket_;
    end_ticket_ =
        std::min(end_ticket_, first_ticket_ + (handed + replicas_ - 1) / replicas_ * replicas_);
  }
  stats_[r].wait_s = h[3];
  if (h[4] >= 0) {
    updates_[static_cast<int64_t>(h[4])] = AsyncReport::Update{r, h[5], h[6], 0.0f};
  }
  pending_[r] = 1;
  DecideLocked();
}

void AsyncCoordinator::DecideLocked() {
  for (bool changed = true; changed;) {
    changed = false;
    int64_t slowest = -1;
    for (int r = 0; r < replicas_; ++r) {
      if (running_[r] && (slowest < 0 || done_[r] < slowest)) slowest = done_[r];
    }
    // The slowest claims first, so that a fast replica cannot take the last tickets ahead of it.
    std::vector<int> order;
    for (int r = 0; r < replicas_; ++r) {
      if (pending_[r]) order.push_back(r);
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return done_[a] < done_[b]; });
    for (int r : order) {
      if (next_ticket_ >= end_ticket_) {
        decided_[r] = Grant{};
        pending_[r] = 0;
        running_[r] = 0;  // leaves the bound's minimum
        changed = true;
        break;
      }
      const int64_t ahead = done_[r] - slowest;
      if (ahead > staleness_) continue;
      decided_[r] = Grant{true, next_ticket_++, ahead};
      pending_[r] = 0;
      ++stats_[r].steps;
      staleness_sum_[r] += ahead;
      stats_[r].max_staleness = std::max(stats_[r].max_staleness, ahead);
    }
  }
}

std::vector<std::pair<int, AsyncCoordinator::Grant>> AsyncCoordinator::TakeRemote(int local) {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<int, Grant>> out;
  for (auto it = decided_.begin(); it != decided_.end();) {
    if (it->first == local) {
      ++it;
      continue;
    }
    out.emplace_back(it->first, it->second);
    it = decided_.erase(it);
  }
  return out;
}

absl::StatusOr<AsyncCoordinator::Grant> AsyncCoordinator::WaitGrant(
    int r, absl::Duration timeout, const std::function<absl::Status()>& aborted) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration nap = absl::Microseconds(20);
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto it = decided_.find(r);
      if (it != decided_.end()) {
        Grant g = it->second;
        decided_.erase(it);
        return g;
      }
    }
    PW_RETURN_IF_ERROR(aborted());
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("replica ", r, " waited more than ", absl::FormatDuration(timeout),
                       " for the slowest replica (staleness bound ", staleness_, ")"));
    }
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Milliseconds(1));
  }
}

AsyncReport AsyncCoordinator::Report() const {
  absl::MutexLock lock(&mu_);
  AsyncReport rep;
  rep.stop_requested = stopping_;
  rep.replicas = stats_;
  for (int r = 0; r < replicas_; ++r) {
    if (stats_[r].steps > 0) {
      rep.replicas[r].mean_staleness =
          static_cast<double>(staleness_sum_[r]) / static_cast<double>(stats_[r].steps);
    }
  }
  for (const auto& [ticket, u] : updates_) rep.updates.push_back(u);
  return rep;
}

int64_t AsyncCoordinator::end_ticket() const {
  absl::MutexLock lock(&mu_);
  return std::min(end_ticket_, next_ticket_);
}

absl::Status RunAsyncService(const AsyncServiceArgs& a) {
  Communicator& c = *a.comm;
  const int me = c.rank(), n = c.size();
  const int64_t len = std::max<int64_t>(1, a.shard->numel());
  std::vector<Tensor> header(n);
  std::vector<std::unique_ptr<Work>> request(n);
  std::vector<std::unique_ptr<Work>> sends;
  Tensor grads = Tensor::Empty({len}, DType::kF32, DefaultCpuAllocator());
  auto post = [&](int r) {
    header[r] = Tensor::Empty({kAsyncHeaderLen}, DType::kF64, DefaultCpuAllocator());
    request[r] = c.Recv(header[r], r, kAsyncTagRequest);
  };
  auto reply = [&](const std::vector<double>& v, int r) {
    Tensor t = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, DefaultCpuAllocator());
    std::copy(v.begin(), v.end(), t.data<double>());
    sends.push_back(c.Send(t, r, kAsyncTagGrant));
  };
  int open = 0;
  for (int r = 0; r < n; ++r) {
    if (r != me) {
      post(r);
      ++open;
    }
  }
  absl::Duration nap = absl::Microseconds(20);
  while (open > 0) {
    if (a.cancel != nullptr && a.cancel->load()) return absl::OkStatus();
    bool progressed = false;
    for (int r = 0; r < n; ++r) {
      if (request[r] == nullptr || !request[r]->Done()) continue;
      PW_RETURN_IF_ERROR(request[r]->Wait(absl::ZeroDuration()));
      progressed = true;
      const double* h = header[r].data<double>();
      switch (static_cast<AsyncRequest>(static_cast<int>(h[0]))) {
        case AsyncRequest::kPull: {
          Tensor v = Tensor::Zeros({len}, DType::kF32, DefaultCpuAllocator());
          a.shard->Read(v.data<float>());
          sends.push_back(c.Send(v, r, kAsyncTagValues));
          break;
        }
        case AsyncRequest::kPush: {
          std::unique_ptr<Work> w = c.Recv(grads, r, kAsyncTagGradients);
          if (absl::Status s = w->Wait(a.timeout); !s.ok()) {
            return absl::Status(s.code(),
                                absl::StrCat("replica ", me, "'s parameter service: ",
                                             "gradients from replica ", r, ": ", s.message()));
          }
          PW_ASSIGN_OR_RETURN(
              const int64_t before,
              a.shard->Apply(r, static_cast<int64_t>(h[1]), static_cast<float>(h[2]),
                             static_cast<float>(h[3]), grads.data<float>()));
          Tensor ack = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, DefaultCpuAllocator());
          ack.data<double>()[0] = static_cast<double>(before);
          sends.push_back(c.Send(ack, r, kAsyncTagAck));
          break;
        }
        case AsyncRequest::kClaim:
          if (a.coord == nullptr) {
            return absl::InternalError(absl::StrCat("replica ", r, " sent a step claim to replica ",
                                                    me, ", which is not the coordinator"));
          }
          a.coord->Claim(r, h);
          break;
        case AsyncRequest::kBye:
          request[r].reset();
          --open;
          continue;
        default:
          return absl::InvalidArgumentError(
              absl::StrCat("unknown asynchronous DP request ", h[0], " from replica ", r));
      }
      post(r);
    }
    if (a.coord != nullptr) {
      for (const auto& [r, g] : a.coord->TakeRemote(me)) {
        reply({g.go ? 1.0 : 0.0, static_cast<double>(g.ticket), static_cast<double>(g.staleness)},
              r);
        progressed = true;
      }
    }
    for (auto it = sends.begin(); it != sends.end();) {
      if (!(*it)->Done()) {
        ++it;
        continue;
      }
      PW_RETURN_IF_ERROR((*it)->Wait(absl::ZeroDuration()));
      it = sends.erase(it);
    }
    if (progressed) {
      nap = absl::Microseconds(20);
    } else {
      absl::SleepFor(nap);
      nap = std::min(nap * 2, absl::Milliseconds(1));
    }
  }
  for (auto& w : sends) PW_RETURN_IF_ERROR(w->Wait(a.timeout));
  return absl::OkStatus();
}

}  // namespace pipewright::internal
