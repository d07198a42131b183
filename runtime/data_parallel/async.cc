// The asynchronous strategy (data_parallel.h; Note [Async DP] in async_dp.cc): no gradient is
// reduced across replicas. Each parameter has an owner replica (AssignOwners) whose shard holds
// its master value and optimizer state; a replica step pulls every value from its owner, runs
// its program, agrees on its loss and norm within its own pipeline, and pushes each gradient to
// its owner, which applies it. The replica-step loop, the coordinator and the service thread
// are the engine's (RankExecutor::RunAsync); this is what a step and a run do to the parameters.
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/data_parallel/data_parallel.h"

namespace pipewright::internal {
namespace {

// Between runs the whole state is on every replica (Consolidate), as a replicated one's.
class Async final : public WholeOptimizer<AsyncDataParallel> {
 public:
  Async(const DataParallelContext& ctx, DataParallelParams params)
      : WholeOptimizer(ctx, std::move(params)) {}

  // Gradients stay with their replica until the push.
  void BeginStep() override { bytes_ = GradSyncBytes{}; }
  absl::Status BeginBackward(int, bool) override { return absl::OkStatus(); }
  absl::Status GradReady(int, int, bool) override { return absl::OkStatus(); }
  absl::Status StageReady(int) override { return absl::OkStatus(); }
  absl::Status Finish() override { return absl::OkStatus(); }

  // The replica's own gradient: every rank of the replica counts its own tensors.
  absl::Status AddSquaredNorm(ExactSum* sum) override {
    return AddWholeSquaredNorm(params_.stages, ctx_.alloc, ctx_.tensor_rank, sum);
  }
  int gradient_replicas() const override { return 1; }
  bool replicas_step_together() const override { return false; }

  // The push: each owner's gradients to it (its service applies them and acknowledges), this
  // replica's own applied here.
  absl::Status Step(float lr, float grad_scale) override {
    const int D = ctx_.replicas;
    const std::vector<Parameter*>& params = params_.trained;
    std::vector<Tensor> grads(D);
    for (int o = 0; o < D; ++o) {
      grads[o] = Tensor::Zeros({std::max<int64_t>(1, owned_numel_[o])}, DType::kF32, ctx_.alloc);
    }
    std::vector<int64_t> at(D, 0);
    for (size_t i = 0; i < params.size(); ++i) {
      const int o = owner_[i];
      const Tensor& g = params[i]->grad;
      std::memcpy(grads[o].data<float>() + at[o], g.raw(), g.nbytes());
      at[o] += g.numel();
    }
    acks_.assign(D, Tensor());
    ack_waits_.clear();
    ack_waits_.resize(D);
    for (int o = 0; o < D; ++o) {
      if (o == ctx_.replica) continue;
      PW_RETURN_IF_ERROR(
          SendHeader({double(AsyncRequest::kPush), double(pushes_), double(lr), double(grad_scale)},
                     o, kAsyncTagRequest));
      sends_.push_back(ctx_.dp->Send(grads[o], o, kAsyncTagGradients));
      bytes_.sent += static_cast<int64_t>(grads[o].nbytes());
      acks_[o] = Tensor::Empty({kAsyncHeaderLen}, DType::kF64, ctx_.alloc);
      ack_waits_[o] = ctx_.dp->Recv(acks_[o], o, kAsyncTagAck);
    }
    bytes_.uncompressed = bytes_.sent;
    PW_RETURN_IF_ERROR(
        shard_->Apply(ctx_.replica, pushes_, lr, grad_scale, grads[ctx_.replica].data<float>())
            .status());
    ++pushes_;
    return absl::OkStatus();
  }

  // Every owner has applied this step's push; finished sends are reaped.
  absl::Status SyncParameters() override {
    for (int r = 0; r < static_cast<int>(ack_waits_.size()); ++r) {
      if (ack_waits_[r] == nullptr) continue;
      PW_RETURN_IF_ERROR(ctx_.wait(*ack_waits_[r], absl::StrCat("asynchronous DP: replica ", r,
                                                                " applying this step's push")));
    }
    ack_waits_.clear();
    for (auto it = sends_.begin(); it != sends_.end();) {
      if (!(*it)->Done()) {
        ++it;
        continue;
      }
      PW_RETURN_IF_ERROR(ctx_.wait(**it, "asynchronous DP send"));
      it = sends_.erase(it);
    }
    return absl::OkStatus();
  }
  bool syncs_parameters() const override { return true; }

  GradSyncBytes StepBytes() const override { return bytes_; }
  int64_t GradientBytes() const override {
    int64_t n = 0;
    for (const Parameter* p : params_.trained) n += static_cast<int64_t>(p->grad.nbytes());
    return n;
  }
  absl::StatusOr<NamedTensors> SyncState() override { return NamedTensors{}; }
  absl::Status LoadSyncState(const std::map<std::string, Tensor>&, const std::string&) override {
    return absl::OkStatus();
  }

