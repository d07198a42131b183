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
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "pipewright/checkpoint.h"
#include "pipewright/comm.h"
#include "pipewright/layer.h"
#include "pipewright/train.h"
#include "runtime/grad_sync/bucket_watch.h"

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
  // (optional) Told of every collective posted for a bucket (PostBucket), so the rank can show
  // when each ran (Note [Bucket spans] in bucket_watch.h); null: no one watches.
  BucketWatch* buckets = nullptr;
};

// One of the rank's stages: its virtual stage index and, per layer, the layer's parameters
// (empty for a layer without any).
struct GradSyncStage {
  int index = 0;
  std::vector<std::vector<Parameter*>> layers;
  // (optional) Per layer: Layer::ParameterGroups(), the groups its backward completes one by one
  // (Note [Gradient groups] in pipewright/layer.h); missing: each layer is one group.
  std::vector<std::vector<std::vector<Parameter*>>> groups;
};

// Gradient and parameter bytes this rank sends to its data-parallel group in a step, and what an
// uncompressed fp32 all-reduce of the same gradients would have sent. Counted in wire terms, as
// the ring algorithms move them (RingAllReduceBytes and the rest below: what NCCL's rings and
// Open MPI's large-message algorithms send per rank), so that a reduce-scatter plus an all-gather
// compares fairly with the all-reduce it replaces.
struct GradSyncBytes {
  int64_t sent = 0;
  int64_t uncompressed = 0;
};

// A stage's layers grouped into buckets of about `bucket_bytes` of gradients, last layer first
// (Note [Bucket order] in bucketed_all_reduce.cc): every replica builds the same buckets, so the
// k-th collective of each replica's group is the same bucket's. A mode that launches work per
// bucket as the backward finishes it uses this grouping.
struct StageBuckets {
  std::vector<int> layer_bucket;                // per layer: its bucket, -1 without parameters
  std::vector<std::vector<Parameter*>> params;  // per bucket: its parameters, in bucket order
  std::vector<int> layers;                      // per bucket: its layers with parameters
};
StageBuckets BucketLayers(const GradSyncStage& stage, int64_t bucket_bytes);

// Bytes one rank of an n-rank ring sends: an all-reduce of `bytes` sends 2 (n - 1) / n of them, a
// reduce-scatter of `bytes` (its input) (n - 1) / n, and an all-gather in which every rank
// contributes `bytes` (n - 1) times them. Zero when n <= 1.
int64_t RingAllReduceBytes(int64_t bytes, int n);
int64_t RingReduceScatterBytes(int64_t bytes, int n);
int64_t RingAllGatherBytes(int64_t bytes, int n);

class GradSync {
 public:
  virtual ~GradSync() = default;
  virtual void BeginStep() = 0;
  virtual absl::Status LayerReady(int stage, int layer) = 0;
  virtual absl::Status StageReady(int stage) = 0;
  virtual absl::Status Finish() = 0;
  // The step's bytes (all zero with dp = 1); valid after Finish.
  virtual GradSyncBytes StepBytes() const = 0;
  // The state this replica carries from step to step (error-feedback buffers, PowerSGD's Q), as
  // host copies named "<what>.<parameter>", between steps; empty for a mode without any. State
  // not made yet (no step has run) is saved as it would start.
  virtual absl::StatusOr<NamedTensors> SaveState() = 0;
  // Restores what SaveState wrote, each name looked up as `prefix` + name in `state`; checks
  // every tensor (present, f32, its shape) before changing anything, and names what is wrong.
  virtual absl::Status LoadState(const std::map<std::string, Tensor>& state,
                                 const std::string& prefix) = 0;
};

// The launch points both bucketed modes share (Note [Bucket order]): each bucket of each stage
// (BucketLayers) is launched once per step, by its last layer's LayerReady or, if that has not
// happened, by its stage's StageReady. With no data-parallel group nothing is launched. A mode
// implements ResetStep (forget the last step's work) and LaunchBucket.
class BucketLauncher : public GradSync {
 public:
  void BeginStep() final;
  absl::Status LayerReady(int stage, int layer) final;
  absl::Status StageReady(int stage) final;

 protected:
  BucketLauncher(Communicator* dp, const std::vector<GradSyncStage>& stages, int64_t bucket_bytes);
  // Per stage slot: its grouping (params per bucket, in bucket order).
  const std::vector<StageBuckets>& groupings() const { return groupings_; }
  bool launched(int stage, int bucket) const { return launched_[stage][bucket] != 0; }
  virtual void ResetStep() = 0;
  virtual absl::Status LaunchBucket(int stage, int bucket) = 0;

 private:
  absl::Status Launch(int stage, int bucket);

  Communicator* dp_;
  std::vector<StageBuckets> groupings_;
  std::vector<std::vector<int>> pending_;  // per stage, per bucket: layers not ready yet
  std::vector<std::vector<char>> launched_;
};

// For SaveState / LoadState: copies of `params`' slices of a flat fp32 tensor as host tensors
// named `what` + "." + parameter name (in `params` order, from offset 0), and back. LoadFlat
// checks every tensor before it copies any.
absl::Status SaveFlat(const Tensor& flat, const std::vector<Parameter*>& params,
                      const std::string& what, NamedTensors* out);
absl::Status LoadFlat(const std::map<std::string, Tensor>& state, const std::string& prefix,
                      const std::string& what, const std::vector<Parameter*>& params,
                      Allocator* alloc, Tensor* flat);
// Looks up `prefix` + `name` in `state`: NotFound or InvalidArgument naming it unless present as
// an f32 tensor of `shape`.
absl::StatusOr<const Tensor*> FindState(const std::map<std::string, Tensor>& state,
                                        const std::string& prefix, const std::string& name,
                                        const std::vector<int64_t>& shape);

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

// PowerSGD (Note [PowerSGD] in powersgd.cc): each bucket's 2-D gradients go out as rank-R
// factors P = M Q and Q = M^T orth(P) (M: the gradient plus this replica's error feedback), each
// all-gathered and summed in replica order, so every replica applies the same orth(P) Q^T; the
// bucket's other gradients are all-reduced in fp32. The first round starts when the bucket's
// last layer is ready; the second runs in Finish. Q is warm-started from the last step.
// PowerSGD's orthogonalisation (exposed for tests): the r columns of the rows x r row-major `p`
// made orthonormal in place by Gram-Schmidt with double-precision dot products; a column that is
// zero or dependent on the earlier ones becomes zero.
void OrthonormalizeColumns(float* p, int64_t rows, int r);

std::unique_ptr<GradSync> CreatePowerSgd(const GradSyncContext& ctx,
                                         std::vector<GradSyncStage> stages, int64_t bucket_bytes,
                                         int rank);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_GRAD_SYNC_GRAD_SYNC_H_
