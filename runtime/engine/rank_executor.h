// One rank of the engine (internal): the interpreter of the rank's program. It owns the rank's
// allocator, stages, optimizer, gradient synchronization, data loader and communicators, and
// records what every interval of its step was spent on.
//
// Note [Who touches a rank]. A rank is driven by one thread at a time: the engine runs each
// step (and set-up work such as Split) on one thread per rank and joins them, so nothing here is
// locked. The communicators are the only way ranks reach each other.
#ifndef PIPEWRIGHT_RUNTIME_ENGINE_RANK_EXECUTOR_H_
#define PIPEWRIGHT_RUNTIME_ENGINE_RANK_EXECUTOR_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/parallel.h"
#include "pipewright/checkpoint.h"
#include "pipewright/comm.h"
#include "pipewright/data.h"
#include "pipewright/engine.h"
#include "pipewright/launch.h"
#include "pipewright/ops.h"
#include "pipewright/optimizer.h"
#include "pipewright/tensor_parallel.h"
#include "pipewright/train_testing.h"
#include "runtime/data_parallel/async_dp.h"
#include "runtime/data_parallel/data_parallel.h"
#include "runtime/engine/flight_recorder.h"
#include "runtime/engine/process_groups.h"
#include "runtime/engine/tied_weights.h"
#include "runtime/grad_sync/grad_sync.h"
#include "runtime/train_state.h"

namespace pipewright::internal {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// One virtual stage on a rank, and its per-micro-batch state during a step.
struct StageRt {
  int index = 0;  // virtual stage
  int begin = 0, end = 0;
  bool first = false, last = false;
  // kFull: keep only the stage input and recompute the forward before the backward; kSelective:
  // layers keep what the products need (LayerContext::selective_recompute).
  Recompute recompute = Recompute::kNone;
  std::unique_ptr<Stage> stage;
  std::vector<int64_t> in_shape, out_shape;
  DType in_dtype = DType::kF32;
  int last_backward = -1;  // program index of the action finishing the weight grads
  // Per micro-batch state of the step.
  std::vector<std::vector<Saved>> saved;
  std::vector<Tensor> input, output, grad_out, grad_in;
  // Measured seconds and counts, summed over steps.
  double f_s = 0, b_s = 0, w_s = 0, rc_s = 0;
  int64_t f_n = 0, b_n = 0, w_n = 0;
};

// What the step agreement decided, identical on every rank.
struct StepOutcome {
  double loss = 0, grad_norm = 0;
  float loss_scale = 1.0f;
  bool skipped = false;
  bool stop_requested = false;  // some rank's process had StopRequested() (train.h)
};

// Read-only state shared by every rank of one engine.
struct RunContext {
  const LayerGraph* graph = nullptr;
  const RunSpec* run = nullptr;
  const TrainOptions* options = nullptr;
  const TrainTestingHooks* testing = nullptr;
  // The parallel sizes: the only copy in the engine (pp and the micro-batch count are the
  // RunSpec's schedule's, dp its data_parallel, tp its tensor_parallel). Everything else derives
  // from it.
  Topology topo;
  // The batch's shape: micro-batches and replicas from `run` and `topo`, sequences from the graph.
  BatchLayout layout() const {
    return {run->micro_batches(), graph->shape().batch, graph->shape().seq_len, topo.dp};
  }
  absl::Duration timeout;
  Clock::time_point epoch;  // time zero of every recorded event
};

// One rank: made by Create and Connect (rank_setup.cc), then driven by the engine through the
// methods below; everything it holds is its own (Note [Who touches a rank]).
class RankExecutor {
 public:
  // One rank of this process (`slot`: its index among them): its device, its stages (only their
  // layers, initialised on the host from the seed and their global names, then moved to the
  // device), its tied links and loss scaler. `shape_at`: the activation shape at every layer
  // boundary of one micro-batch.
  static absl::StatusOr<std::unique_ptr<RankExecutor>> Create(
      const RunContext* ctx, std::shared_ptr<const Dataset> data, RankEndpoint endpoint, int slot,
      int threads, const std::vector<std::vector<int64_t>>& shape_at);
  // Collective over the world, one thread per rank (Note [Process groups]): splits the rank's
  // groups off the world, links its ends of the ties across ranks and creates its data-parallel
  // strategy (and with it the optimizer) over them.
  absl::Status Connect(const GroupNeeds& needs, const std::vector<CrossRankTie>& ties);

