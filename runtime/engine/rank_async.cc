// RankExecutor: asynchronous data parallelism on one rank — the replica-step loop, pulls and
// pushes to the owners, and the consolidation afterwards (Note [Async DP] in async_dp.cc).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "runtime/engine/rank_executor.h"

namespace pipewright::internal {

absl::Status RankExecutor::SendHeader(const std::vector<double>& v, int o, int64_t tag) {
  Tensor t = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, host.get());
  std::copy(v.begin(), v.end(), t.data<double>());
  async_sends_.push_back(dp_comm->Send(t, o, tag));
  return absl::OkStatus();
}

absl::Status RankExecutor::RunAsync(const AsyncRun& run, int64_t* end) {
  const int D = ctx->topo.dp;
  owner_ = AssignOwners(params, D);
  owned_numel_.assign(D, 0);
  std::vector<Parameter*> mine;
  for (size_t i = 0; i < params.size(); ++i) {
    owned_numel_[owner_[i]] += params[i]->value.numel();
    if (owner_[i] == replica) mine.push_back(params[i]);
  }
  PW_ASSIGN_OR_RETURN(shard_, AsyncShard::Create(ctx->options->optimizer, std::move(mine),
                                                 *dp->whole_optimizer(), D, alloc.get()));
  loader.reset();  // this run's first replica step reads the engine's current step
  async_done_ = 0;
  std::atomic<bool> cancel{false}, service_done{false};
  absl::Status service_status;
  std::thread service([&] {
    service_status = RunAsyncService(AsyncServiceArgs{
        dp_comm.get(), shard_.get(), global == 0 ? run.coord : nullptr, ctx->timeout, &cancel});
    if (!service_status.ok()) world->Abort(service_status);
    service_done.store(true);
  });
  absl::Status s = AsyncLoop(run);
  if (s.ok()) {
    // Goodbye to every other owner: their services end once every replica has said it.
    for (int o = 0; o < D; ++o) {
      if (o != replica)
        PW_RETURN_IF_ERROR(SendHeader({double(AsyncRequest::kBye)}, o, kAsyncTagRequest));
    }
  } else {
    world->Abort(s);
  }
  // A replica that never says goodbye (a dead or stopped process) must not hold this one.
  const Clock::time_point deadline =
      Clock::now() + std::chrono::microseconds(absl::ToInt64Microseconds(ctx->timeout));
  while (!service_done.load()) {
    if (Clock::now() > deadline) {
      world->Abort(absl::DeadlineExceededError(
          absl::StrCat(Who(), ": asynchronous DP: some replica never finished its steps within ",
                       absl::FormatDuration(ctx->timeout), " of this one")));
      cancel.store(true);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  service.join();
  for (auto& w : async_sends_) PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP send"));
  async_sends_.clear();
  if (!s.ok()) return world->abort_status().ok() ? s : world->abort_status();
  if (!service_status.ok()) return service_status;
  PW_RETURN_IF_ERROR(Consolidate());
  // Every rank learns where the run ended (the coordinator may have stopped it early).
  Tensor v = Tensor::Zeros({2}, DType::kF64, host.get());
  if (run.coord != nullptr && global == 0) {
    v.data<double>()[0] = static_cast<double>(run.coord->end_ticket());
  }
  PW_RETURN_IF_ERROR(AllReduceHost(v, "asynchronous DP end of run"));
  *end = static_cast<int64_t>(v.data<double>()[0]);
  return absl::OkStatus();
}

absl::StatusOr<AsyncCoordinator::Grant> RankExecutor::ClaimStep(const AsyncRun& run,
                                                                const double* claim) {
  if (replica == 0) {
    if (run.coord == nullptr) return absl::InternalError("no asynchronous DP coordinator");
    run.coord->Claim(0, claim);
    return run.coord->WaitGrant(0, ctx->timeout, [this] { return world->abort_status(); });
  }
  PW_RETURN_IF_ERROR(
      SendHeader(std::vector<double>(claim, claim + kAsyncHeaderLen), 0, kAsyncTagRequest));
  Tensor g = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, host.get());
  std::unique_ptr<Work> w = dp_comm->Recv(g, 0, kAsyncTagGrant);
  PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: step grant from the coordinator"));
  const double* d = g.data<double>();
  return AsyncCoordinator::Grant{d[0] != 0, static_cast<int64_t>(d[1]), static_cast<int64_t>(d[2])};
}

absl::Status RankExecutor::AsyncLoop(const AsyncRun& run) {
  const int D = ctx->topo.dp, pp = ctx->topo.pp;
  const int64_t first_step = run.first_ticket / D;
  double waited = 0;
  int64_t last_ticket = -1;
  double last_loss = 0, last_norm = 0;
  for (;;) {
    Tensor g = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, host.get());
    double* gd = g.data<double>();
    if (pipe == 0) {
      const Clock::time_point t = Clock::now();
      const double claim[kAsyncHeaderLen] = {double(AsyncRequest::kClaim),
                                             double(async_done_),
                                             StopRequested() ? 1.0 : 0.0,
                                             waited,
                                             double(last_ticket),
                                             last_loss,
                                             last_norm,
                                             0};
      flight.Begin(first_step + async_done_, "CLAIM (a step from the coordinator)", Now());
      PW_ASSIGN_OR_RETURN(const AsyncCoordinator::Grant grant, ClaimStep(run, claim));
      flight.End(Now());
      waited += Seconds(t, Clock::now());
      gd[0] = grant.go ? 1 : 0;
      gd[1] = static_cast<double>(grant.ticket);
      gd[2] = static_cast<double>(grant.staleness);
    }
    if (pp > 1) {
      std::unique_ptr<Work> w = replica_comm->Broadcast(g, 0);
      PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: the replica's grant"));
    }
    if (gd[0] == 0) return absl::OkStatus();
    const int64_t ticket = static_cast<int64_t>(gd[1]);
    const float lr = run.lr.At(ticket / D);
    const Clock::time_point t = Clock::now();
    PW_RETURN_IF_ERROR(AsyncPull());
    Record(EventKind::kAllReduce, Action{ActionKind::kOptimizerStep, 0, 0}, t);
    const RankTimes pulled = step_times;
    StepOutcome out;
    PW_RETURN_IF_ERROR(RunStep(first_step + async_done_, lr, &out));
    // RunStep starts the step's times afresh: the pull belongs to this step.
    total.all_reduce += pulled.all_reduce;
    total.wall += pulled.all_reduce;
    if (pp > 1) {
      std::unique_ptr<Work> w = replica_comm->Barrier();
      PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: the replica's end of step"));
    }
    last_ticket = ticket;
    last_loss = out.loss;
    last_norm = out.grad_norm;
    ++async_done_;
  }
}

