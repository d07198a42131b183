// The replicated strategy (data_parallel.h): every replica keeps every parameter, its gradient
// summed over the replicas by a GradSync, and the whole optimizer state.
#include <memory>
#include <utility>

#include "runtime/data_parallel/data_parallel.h"

namespace pipewright::internal {
namespace {

class Replicated final : public WholeOptimizer<DataParallel> {
 public:
  Replicated(const DataParallelContext& ctx, DataParallelParams params,
             std::unique_ptr<GradSync> sync)
      : WholeOptimizer(ctx, std::move(params)), sync_(std::move(sync)) {}

  void BeginStep() override { sync_->BeginStep(); }
  absl::Status BeginBackward(int, bool) override { return absl::OkStatus(); }
  absl::Status GradReady(int stage, int layer, bool last) override {
    return last ? sync_->LayerReady(stage, layer) : absl::OkStatus();
  }
  absl::Status StageReady(int stage) override { return sync_->StageReady(stage); }
  absl::Status Finish() override { return sync_->Finish(); }

  // Replica 0 counts every gradient (every replica holds the same sums).
  absl::Status AddSquaredNorm(ExactSum* sum) override {
    return ctx_.replica != 0
               ? absl::OkStatus()
               : AddWholeSquaredNorm(params_.stages, ctx_.alloc, ctx_.tensor_rank, sum);
  }

  absl::Status Step(float lr, float grad_scale) override {
    return optimizer_->Step(lr, grad_scale);
  }
  absl::Status SyncParameters() override { return absl::OkStatus(); }
  bool syncs_parameters() const override { return false; }
  GradSyncBytes StepBytes() const override { return sync_->StepBytes(); }
  int64_t GradientBytes() const override {
    int64_t n = 0;
    for (const GradSyncStage& st : params_.stages) {
      for (const std::vector<Parameter*>& layer : st.layers) {
        for (const Parameter* p : layer) n += static_cast<int64_t>(p->grad.nbytes());
      }
    }
    return n;
  }
  absl::StatusOr<NamedTensors> SyncState() override { return sync_->SaveState(); }
  absl::Status LoadSyncState(const std::map<std::string, Tensor>& state,
                             const std::string& prefix) override {
    return sync_->LoadState(state, prefix);
  }

 private:
  int gradient_replicas() const override { return ctx_.replicas; }

  std::unique_ptr<GradSync> sync_;
};

}  // namespace

std::unique_ptr<DataParallel> CreateReplicated(const DataParallelContext& ctx,
                                               DataParallelParams params,
                                               std::unique_ptr<GradSync> sync) {
  return std::make_unique<Replicated>(ctx, std::move(params), std::move(sync));
}

}  // namespace pipewright::internal