  int global() const { return global_; }
  int pipe() const { return pipe_; }
  int replica() const { return replica_; }
  int tensor() const { return tensor_; }  // tensor-parallel rank
  int slot() const { return slot_; }
  std::string Who() const;
  double Now() const;  // seconds since the engine's epoch
  // The threads of the rank's CPU kernels (its own included): current on the thread that drives
  // the rank (Engine::Impl::OnEveryRank), never shared with another rank.
  cpu::ThreadPool* pool() const { return pool_.get(); }
  Communicator* world() const { return groups_.world(); }
  // Makes this rank's GPU current on the calling thread (CUDA state is per thread).
  absl::Status BindDevice() const;

  // One step of the rank's program (rank_step.cc).
  absl::Status RunStep(int64_t step, float lr, StepOutcome* out);
  // The last step's times, and the totals over the steps so far with per-stage mean times.
  RankTimes StepTimes() const;
  RankTimes Totals() const;
  const std::vector<RankEvent>& events() const { return events_; }
  const FlightRecorder& flight() const { return flight_; }

  // Asynchronous data parallelism (rank_async.cc, Note [Async DP] in async_dp.cc): replica
  // steps for tickets [first_ticket, end_ticket) as the coordinator grants them, then the
  // consolidation; `end` receives the ticket the run really ended at (every rank learns it).
  struct AsyncRun {
    LrSchedule lr;
    int64_t first_ticket = 0, end_ticket = 0;
    AsyncCoordinator* coord = nullptr;  // on global rank 0's process only
  };
  absl::Status RunAsync(const AsyncRun& run, int64_t* end);
  // What this rank's shard applied, per replica (after RunAsync).
  std::vector<int64_t> AsyncApplied();

  // What this rank trains: its stages' parameters, less tied copies linked to an owner here.
  const std::vector<Parameter*>& params() const { return params_; }
  int64_t memory_bytes() const { return alloc_->current_bytes(); }
  int64_t peak_memory_bytes() const { return alloc_->peak_bytes(); }

  // Checkpoints (rank_setup.cc). Host copies of virtual stage `stage`'s weights (tied copies are
  // stored as their owner), appended to `out`: under tensor parallelism this rank's parts.
  absl::Status AppendWeights(int stage, NamedTensors* out) const;
  // Collective over the rank's tensor-parallel group (every rank of it calls it with the same
  // names in the same order): the parts in `named` (weights, or optimizer state named
  // "<state>.<parameter>") become whole tensors on tensor-parallel rank 0, and `named` empties
  // on the others. Nothing without tensor parallelism.
  absl::Status MergeTensorParallel(NamedTensors* named, const std::string& what);
  // The part of the stored tensor `name` (a parameter's, or "<state>.<parameter>") this rank
  // holds; null for a whole tensor or a name that is not this rank's.
  const TensorShard* ShardOfStored(const std::string& name) const;
  // Where its gradient-compression state goes in a checkpoint: "replica<R>/", and
  // "replica<R>.tp<T>/" under tensor parallelism.
  std::string SyncStatePrefix() const;
  // Collective: the optimizer state this rank contributes (a sharded strategy gathers it to
  // replica 0) and its gradient-compression state under "replica<R>/".
  absl::Status CollectState(NamedTensors* optimizer, NamedTensors* sync);
  int64_t optimizer_steps() const { return dp_->optimizer_steps(); }
  const LossScaler& scaler() const { return scaler_; }
  // Loads a checkpoint that passed CheckManifest (`at`): optimizer and compression state,
  // weights, the loss scaler; the data restarts at the checkpoint's position.
  absl::Status Restore(const Checkpoint& ck, const ResumePoint& at);
  // Every world rank's `mine`, in rank order (two AllGathers: lengths, then the bytes padded to
  // the longest), staged through the device when the backend takes device memory only.
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine,
                                                          const std::string& what);

