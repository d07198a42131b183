// Gradient synchronization across the data-parallel replicas of a stage: one interface that the
// rank executor calls as weight gradients become final and at the step's end, and knows nothing
// else about (DESIGN.md "Gradient synchronization"). Each mode is one implementation in a file
// of its own; today's is the bucketed all-reduce.
//
// Contract, per step:
//   BeginStep()                  forget the last step's work
//   LayerReady(stage, layer)     layer's weight gradient of the step is final (called once per
//                                layer with parameters, in the order the backward finishes them)
//   StageReady(stage)            REDUCE_GRADS: every gradient of the stage is final
//   Finish()                     before the step agreement: every reduction is complete and each
//                                Parameter::grad holds the sum over the replicas
// `stage` is the index of the stage among the rank's own (its slot), `layer` the index of the
// layer within the stage.
#ifndef PIPEWRIGHT_RUNTIME_GRAD_SYNC_GRAD_SYNC_H_
#define PIPEWRIGHT_RUNTIME_GRAD_SYNC_GRAD_SYNC_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "pipewright/comm.h"
#include "pipewright/layer.h"
#include "pipewright/train.h"

namespace pipewright::internal {

// What a synchronization needs from the rank that owns it.
struct GradSyncContext {
  Communicator* dp = nullptr;  // the stage's data-parallel group; null when dp = 1
  Allocator* alloc = nullptr;  // the rank's device allocator (flat buffers are made from it)
  // Waits for `w` with the run's timeout; a failure comes back as the world's first error
  // (another rank's abort) or as one naming this rank and `what`.
  std::function<absl::Status(Work& w, const std::string& what)> wait;
  // Completes the rank's queued device work (a no-op on the CPU).
  std::function<absl::Status()> sync_device;
};

// One of the rank's stages: its virtual stage index and, per layer, the layer's parameters
// (empty for a layer without any).
struct GradSyncStage {
  int index = 0;
  std::vector<std::vector<Parameter*>> layers;
};

// Gradient bytes this rank handed to the data-parallel collectives in a step: what it sent,
// and what an uncompressed fp32 all-reduce of the same gradients would have sent. Counted as
// the payload each rank contributes (its buffer's size), not the transport's wire traffic,
// which depends on the backend's algorithm (a ring all-reduce moves about twice its buffer).
struct GradSyncBytes {
  int64_t sent = 0;
  int64_t uncompressed = 0;
};

class GradSync {
 public:
  virtual ~GradSync() = default;
  virtual void BeginStep() = 0;
  virtual absl::Status LayerReady(int stage, int layer) = 0;
  virtual absl::Status StageReady(int stage) = 0;
  virtual absl::Status Finish() = 0;
  // The step's bytes (all zero with dp = 1); valid after Finish.
  virtual GradSyncBytes StepBytes() const = 0;
};

// Bucketed all-reduce (the default): each stage's parameters are packed, last layer first, into
// buckets of about `bucket_bytes`; a bucket's in-place sum over the replicas starts as soon as
// its last layer is ready, so it overlaps the rest of the backward, and Finish copies the sums
// back. With ctx.dp null every call is a no-op. `compression` picks the buckets' wire format
// (Note [Bucket codecs] in bucketed_all_reduce.cc): kBf16 all-gathers each bucket rounded to
// bf16 and sums it in fp32 in replica order, keeping each replica's rounding error for its
// next step.
std::unique_ptr<GradSync> CreateBucketedAllReduce(const GradSyncContext& ctx,
                                                  std::vector<GradSyncStage> stages,
                                                  int64_t bucket_bytes,
                                                  GradCompression compression);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_GRAD_SYNC_GRAD_SYNC_H_