  AsyncDataParallel* async() override { return this; }

  absl::Status StartRun() override {
    const int D = ctx_.replicas;
    owner_ = AssignOwners(params_.trained, D);
    owned_numel_.assign(D, 0);
    std::vector<Parameter*> mine;
    for (size_t i = 0; i < params_.trained.size(); ++i) {
      owned_numel_[owner_[i]] += params_.trained[i]->value.numel();
      if (owner_[i] == ctx_.replica) mine.push_back(params_.trained[i]);
    }
    PW_ASSIGN_OR_RETURN(
        shard_, AsyncShard::Create(ctx_.optimizer, std::move(mine), *optimizer_, D, ctx_.alloc));
    pushes_ = 0;
    return absl::OkStatus();
  }
  AsyncShard* shard() override { return shard_.get(); }

  absl::Status Pull() override {
    const int D = ctx_.replicas;
    std::vector<Tensor> values(D);
    std::vector<std::unique_ptr<Work>> recvs(D);
    for (int o = 0; o < D; ++o) {
      values[o] = Tensor::Empty({std::max<int64_t>(1, owned_numel_[o])}, DType::kF32, ctx_.alloc);
      if (o == ctx_.replica) {
        shard_->Read(values[o].data<float>());
        continue;
      }
      PW_RETURN_IF_ERROR(SendHeader({double(AsyncRequest::kPull)}, o, kAsyncTagRequest));
      recvs[o] = ctx_.dp->Recv(values[o], o, kAsyncTagValues);
    }
    for (int o = 0; o < D; ++o) {
      if (recvs[o] != nullptr) {
        PW_RETURN_IF_ERROR(ctx_.wait(
            *recvs[o], absl::StrCat("asynchronous DP: pull of replica ", o, "'s parameters")));
      }
    }
    std::vector<int64_t> at(D, 0);
    for (size_t i = 0; i < params_.trained.size(); ++i) {
      const int o = owner_[i];
      Tensor& v = params_.trained[i]->value;
      std::memcpy(v.raw(), values[o].data<float>() + at[o], v.nbytes());
      at[o] += v.numel();
    }
    return absl::OkStatus();
  }

  absl::Status SendHeader(const std::vector<double>& v, int o, int64_t tag) override {
    Tensor t = Tensor::Zeros({kAsyncHeaderLen}, DType::kF64, ctx_.alloc);
    std::copy(v.begin(), v.end(), t.data<double>());
    sends_.push_back(ctx_.dp->Send(t, o, tag));
    return absl::OkStatus();
  }

  absl::Status FinishSends() override {
    for (auto& w : sends_) PW_RETURN_IF_ERROR(ctx_.wait(*w, "asynchronous DP send"));
    sends_.clear();
    return absl::OkStatus();
  }

  absl::Status Consolidate() override {
    PW_RETURN_IF_ERROR(shard_->Store(*optimizer_));
    const auto state = optimizer_->State();
    const std::vector<Parameter*>& params = params_.trained;
    const size_t per = params.empty() ? 0 : state.size() / params.size();
    std::vector<std::unique_ptr<Work>> works;
    for (size_t i = 0; i < params.size(); ++i) {
      works.push_back(ctx_.dp->Broadcast(params[i]->value, owner_[i]));
      for (size_t j = 0; j < per; ++j) {
        Tensor t = state[i * per + j].second;
        works.push_back(ctx_.dp->Broadcast(t, owner_[i]));
      }
    }
    for (auto& w : works) {
      PW_RETURN_IF_ERROR(ctx_.wait(*w, "asynchronous DP: gathering the owners' parameters"));
    }
    optimizer_->set_step_count(shard_->updates());
    return absl::OkStatus();
  }

  std::vector<int64_t> Applied() const override {
    return shard_ != nullptr ? shard_->applied() : std::vector<int64_t>();
  }

 private:
  std::vector<int> owner_;             // per trained parameter
  std::vector<int64_t> owned_numel_;   // per replica
  std::unique_ptr<AsyncShard> shard_;  // this replica's
  std::vector<std::unique_ptr<Work>> sends_;
  std::vector<Tensor> acks_;
  std::vector<std::unique_ptr<Work>> ack_waits_;
  int64_t pushes_ = 0;  // this run's replica steps pushed
  GradSyncBytes bytes_;
};

}  // namespace

std::unique_ptr<DataParallel> CreateAsync(const DataParallelContext& ctx,
                                          DataParallelParams params) {
  return std::make_unique<Async>(ctx, std::move(params));
}

}  // namespace pipewright::internal