  // Tear-down, in the engine's order across its ranks (Engine::~Engine): every rank's groups,
  // then every world communicator (a backend may still hold buffers from any rank's allocator),
  // then each rank's device tensors and stream.
  void ReleaseGroups() { groups_.ResetGroups(); }
  void ReleaseWorld() { groups_.ResetWorld(); }
  void ReleaseDevice();

 private:
  RankExecutor() = default;
  const Program& program() const { return ctx_->run->schedule.programs[pipe_]; }
  bool needs_data() const;
  // Global rank of the rank running virtual stage `stage` in this replica.
  int PeerOf(int stage) const;
  StageRt* Local(int stage);
  bool on_cuda() const { return cuda_device_ >= 0; }
  // Waits until the rank's queued device work is done (no-op on the CPU), so that host clocks
  // time it and other threads may read what it wrote.
  absl::Status Sync() const;
  // A host copy of a tensor of this rank (a shared reference when it is already on the host).
  absl::StatusOr<Tensor> ToHost(const Tensor& t) const;
  // Waits for `w` with the run's timeout; returns the world's first error when another rank
  // aborted, else an error naming this rank and `what`.
  absl::Status WaitOrAbort(Work& w, const std::string& what);
  // In-place sum of a host tensor over the world (staged through the device when the backend
  // takes device memory only).
  absl::Status AllReduceHost(Tensor& v, const std::string& what);
  // The data-parallel strategy's view of this rank (rank_executor.cc); a GradSync's is the same
  // with the group, allocator and waits only.
  DataParallelContext DpContext();
  GradSyncContext SyncContext();
  // Set-up (rank_setup.cc): the rank's GPU, a stream and a stream-ordered allocator; virtual
  // stage `s`.
  absl::Status PlaceOnDevice(int cuda_device);
  absl::StatusOr<StageRt> BuildStage(int s, const std::vector<std::vector<int64_t>>& shape_at,
                                     DType input_dtype);

  absl::Status RunAction(const Action& a, int index, int64_t step, float lr, StepOutcome* out);
  absl::Status Forward(StageRt& st, int mb);
  absl::Status Backward(StageRt& st, const Action& a, int index);
  absl::Status WeightBackward(StageRt& st, const Action& a, int index);
  absl::Status Agree(int64_t step, float lr, StepOutcome* out);
  // Asynchronous DP (rank_async.cc).
  absl::Status AsyncLoop(const AsyncRun& run, AsyncDataParallel& a);
  absl::StatusOr<AsyncCoordinator::Grant> ClaimStep(const AsyncRun& run, AsyncDataParallel& a,
                                                    const double* claim);
  void BeginStep(int64_t step);
  void EndStep(Clock::time_point t0, int64_t start_bytes);
  void Record(EventKind kind, const Action& a, Clock::time_point start, int peer = -1,
              int64_t tag = -1);
  // At the step's end: its bucket spans (buckets_) as kBucket events, placed among the step's
  // events by start; no time category changes (Note [Bucket spans] in bucket_watch.h).
  void RecordBuckets();
  // The first stage's inputs and the last stage's targets of micro-batch `mb`, on the rank's
  // device (copied from the loader's host batch once per step on CUDA).
  absl::StatusOr<Tensor> Inputs(int mb);
  absl::StatusOr<const Tensor*> Targets(int mb);
  // The layers' context for micro-batch `mb` of `st`: the rank's allocator, the targets on the
  // last stage, the run's matrix-product dtype.
  absl::StatusOr<LayerContext> ContextFor(const StageRt& st, int mb);