absl::Status RankExecutor::AsyncPull() {
  const int D = ctx->topo.dp;
  std::vector<Tensor> values(D);
  std::vector<std::unique_ptr<Work>> recvs(D);
  for (int o = 0; o < D; ++o) {
    values[o] = Tensor::Empty({std::max<int64_t>(1, owned_numel_[o])}, DType::kF32, host.get());
    if (o == replica) {
      shard_->Read(values[o].data<float>());
      continue;
    }
    PW_RETURN_IF_ERROR(SendHeader({double(AsyncRequest::kPull)}, o, kAsyncTagRequest));
    recvs[o] = dp_comm->Recv(values[o], o, kAsyncTagValues);
  }
  for (int o = 0; o < D; ++o) {
    if (recvs[o] != nullptr) {
      PW_RETURN_IF_ERROR(WaitOrAbort(
          *recvs[o], absl::StrCat("asynchronous DP: pull of replica ", o, "'s parameters")));
    }
  }
  std::vector<int64_t> at(D, 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const int o = owner_[i];
    Tensor& v = params[i]->value;
    std::memcpy(v.raw(), values[o].data<float>() + at[o], v.nbytes());
    at[o] += v.numel();
  }
  return absl::OkStatus();
}

absl::Status RankExecutor::AsyncPush(float lr, StepOutcome* out) {
  const Action a{ActionKind::kOptimizerStep, 0, 0};
  Clock::time_point t = Clock::now();
  PW_RETURN_IF_ERROR(WaitSends());
  PW_RETURN_IF_ERROR(dp->Finish());
  PW_RETURN_IF_ERROR(ReduceTied());  // linked copies only: CheckAsync refuses ties across ranks
  // The replica's agreement (Note [Step agreement], over its pipeline only): its losses and every
  // layer's squared gradient norm, each entry written by the one rank that has it.
  const int64_t M = ctx->layout.micro_batches, L = ctx->graph->num_layers();
  Tensor v = Tensor::Zeros({M + L}, DType::kF64, host.get());
  double* d = v.data<double>();
  for (StageRt& st : stages) {
    if (st.last) {
      for (int64_t j = 0; j < M; ++j) d[j] = losses_[j];
    }
    for (int i = 0; i < st.stage->size(); ++i) {
      PW_ASSIGN_OR_RETURN(d[M + st.begin + i],
                          GradSquaredNorm(st.stage->layer(i).Parameters(), alloc.get()));
    }
  }
  if (ctx->topo.pp > 1) {
    std::unique_ptr<Work> w = replica_comm->AllReduce(v);
    PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: the replica's loss and norm"));
  }
  double loss = 0, norm2 = 0;
  for (int64_t i = 0; i < M; ++i) loss += d[i];
  for (int64_t i = 0; i < L; ++i) norm2 += d[M + i];
  out->loss = loss / static_cast<double>(M);
  out->grad_norm = std::sqrt(norm2);
  if (!std::isfinite(out->loss) || !std::isfinite(out->grad_norm)) {
    return absl::InternalError(absl::StrCat("replica ", replica, " step ", step_,
                                            ": non-finite loss or gradient norm; not pushed"));
  }
  const float scale = ClipScale(out->grad_norm, ctx->options->clip_norm);
  const int D = ctx->topo.dp;
  std::vector<Tensor> grads(D);
  for (int o = 0; o < D; ++o) {
    grads[o] = Tensor::Zeros({std::max<int64_t>(1, owned_numel_[o])}, DType::kF32, host.get());
  }
  std::vector<int64_t> at(D, 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const int o = owner_[i];
    const Tensor& g = params[i]->grad;
    std::memcpy(grads[o].data<float>() + at[o], g.raw(), g.nbytes());
    at[o] += g.numel();
  }
  std::vector<Tensor> acks(D);
  std::vector<std::unique_ptr<Work>> waits(D);
  int64_t sent = 0;
  for (int o = 0; o < D; ++o) {
    if (o == replica) continue;
    PW_RETURN_IF_ERROR(
        SendHeader({double(AsyncRequest::kPush), double(async_done_), double(lr), double(scale)}, o,
                   kAsyncTagRequest));
    async_sends_.push_back(dp_comm->Send(grads[o], o, kAsyncTagGradients));
    sent += grads[o].nbytes();
    acks[o] = Tensor::Empty({kAsyncHeaderLen}, DType::kF64, host.get());
    waits[o] = dp_comm->Recv(acks[o], o, kAsyncTagAck);
  }
  Clock::time_point o = Clock::now();
  PW_RETURN_IF_ERROR(
      shard_->Apply(replica, async_done_, lr, scale, grads[replica].data<float>()).status());
  Record(EventKind::kOptimizer, a, o);
  t = Clock::now();
  for (int r = 0; r < D; ++r) {
    if (waits[r] != nullptr) {
      PW_RETURN_IF_ERROR(WaitOrAbort(
          *waits[r], absl::StrCat("asynchronous DP: replica ", r, " applying this step's push")));
    }
  }
  // Sends are eager: reap the finished ones so the list stays short.
  for (auto it = async_sends_.begin(); it != async_sends_.end();) {
    if (!(*it)->Done()) {
      ++it;
      continue;
    }
    PW_RETURN_IF_ERROR(WaitOrAbort(**it, "asynchronous DP send"));
    it = async_sends_.erase(it);
  }
  Record(EventKind::kAllReduce, a, t);
  step_times.grad_bytes_sent += sent;
  step_times.grad_bytes_uncompressed += sent;
  return absl::OkStatus();
}

absl::Status RankExecutor::Consolidate() {
  PW_RETURN_IF_ERROR(shard_->Store(*dp->whole_optimizer()));
  const auto state = dp->whole_optimizer()->State();
  const size_t per = params.empty() ? 0 : state.size() / params.size();
  std::vector<std::unique_ptr<Work>> works;
  for (size_t i = 0; i < params.size(); ++i) {
    works.push_back(dp_comm->Broadcast(params[i]->value, owner_[i]));
    for (size_t j = 0; j < per; ++j) {
      Tensor t = state[i * per + j].second;
      works.push_back(dp_comm->Broadcast(t, owner_[i]));
    }
  }
  for (auto& w : works) {
    PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: gathering the owners' parameters"));
  }
  dp->whole_optimizer()->set_step_count(shard_->updates());
  return absl::OkStatus();
}

std::vector<int64_t> RankExecutor::AsyncApplied() const {
  return shard_ != nullptr ? shard_->applied() : std::vector<int64_t>();
}

}  // namespace pipewright::internal
