// The data-parallel strategy of a rank (internal): everything data-parallel about its stages —
// the gradient reduction across replicas (per bucket, overlapped with the backward), where the
// optimizer state lives, the optimizer step and the parameter synchronisation after it, the
// rank's share of the gradient norm, checkpoint state and the bytes it sent. The rank executor
// interprets its program and calls this interface; it names no data-parallel mode
// (docs/architecture.md, "Data parallelism").
//
// Contract, per step (every call on the rank's own thread):
//   BeginStep()                   forget the last step's work
//   BeginBackward(stage, last)    a B or W action of `stage` is about to add weight gradients;
//                                 `last`: of the step's last micro-batch (final for the step)
//   (observer(stage)->GradientsDone(params), from inside the layers' backward: those gradients
//    of this micro-batch are complete; Note [Gradient groups] in pipewright/layer.h)
//   GradReady(stage, layer, last) layer's weight gradient of one micro-batch is added
//   StageReady(stage)             REDUCE_GRADS: every gradient of the stage is final
//   Finish()                      every reduction is complete: each replicated gradient holds the
//                                 sum over the replicas, each shard its own elements' sum
//   (the executor's tie reduction, then the step agreement with AddSquaredNorm)
//   Step(lr, grad_scale)          the update
//   SyncParameters()              every replica's parameters equal again (a sharded update's
//                                 all-gather; nothing for a replicated one)
// `stage` is the stage's slot among the rank's own, `layer` the layer's index in the stage.
//
// Implementations: Replicated (zero = 0: a GradSync — bucketed all-reduce, bf16 or PowerSGD —
// and the whole optimizer), Sharded (zero = 1 and 2: flat buffers, Note [Flat shards] in
// sharded.cc) and Async (dp_mode = async: the owners apply pushed gradients, Note [Async DP] in
// async_dp.cc).
#ifndef PIPEWRIGHT_RUNTIME_DATA_PARALLEL_DATA_PARALLEL_H_
#define PIPEWRIGHT_RUNTIME_DATA_PARALLEL_DATA_PARALLEL_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/checkpoint.h"
#include "pipewright/comm.h"
#include "pipewright/optimizer.h"
#include "pipewright/train.h"
#include "runtime/data_parallel/async_dp.h"
#include "runtime/data_parallel/exact_sum.h"
#include "runtime/grad_sync/grad_sync.h"

namespace pipewright::internal {

// What a strategy needs from its rank.
struct DataParallelContext {
  Communicator* dp = nullptr;  // the stage's data-parallel group (rank = replica); null at dp = 1
  int replica = 0;
  int replicas = 1;
  // The rank's tensor-parallel rank: a whole (replicated) tensor's gradient is the same on every
  // one, so only rank 0 counts it in the gradient norm (CountsInNorm).
  int tensor_rank = 0;
  Allocator* alloc = nullptr;  // the rank's device allocator
  // Waits for `w` with the run's timeout (GradSyncContext::wait).
  std::function<absl::Status(Work& w, const std::string& what)> wait;
  std::function<absl::Status()> sync_device;  // completes the rank's queued device work
  BucketWatch* buckets = nullptr;  // (optional) GradSyncContext::buckets: every bucket collective
  OptimizerConfig optimizer;
  int64_t bucket_bytes = int64_t{1} << 20;
  int zero_buffers = 2;  // ZeRO-2: TrainOptions.zero_buffers
};

// The rank's parameters as the strategy sees them.
struct DataParallelParams {
  // Per stage slot: its virtual stage and each layer's parameters (tied copies included: their
  // gradients are reduced like any other).
  std::vector<GradSyncStage> stages;
  // What the optimizer updates: the stages' parameters less tied copies linked to an owner on
  // this rank (RankExecutor::params).
  std::vector<Parameter*> trained;
  // Parameters at either end of a tie (owners and copies): their summed gradients must be whole
  // on the rank for the tie reduction, so a sharded strategy keeps them replicated.
  std::set<const Parameter*> tied;
};

// Whether `p`'s gradient is this rank's to count in the gradient norm: not a tied copy (its owner
// holds the tie's sum), and a part of a tensor-parallel tensor or a whole tensor on
// tensor-parallel rank 0 (the others hold the same whole gradient).
inline bool CountsInNorm(const Parameter& p, int tensor_rank) {
  return p.tied_to.empty() && (p.shard.sharded() || tensor_rank == 0);
}

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  virtual void BeginStep() = 0;
  virtual absl::Status BeginBackward(int stage, bool last) = 0;
  // What the layers of `stage` tell as their gradient groups complete (LayerContext::gradients),
  // or null for a strategy that acts per layer only.
  virtual GradientObserver* observer(int /*stage*/) { return nullptr; }
  virtual absl::Status GradReady(int stage, int layer, bool last) = 0;
  virtual absl::Status StageReady(int stage) = 0;
  virtual absl::Status Finish() = 0;
  // Adds this rank's share of the squared gradient norm (Note [Exact norm] in exact_sum.cc):
  // over the world every chunk of every gradient is added by exactly one rank, tied copies by
  // none (their owner holds the tie's sum).
  virtual absl::Status AddSquaredNorm(ExactSum* sum) = 0;
  virtual absl::Status Step(float lr, float grad_scale) = 0;
  virtual absl::Status SyncParameters() = 0;
  virtual bool syncs_parameters() const = 0;  // whether SyncParameters communicates
  // The step's bytes to the data-parallel group (wire terms; zero at dp = 1), after Step.
  virtual GradSyncBytes StepBytes() const = 0;
  // Bytes of optimizer state and of gradient buffers this rank holds between steps.
  virtual int64_t OptimizerStateBytes() const = 0;
  virtual int64_t GradientBytes() const = 0;
  virtual int64_t optimizer_steps() const = 0;