  // Point-to-point (rank_p2p.cc).
  struct PendingRecv {
    Action action;
    StageRt* stage = nullptr;
    int peer = -1;
    int64_t tag = -1;
    Tensor buf;
    std::unique_ptr<Work> work;
  };
  absl::StatusOr<std::pair<StageRt*, int>> P2PEnds(const Action& a);
  absl::Status IssueSend(const Action& a);
  absl::Status PostRecv(const Action& a, PendingRecv* r);
  absl::Status FinishRecv(PendingRecv& r);
  // Note [Receives posted ahead]: waits for the posted receive that fills `st`'s input
  // (forward) or output gradient (backward) of micro-batch `mb`, if one is pending.
  absl::Status AwaitRecv(StageRt& st, int mb, bool forward);
  // Waits for every receive still pending (the end of the step's program).
  absl::Status AwaitAllRecvs();
  // Runs the consecutive sends and receives [begin, end) of the program as one group.
  absl::Status RunP2PGroup(size_t begin, size_t end);
  absl::Status WaitSends();
  // Runs a collective `op(in, out)` on host tensors through the world (device-staged when the
  // backend takes device memory only); `in` and `out` may be the same tensor (in place).
  template <typename Op>
  absl::Status HostCollective(const Tensor& in, Tensor& out, const std::string& what, Op op);

  // Where the rank sits, and the run it belongs to.
  int global_ = 0, pipe_ = 0, replica_ = 0, tensor_ = 0;
  int slot_ = 0;  // index among this process's ranks
  const RunContext* ctx_ = nullptr;
  std::shared_ptr<const Dataset> data_;

  // Device memory and its stream (CUDA) — declared before everything allocated from them.
  int cuda_device_ = -1;  // >= 0 on CUDA
  std::unique_ptr<CudaStream> stream_;
  std::unique_ptr<Allocator> alloc_ = std::make_unique<CpuAllocator>();
  HalfWeightCache half_weights_;  // this step's 16-bit weights (Note [16-bit weights once a step])
  // Host memory for the rank's host-side values on CUDA (batches, scalars, staging).
  std::unique_ptr<CpuAllocator> host_ = std::make_unique<CpuAllocator>();
  // The rank's communicators: its world and the groups split off it (process_groups.h).
  ProcessGroups groups_;
  TensorParallelGroup tp_;  // the layers' view of groups_.tensor_parallel() (LayerContext::tp)
  std::unique_ptr<cpu::ThreadPool> pool_;

  // The model part: the rank's virtual stages, and what it trains.
  std::vector<StageRt> stages_;
  std::vector<int> local_;  // virtual stage -> index in stages_, or -1
  std::vector<Parameter*> params_;
  std::map<std::string, TensorShard> shards_;  // the tensor-parallel parts, by stored name
  TiedWeights ties_;                           // Note [Tied parameters] in runtime/model.cc
  // Everything data-parallel: the gradient reduction, the optimizer and where its state lives,
  // the parameter synchronisation (runtime/data_parallel/data_parallel.h).
  std::unique_ptr<DataParallel> dp_;
  std::unique_ptr<DataLoader> loader_;
  // fp16 dynamic loss scaling; every rank keeps an identical copy, updated from the agreed
  // outcome of each step.
  LossScaler scaler_;
  int64_t static_bytes_ = 0;

  // What the rank's time went to.
  std::vector<RankEvent> events_;
  size_t step_events_ = 0;  // index of the current step's first event in events_
  BucketWatch buckets_;     // the step's bucket collectives, as the strategy posts them
  RankTimes step_times_, total_;
  FlightRecorder flight_;

  StepBatch batch_;
  std::vector<Tensor> dev_inputs_, dev_targets_;  // CUDA copies of batch_, per micro-batch
  std::vector<double> losses_;                    // [micro-batch], last-stage ranks only
  std::vector<std::unique_ptr<Work>> sends_;
  std::vector<PendingRecv> recvs_;  // posted, not yet waited for (Note [Receives posted ahead])
  int64_t step_ = 0;
  int64_t async_done_ = 0;  // asynchronous DP: the replica steps done in the current run
};

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_ENGINE_RANK_EXECUTOR_H_
