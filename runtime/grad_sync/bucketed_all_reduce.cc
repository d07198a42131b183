// The bucketed gradient all-reduce (grad_sync.h).
//
// Note [Bucket order]. Buckets are closed in backward order (a stage's last layer first) once
// they reach the bucket size, so the first bucket to complete is the first to be all-reduced
// while the backward of earlier layers still runs. Each replica builds the same buckets from the
// same stage, so the k-th all-reduce of every replica's data-parallel group is the same bucket
// (collectives match by call order). A bucket is launched by its last layer's LayerReady, or by
// the stage's REDUCE_GRADS when a schedule finishes its weights some other way.
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/ops.h"
#include "runtime/grad_sync/grad_sync.h"

namespace pipewright::internal {
namespace {

struct Bucket {
  std::vector<Parameter*> params;
  int layers = 0;   // layers with parameters in this bucket
  int pending = 0;  // of which the step has not finished yet
  int64_t numel = 0;
  Tensor flat;
  std::unique_ptr<Work> work;
};

struct StageBuckets {
  int index = 0;                  // virtual stage
  std::vector<int> layer_bucket;  // per layer: bucket index, or -1 without parameters
  std::vector<Bucket> buckets;
};

class BucketedAllReduce final : public GradSync {
 public:
  BucketedAllReduce(const GradSyncContext& ctx, std::vector<GradSyncStage> stages,
                    int64_t bucket_bytes)
      : ctx_(ctx) {
    for (GradSyncStage& s : stages) {
      StageBuckets sb;
      sb.index = s.index;
      sb.layer_bucket.assign(s.layers.size(), -1);
      int64_t bytes = 0;
      for (size_t i = s.layers.size(); i-- > 0;) {
        if (s.layers[i].empty()) continue;
        if (sb.buckets.empty() || bytes >= bucket_bytes) {
          sb.buckets.emplace_back();
          bytes = 0;
        }
        Bucket& b = sb.buckets.back();
        for (Parameter* p : s.layers[i]) {
          b.params.push_back(p);
          b.numel += p->grad.numel();
          bytes += static_cast<int64_t>(p->grad.nbytes());
        }
        ++b.layers;
        sb.layer_bucket[i] = static_cast<int>(sb.buckets.size()) - 1;
      }
      stages_.push_back(std::move(sb));
    }
  }

  void BeginStep() override {
    for (StageBuckets& s : stages_) {
      for (Bucket& b : s.buckets) {
        b.pending = b.layers;
        b.work.reset();
        b.flat = Tensor();
      }
    }
  }

  absl::Status LayerReady(int stage, int layer) override {
    if (ctx_.dp == nullptr) return absl::OkStatus();
    const int b = stages_[stage].layer_bucket[layer];
    if (b < 0) return absl::OkStatus();
    Bucket& bucket = stages_[stage].buckets[b];
    if (--bucket.pending == 0) return Launch(bucket);
    return absl::OkStatus();
  }

  absl::Status StageReady(int stage) override {
    if (ctx_.dp == nullptr) return absl::OkStatus();
    for (Bucket& b : stages_[stage].buckets) {
      if (b.work == nullptr) PW_RETURN_IF_ERROR(Launch(b));
    }
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    const ops::Exec e{ctx_.alloc};
    for (StageBuckets& s : stages_) {
      for (Bucket& b : s.buckets) {
        if (b.work == nullptr) continue;
        PW_RETURN_IF_ERROR(ctx_.wait(
            *b.work, absl::StrCat("gradient all-reduce of stage ", s.index, " across replicas")));
        int64_t offset = 0;
        for (Parameter* p : b.params) {
          PW_RETURN_IF_ERROR(ops::CopyRange(e, b.flat, offset, p->grad, 0, p->grad.numel()));
          offset += p->grad.numel();
        }
        b.flat = Tensor();
        b.work.reset();
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Launch(Bucket& b) {
    const ops::Exec e{ctx_.alloc};
    b.flat = Tensor::Empty({b.numel}, DType::kF32, ctx_.alloc);
    int64_t offset = 0;
    for (Parameter* p : b.params) {
      PW_RETURN_IF_ERROR(ops::CopyRange(e, p->grad, 0, b.flat, offset, p->grad.numel()));
      offset += p->grad.numel();
    }
    // A stream-ordered backend (NCCL) orders the all-reduce after the copies on the GPU; any
    // other may read the buffer from another thread at once, so the copies must be done.
    if (!ctx_.dp->capabilities().stream_ordered) PW_RETURN_IF_ERROR(ctx_.sync_device());
    b.work = ctx_.dp->AllReduce(b.flat);
    return absl::OkStatus();
  }

  GradSyncContext ctx_;
  std::vector<StageBuckets> stages_;
};

}  // namespace

std::unique_ptr<GradSync> CreateBucketedAllReduce(const GradSyncContext& ctx,
                                                  std::vector<GradSyncStage> stages,
                                                  int64_t bucket_bytes) {
  return std::make_unique<BucketedAllReduce>(ctx, std::move(stages), bucket_bytes);
}

}  // namespace pipewright::internal
