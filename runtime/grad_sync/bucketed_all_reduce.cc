// The bucketed gradient all-reduce (grad_sync.h).
//
// Note [Bucket order]. Buckets are closed in backward order (a stage's last layer first) once
// they reach the bucket size, so the first bucket to complete is the first to be all-reduced
// while the backward of earlier layers still runs. Each replica builds the same buckets from the
// same stage, so the k-th all-reduce of every replica's data-parallel group is the same bucket
// (collectives match by call order). A bucket is launched by its last layer's LayerReady, or by
// the stage's REDUCE_GRADS when a schedule finishes its weights some other way.
//
// Note [Bucket codecs]. Gradient compression (TrainOptions.grad_compression) changes what a
// bucket puts on the wire, not when: the buckets, their order and their launch points stay the
// ones above, so a compressed bucket overlaps the backward exactly as an fp32 one does. It is
// therefore a codec of this one mechanism (EncodeAndLaunch / DecodeSum below) rather than a second
// GradSync.
//  - none: the fp32 bucket is summed in place by AllReduce.
//  - bf16: the replica adds its error buffer (the rounding error it kept from its last step) to
//    the bucket, rounds the result to bf16 (nearest even) and keeps the new rounding error,
//    which is exact in fp32 (error feedback: nothing the replica computed is ever dropped, only
//    delayed by a step). The bf16 buckets are all-gathered, not all-reduced: a reduction in
//    bf16 would round every partial sum, while the gathered raw 16-bit values are converted and
//    summed in fp32 in replica order ((x0 + x1) + x2 ...) on every receiver. The bytes each
//    replica contributes halve, every replica computes bit-identical sums from identical
//    inputs on any backend (an all-gather moves bytes, never rounds them), and the sum is
//    deterministic run to run.
// A per-tensor low-rank scheme (PowerSGD) does not fit this codec (two dependent rounds per
// matrix, state per tensor): it is a GradSync of its own on the same buckets (powersgd.cc).
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/ops.h"
#include "runtime/grad_sync/grad_sync.h"

namespace pipewright::internal {
namespace {

struct Bucket {
  std::vector<Parameter*> params;
  int64_t numel = 0;
  Tensor flat;      // none: the bucket summed in place; bf16: this replica's bf16 values
  Tensor gathered;  // bf16: every replica's bf16 values, in replica order
  Tensor error;     // bf16: the rounding error carried into the next step (fp32, persistent)
  std::unique_ptr<Work> work;
};

struct Stage {
  int index = 0;  // virtual stage
  std::vector<Bucket> buckets;
};

class BucketedAllReduce final : public BucketLauncher {
 public:
  BucketedAllReduce(const GradSyncContext& ctx, std::vector<GradSyncStage> stages,
                    int64_t bucket_bytes, GradCompression compression)
      : BucketLauncher(ctx.dp, stages, bucket_bytes), ctx_(ctx), compression_(compression) {
    for (size_t s = 0; s < stages.size(); ++s) {
      Stage& st = stages_.emplace_back();
      st.index = stages[s].index;
      for (const std::vector<Parameter*>& params : groupings()[s].params) {
        Bucket& bucket = st.buckets.emplace_back();
        bucket.params = params;
        for (Parameter* p : bucket.params) bucket.numel += p->grad.numel();
      }
    }
  }

  absl::Status Finish() override {
    const ops::Exec e{ctx_.alloc};
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) {
        if (b.work == nullptr) continue;
        PW_RETURN_IF_ERROR(ctx_.wait(
            *b.work, absl::StrCat("gradient all-reduce of stage ", s.index, " across replicas")));
        PW_ASSIGN_OR_RETURN(Tensor sum, DecodeSum(b));
        int64_t offset = 0;
        for (Parameter* p : b.params) {
          PW_RETURN_IF_ERROR(ops::CopyRange(e, sum, offset, p->grad, 0, p->grad.numel()));
          offset += p->grad.numel();
        }
        b.flat = Tensor();
        b.gathered = Tensor();
        b.work.reset();
      }
    }
    return absl::OkStatus();
  }

  GradSyncBytes StepBytes() const override { return bytes_; }