  // Checkpoints. OptimizerState is collective over the data-parallel group (every replica of the
  // stage calls it): it returns, on replica 0, the whole optimizer state of the rank's trained
  // parameters as host tensors named as Optimizer::State names them, and nothing on the others.
  // LoadOptimizerState takes such tensors (every name present, whatever layout wrote them).
  virtual absl::StatusOr<NamedTensors> OptimizerState() = 0;
  virtual absl::Status LoadOptimizerState(const std::map<std::string, Tensor>& state,
                                          int64_t step) = 0;
  // The replica's gradient-compression state (GradSync::SaveState / LoadState).
  virtual absl::StatusOr<NamedTensors> SyncState() = 0;
  virtual absl::Status LoadSyncState(const std::map<std::string, Tensor>& state,
                                     const std::string& prefix) = 0;

  // How many replicas one step's gradient is the mean over (the backward's seed divides by it
  // and the micro-batch count): every replica's, or (asynchronous) the replica's own.
  virtual int gradient_replicas() const = 0;
  // Whether every replica takes each step together: the step agreement then spans the world;
  // otherwise only the replica's own pipeline.
  virtual bool replicas_step_together() const { return true; }
  // The asynchronous strategy's run-level protocol (the replica-step loop's), or nullptr.
  virtual class AsyncDataParallel* async() { return nullptr; }
};

// Asynchronous DP, as the engine's replica-step loop (RankExecutor::RunAsync) drives it.
class AsyncDataParallel : public DataParallel {
 public:
  // Before a run of replica steps: every parameter's owner, and this replica's shard, started
  // from the optimizer's state.
  virtual absl::Status StartRun() = 0;
  virtual AsyncShard* shard() = 0;
  // Every parameter's current value from its owner (before each replica step).
  virtual absl::Status Pull() = 0;
  // A request header (kAsyncHeaderLen values) to replica `o`; FinishSends waits for every send.
  virtual absl::Status SendHeader(const std::vector<double>& v, int o, int64_t tag) = 0;
  virtual absl::Status FinishSends() = 0;
  // After the run: the owners' values and optimizer state to every replica.
  virtual absl::Status Consolidate() = 0;
  // Updates this replica's shard applied, per replica.
  virtual std::vector<int64_t> Applied() const = 0;
};

// zero = 0: `sync` reduces the gradients (its context's group null: nothing is reduced), and one
// optimizer updates every trained parameter on every replica.
std::unique_ptr<DataParallel> CreateReplicated(const DataParallelContext& ctx,
                                               DataParallelParams params,
                                               std::unique_ptr<GradSync> sync);

// dp_mode = async (Note [Async DP] in async_dp.cc). Needs ctx.dp.
std::unique_ptr<DataParallel> CreateAsync(const DataParallelContext& ctx,
                                          DataParallelParams params);

// zero = 1 or 2 (Note [Flat shards] in sharded.cc). Needs ctx.dp.
absl::StatusOr<std::unique_ptr<DataParallel>> CreateSharded(const DataParallelContext& ctx,
                                                            DataParallelParams params, int zero);

// Helpers the strategies share. Appends host copies of `optimizer`'s state tensors to `out`.
absl::Status AppendHostState(const Optimizer& optimizer, NamedTensors* out);
// Adds the chunk squares of every gradient of `stages` that CountsInNorm(p, tensor_rank) to
// `sum`: a rank's whole share of the norm when it holds whole gradients.
absl::Status AddWholeSquaredNorm(const std::vector<GradSyncStage>& stages, Allocator* exec,
                                 int tensor_rank, ExactSum* sum);

// The part of a strategy that keeps the whole optimizer on every replica (Replicated; Async
// between runs, after Consolidate): one Optimizer over params.trained, its size and step count,
// and the checkpoint state, which replica 0 writes and every replica loads whole.
template <typename Base>
class WholeOptimizer : public Base {
 public:
  int64_t OptimizerStateBytes() const override { return optimizer_->StateBytes(); }
  int64_t optimizer_steps() const override { return optimizer_->step_count(); }
  absl::StatusOr<NamedTensors> OptimizerState() override {
    NamedTensors out;
    if (ctx_.replica == 0) PW_RETURN_IF_ERROR(AppendHostState(*optimizer_, &out));
    return out;
  }
  absl::Status LoadOptimizerState(const std::map<std::string, Tensor>& state,
                                  int64_t step) override {
    return optimizer_->LoadState(state, step);
  }

 protected:
  WholeOptimizer(const DataParallelContext& ctx, DataParallelParams params)
      : ctx_(ctx),
        params_(std::move(params)),
        optimizer_(Optimizer::Create(ctx_.optimizer, params_.trained, ctx_.alloc)) {}

  DataParallelContext ctx_;
  DataParallelParams params_;
  std::unique_ptr<Optimizer> optimizer_;
};

// Note [Flat shards]: where a bucket's tensors go in its flat buffer of replicas x shard
// elements, so that every replica's shard [r shard, (r + 1) shard) cuts a tensor only on a
// kNormChunk boundary of it. `offsets[i]` is tensor i's first element; the gaps are padding.
struct FlatLayout {
  std::vector<int64_t> offsets;
  int64_t shard = 0;
  int64_t numel() const { return shard * replicas; }
  int replicas = 1;
};
FlatLayout LayOutFlat(const std::vector<int64_t>& sizes, int replicas);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_DATA_PARALLEL_DATA_PARALLEL_H_
