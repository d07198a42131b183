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

absl::Status RankExecutor::RunAsync(const AsyncRun& run, int64_t* end) {
  const int D = ctx_->topo.dp;
  AsyncDataParallel* a = dp_->async();
  if (a == nullptr) return absl::InternalError("asynchronous DP without its strategy");
  PW_RETURN_IF_ERROR(a->StartRun());
  loader_.reset();  // this run's first replica step reads the engine's current step
  async_done_ = 0;
  std::atomic<bool> cancel{false}, service_done{false};
  absl::Status service_status;
  std::thread service([&] {
    service_status = RunAsyncService(AsyncServiceArgs{groups_.data_parallel(), a->shard(),
                                                      global_ == 0 ? run.coord : nullptr,
                                                      ctx_->timeout, &cancel});
    if (!service_status.ok()) groups_.world()->Abort(service_status);
    service_done.store(true);
  });
  absl::Status s = AsyncLoop(run, *a);
  if (s.ok()) {
    // Goodbye to every other owner: their services end once every replica has said it.
    for (int o = 0; o < D; ++o) {
      if (o != replica_)
        PW_RETURN_IF_ERROR(a->SendHeader({double(AsyncRequest::kBye)}, o, kAsyncTagRequest));
    }
  } else {
    groups_.world()->Abort(s);
  }
  // A replica that never says goodbye (a dead or stopped process) must not hold this one.
  const Clock::time_point deadline =
      Clock::now() + std::chrono::microseconds(absl::ToInt64Microseconds(ctx_->timeout));
  while (!service_done.load()) {
    if (Clock::now() > deadline) {
      groups_.world()->Abort(absl::DeadlineExceededError(
          absl::StrCat(Who(), ": asynchronous DP: some replica never finished its steps within ",
                       absl::FormatDuration(ctx_->timeout), " of this one")));
      cancel.store(true);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  service.join();
  PW_RETURN_IF_ERROR(a->FinishSends());
  if (!s.ok()) return groups_.world()->abort_status().ok() ? s : groups_.world()->abort_status();
  if (!service_status.ok()) return service_status;
  PW_RETURN_IF_ERROR(a->Consolidate());
  // Every rank learns where the run ended (the coordinator may have stopped it early).
  Tensor v = Tensor::Zeros({2}, DType::kF64, host_.get());
  if (run.coord != nullptr && global_ == 0) {
    v.data<double>()[0] = static_cast<double>(run.coord->end_ticket());
  }
  PW_RETURN_IF_ERROR(AllReduceHost(v, "asynchronous DP end of run"));
  *end = static_cast<int64_t>(v.data<double>()[0]);
  return absl::OkStatus();
}

absl::StatusOr<AsyncCoordinator::Grant> RankExecutor::ClaimStep(const AsyncRun& run,
                                                                AsyncDataParallel& a,
                                                                const double* claim) {
  if (replica_ == 0) {
    if (run.coord == nullptr) return absl::InternalError("no asynchronous DP coordinator");
    run.coord->Claim(0, claim);
    return run.coord->WaitGrant(0, ctx_->timeout,
                                [this] { return groups_.world()->abort_status(); });
  }
  PW_RETURN_IF_ERROR(
      a.SendHeader(std::vector<double>(claim, claim + kAsyncHeaderLen), 0, kAsyncTagRequest));
  Tensor g = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, host_.get());
  std::unique_ptr<Work> w = groups_.data_parallel()->Recv(g, 0, kAsyncTagGrant);
  PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: step grant from the coordinator"));
  const double* d = g.data<double>();
  return AsyncCoordinator::Grant{d[0] != 0, static_cast<int64_t>(d[1]), static_cast<int64_t>(d[2])};
}

absl::Status RankExecutor::AsyncLoop(const AsyncRun& run, AsyncDataParallel& a) {
  const int D = ctx_->topo.dp, pp = ctx_->topo.pp;
  const int64_t first_step = run.first_ticket / D;
  double waited = 0;
  int64_t last_ticket = -1;
  double last_loss = 0, last_norm = 0;
  for (;;) {
    Tensor g = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, host_.get());
    double* gd = g.data<double>();
    if (pipe_ == 0) {
      const Clock::time_point t = Clock::now();
      const double claim[kAsyncHeaderLen] = {double(AsyncRequest::kClaim),
                                             double(async_done_),
                                             StopRequested() ? 1.0 : 0.0,
                                             waited,
                                             double(last_ticket),
                                             last_loss,
                                             last_norm,
                                             0};
      flight_.Begin(first_step + async_done_, "CLAIM (a step from the coordinator)", Now());
      PW_ASSIGN_OR_RETURN(const AsyncCoordinator::Grant grant, ClaimStep(run, a, claim));
      flight_.End(Now());
      waited += Seconds(t, Clock::now());
      gd[0] = grant.go ? 1 : 0;
      gd[1] = static_cast<double>(grant.ticket);
      gd[2] = static_cast<double>(grant.staleness);
    }
    if (pp > 1) {
      std::unique_ptr<Work> w = groups_.pipeline()->Broadcast(g, 0);
      PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: the replica's grant"));
    }
    if (gd[0] == 0) return absl::OkStatus();
    const int64_t ticket = static_cast<int64_t>(gd[1]);
    const float lr = run.lr.At(ticket / D);
    const Clock::time_point t = Clock::now();
    PW_RETURN_IF_ERROR(a.Pull());
    Record(EventKind::kAllReduce, Action{ActionKind::kOptimizerStep, 0, 0}, t);
    const RankTimes pulled = step_times_;
    StepOutcome out;
    PW_RETURN_IF_ERROR(RunStep(first_step + async_done_, lr, &out));
    // RunStep starts the step's times afresh: the pull belongs to this step.
    total_.all_reduce += pulled.all_reduce;
    total_.wall += pulled.all_reduce;
    if (pp > 1) {
      std::unique_ptr<Work> w = groups_.pipeline()->Barrier();
      PW_RETURN_IF_ERROR(WaitOrAbort(*w, "asynchronous DP: the replica's end of step"));
    }
    last_ticket = ticket;
    last_loss = out.loss;
    last_norm = out.grad_norm;
    ++async_done_;
  }
}

std::vector<int64_t> RankExecutor::AsyncApplied() {
  AsyncDataParallel* a = dp_->async();
  return a != nullptr ? a->Applied() : std::vector<int64_t>();
}

}  // namespace pipewright::internal