  // bf16: each bucket's error buffer, per parameter ("error.<param>"); none: nothing.
  absl::StatusOr<NamedTensors> SaveState() override {
    NamedTensors out;
    if (compression_.kind != GradCompression::Kind::kBf16) return out;
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) PW_RETURN_IF_ERROR(SaveFlat(b.error, b.params, "error", &out));
    }
    return out;
  }

  absl::Status LoadState(const std::map<std::string, Tensor>& state,
                         const std::string& prefix) override {
    if (compression_.kind != GradCompression::Kind::kBf16) return absl::OkStatus();
    std::vector<Tensor> errors;  // every bucket's, checked before any is replaced
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) {
        PW_RETURN_IF_ERROR(
            LoadFlat(state, prefix, "error", b.params, ctx_.alloc, &errors.emplace_back()));
      }
    }
    size_t i = 0;
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) b.error = std::move(errors[i++]);
    }
    return absl::OkStatus();
  }

 private:
  void ResetStep() override {
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) {
        b.work.reset();
        b.flat = Tensor();
        b.gathered = Tensor();
      }
    }
    bytes_ = GradSyncBytes{};
  }

  absl::Status LaunchBucket(int stage, int bucket) override {
    Bucket& b = stages_[stage].buckets[bucket];
    const ops::Exec e{ctx_.alloc};
    b.flat = Tensor::Empty({b.numel}, DType::kF32, ctx_.alloc);
    int64_t offset = 0;
    for (Parameter* p : b.params) {
      PW_RETURN_IF_ERROR(ops::CopyRange(e, p->grad, 0, b.flat, offset, p->grad.numel()));
      offset += p->grad.numel();
    }
    return EncodeAndLaunch(stages_[stage].index, bucket, b);
  }

  // Posts the collective of `b` (bucket `bucket` of virtual stage `stage`), `b.flat` holding this
  // replica's fp32 gradients.
  absl::Status EncodeAndLaunch(int stage, int bucket, Bucket& b) {
    const ops::Exec e{ctx_.alloc};
    const int n = ctx_.dp->size();
    const int64_t fp32 = b.numel * static_cast<int64_t>(sizeof(float));
    bytes_.uncompressed += RingAllReduceBytes(fp32, n);
    if (compression_.kind == GradCompression::Kind::kBf16) {
      if (b.error.numel() == 0) b.error = Tensor::Zeros({b.numel}, DType::kF32, ctx_.alloc);
      PW_RETURN_IF_ERROR(ops::AddInPlace(e, b.flat, b.error));
      PW_ASSIGN_OR_RETURN(Tensor q, ops::Cast(e, b.flat, DType::kBF16));
      PW_ASSIGN_OR_RETURN(Tensor back, ops::Cast(e, q, DType::kF32));
      PW_RETURN_IF_ERROR(ops::Scale(e, back, -1.0f));
      PW_RETURN_IF_ERROR(ops::AddInPlace(e, b.flat, back));  // flat - bf16(flat), exact
      b.error = std::move(b.flat);
      b.flat = std::move(q);
      b.gathered = Tensor::Empty({ctx_.dp->size() * b.numel}, DType::kBF16, ctx_.alloc);
      bytes_.sent += RingAllGatherBytes(b.numel * 2, n);
    } else {
      bytes_.sent += RingAllReduceBytes(fp32, n);
    }
    // A stream-ordered backend (NCCL) orders the collective after the copies on the GPU; any
    // other may read the buffer from another thread at once, so the copies must be done.
    if (!ctx_.dp->capabilities().stream_ordered) PW_RETURN_IF_ERROR(ctx_.sync_device());
    if (compression_.kind == GradCompression::Kind::kBf16) {
      b.work = PostBucket(ctx_.buckets, stage, bucket, BucketCollective::kAllGather,
                          [&] { return ctx_.dp->AllGather(b.flat, b.gathered); });
    } else {
      b.work = PostBucket(ctx_.buckets, stage, bucket, BucketCollective::kAllReduce,
                          [&] { return ctx_.dp->AllReduce(b.flat); });
    }
    return absl::OkStatus();
  }

  // The bucket's fp32 sum over the replicas, once its collective has completed.
  absl::StatusOr<Tensor> DecodeSum(Bucket& b) {
    if (compression_.kind == GradCompression::Kind::kNone) return b.flat;
    const ops::Exec e{ctx_.alloc};
    PW_ASSIGN_OR_RETURN(Tensor all, ops::Cast(e, b.gathered, DType::kF32));
    Tensor sum = Tensor::Empty({b.numel}, DType::kF32, ctx_.alloc);
    PW_RETURN_IF_ERROR(ops::CopyRange(e, all, 0, sum, 0, b.numel));
    Tensor part = Tensor::Empty({b.numel}, DType::kF32, ctx_.alloc);
    for (int r = 1; r < ctx_.dp->size(); ++r) {
      PW_RETURN_IF_ERROR(ops::CopyRange(e, all, r * b.numel, part, 0, b.numel));
      PW_RETURN_IF_ERROR(ops::AddInPlace(e, sum, part));
    }
    return sum;
  }

  GradSyncContext ctx_;
  GradCompression compression_;
  std::vector<Stage> stages_;
  GradSyncBytes bytes_;
};

}  // namespace

std::unique_ptr<GradSync> CreateBucketedAllReduce(const GradSyncContext& ctx,
                                                  std::vector<GradSyncStage> stages,
                                                  int64_t bucket_bytes,
                                                  GradCompression compression) {
  return std::make_unique<BucketedAllReduce>(ctx, std::move(stages), bucket_bytes, compression);
}

}  // namespace pipewright::internal
