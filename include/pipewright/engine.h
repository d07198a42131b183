// The pipeline engine: pp x dp ranks, each a RankExecutor that interprets its program of a
// RunSpec (run_spec.h: a lowered, validated schedule, the stages' layer ranges and
// recomputation) over its stages of the model, with the data a Dataset gives and the ranks a
// World places (launch.h: threads of this process, or one rank per process under a launcher).
// The ranks talk only through the Communicator interface (comm.h).
//
//   PW_ASSIGN_OR_RETURN(Schedule s, GenerateSchedule({ScheduleKind::k1F1B, /*pp=*/4, /*M=*/8}));
//   PW_ASSIGN_OR_RETURN(RunSpec run, RunSpecFromSchedule(graph, std::move(s), /*dp=*/2));
//   PW_ASSIGN_OR_RETURN(World world, Launch(Device::Cpu(), absl::Seconds(60)));
//   TrainOptions o;  o.lr = 3e-3f;  o.steps = 100;
//   auto data = SyntheticDataset(graph.shape().seq_len, o.seed);
//   PW_ASSIGN_OR_RETURN(auto engine, Engine::Create(graph, run, o, std::move(data),
//                                                   std::move(world)));
//   PW_ASSIGN_OR_RETURN(StepReport r, engine->Step());
//
// One step, on every rank: load (first stage) or receive each micro-batch's input, forward,
// loss on the last stage, backward (I and W separately where the schedule splits them),
// weight gradients accumulated across micro-batches in the schedule's order and handed to the
// gradient synchronization as they become final (runtime/grad_sync: bucketed all-reduce across
// replicas, overlapping the rest of the backward), then one agreement all-reduce over the world
// (losses, per-layer squared norms) so that global-norm clipping and the optimizer step happen
// on every rank or on none. With the same global batch the losses and weights are bit-identical
// to pp = 1 for every schedule and recompute setting, and for any number of threads per rank
// (TrainOptions::threads_per_rank: each CPU rank's kernels run on a thread pool of its own;
// docs/runtime.md).
#ifndef PIPEWRIGHT_ENGINE_H_
#define PIPEWRIGHT_ENGINE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/comm.h"
#include "pipewright/data.h"
#include "pipewright/launch.h"
#include "pipewright/model.h"
#include "pipewright/run_spec.h"
#include "pipewright/schedule.h"
#include "pipewright/train.h"

namespace pipewright {

struct TrainTestingHooks;  // train_testing.h

// One recorded interval of a rank's step (times in seconds from the engine's creation).
enum class EventKind {
  kCompute,    // F, B, I, W (action set)
  kRecompute,  // the forward recomputed before a backward
  kSend,
  kRecvWait,
  kAllReduce,  // waiting for gradient buckets (data-parallel and tied-weight reductions)
  kOptimizer,
  kDataWait,
  kAgreement,  // the step agreement: losses, the gradient norm and stop requests summed
  // One gradient bucket's collective across the replicas, from when the rank posted it to when
  // the rank saw it complete (polled at the backward's launch points and in the step's end: Note
  // [Bucket spans] in runtime/grad_sync/bucket_watch.h). It overlaps the rank's other intervals,
  // so it counts in no RankTimes category. action: REDUCE_GRADS of the bucket's virtual stage;
  // tag: the bucket's index in its stage; collective: which collective.
  kBucket,
};
const char* EventKindName(EventKind k);

// The collective of a kBucket event: the bucketed all-reduce's (fp32), the all-gathers of bf16
// buckets and of PowerSGD's factors, ZeRO's reduce-scatters.
enum class BucketCollective { kAllReduce, kAllGather, kReduceScatter };
const char* BucketCollectiveName(BucketCollective c);  // "all-reduce", "all-gather", ...

struct RankEvent {
  EventKind kind = EventKind::kCompute;
  Action action;  // the action this interval belongs to
  int peer = -1;  // global rank of the peer for sends and receives
  int64_t tag = -1;
  int64_t step = 0;
  double start = 0, end = 0;
  BucketCollective collective = BucketCollective::kAllReduce;  // kBucket only
};

// Time of one rank over the steps taken so far, by category (seconds).
struct RankTimes {
  int global_rank = 0, pipeline_rank = 0, replica = 0, tensor_rank = 0;
  int threads = 1;  // threads its CPU kernels ran on (TrainOptions::threads_per_rank)
  // all_reduce: gradient reductions (and ZeRO's parameter gathers, async DP's pulls);
  // agreement: the step agreement, which every run has, dp = 1 included (rank_step.cc, Agree).
  double compute = 0, recompute = 0, p2p_wait = 0, all_reduce = 0, agreement = 0, optimizer = 0,
         data_wait = 0, idle = 0, wall = 0;
  // Tensor parallelism: the layers' collectives over the tensor-parallel group (posted to
  // completed), taken out of compute (and recompute) where they ran inside a layer's pass.
  double tensor_parallel = 0;
  int64_t peak_memory_bytes = 0;                  // allocator peak over any step
  int64_t peak_activation_bytes = 0;              // peak above the step's starting usage
  int64_t static_memory_bytes = 0;                // weights + gradients + optimizer state
  int64_t optimizer_state_bytes = 0;              // of which optimizer state (÷ dp under ZeRO)
  int64_t gradient_bytes = 0;                     // of which gradient buffers (÷ dp under ZeRO-2)
  std::vector<int> stages;                        // virtual stages on this rank
  std::vector<double> stage_f, stage_b, stage_w;  // mean seconds per micro-batch, per stage
  // Gradient and parameter bytes this rank sent to its data-parallel group (wire terms, as ring
  // algorithms move them: docs/runtime.md "Gradient compression"), and what an fp32 all-reduce
  // of the same gradients would send; the ratio is the compression ratio. Zero with dp = 1.
  int64_t grad_bytes_sent = 0, grad_bytes_uncompressed = 0;
};

struct StepReport {
  StepResult result;             // loss (mean over the global batch), lr, grad_norm, times
  std::vector<RankTimes> ranks;  // this step only
};

struct RunSummary {
  int64_t steps = 0;
  double wall_s = 0;
  std::vector<RankTimes> ranks;  // summed over steps (peaks: max)
  double measured_bubble = 0;    // 1 - sum(compute + recompute) / (ranks x pipeline time)
  double predicted_bubble = 0;   // simulator with the measured per-stage times
  double predicted_step_s = 0;   // simulator makespan + measured optimizer time
  double measured_step_s = 0;    // mean step time
  int bottleneck_rank = 0;       // most compute + recompute
  std::string bottleneck_reason;
};

// One replica of an asynchronous run (TrainOptions::dp_mode kAsync).
struct AsyncReplicaReport {
  int replica = 0;
  int64_t steps = 0;  // its gradients applied (each by every owner, once)
  // Staleness of its steps: how many steps it was ahead of the slowest replica when it started
  // each (0 under synchronous DP; never more than TrainOptions::staleness).
  double mean_staleness = 0;
  int64_t max_staleness = 0;
  double wait_s = 0;  // waiting on the staleness bound
};

// What Engine::RunAsync did. Each replica step applies one update, so a run of `steps` engine
// steps applies steps x dp updates: the same samples as as many synchronous steps.
struct AsyncReport {
  int64_t first_step = 0, steps = 0;  // engine steps [first_step, first_step + steps)
  bool stop_requested = false;        // a stop request ended it early (at a whole step)
  double wall_s = 0;
  // Per update in the order it was granted: its loss (mean over the replica's micro-batches),
  // gradient norm before clipping, learning rate and replica. Complete on the root process.
  struct Update {
    int replica = 0;
    double loss = 0, grad_norm = 0;
    float lr = 0;
  };
  std::vector<Update> updates;
  std::vector<AsyncReplicaReport> replicas;  // by replica (root process)
  // Per rank of this process: [replica] = the gradients of that replica its parameter shard
  // applied (every entry equals that replica's steps when each was applied exactly once).
  std::vector<std::pair<int, std::vector<int64_t>>> applied_by_rank;  // (global rank, counts)
};

// What Engine::Resume resumed.
struct ResumeInfo {
  std::string path;  // the checkpoint read (a step checkpoint of a checkpoint directory)
  int64_t step = 0;  // the step the run continues at
  std::vector<std::string> warnings;
};

class Engine {
 public:
  // Checks `run` against `graph` (CheckRunSpec) and `data` against the first stage's input,
  // connects the World's ranks (World::Connect), refuses a run whose predicted memory exceeds
  // this machine's (CheckRunMemory, run_memory.h: FailedPrecondition naming what it would need)
  // and only then instantiates, on every rank this process runs, only that rank's stages, their
  // optimizer state and its data loader. `data` gives
  // every global sample (shared by the ranks; non-null). In a launcher's world every process
  // calls every method below, and the reports (Summary, Events) need GatherReports first.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const LayerGraph& graph, RunSpec run,
                                                        const TrainOptions& options,
                                                        std::shared_ptr<const Dataset> data,
                                                        World world);
  ~Engine();

  // One optimizer step on every rank. Any rank's failure (a layer error or exception, a
  // non-finite loss or gradient, a timed-out receive) aborts every rank, the step is applied
  // nowhere, and the first error is returned naming the rank, the action and the peer. After
  // a failure the engine refuses further steps.
  absl::StatusOr<StepReport> Step();
  // Asynchronous data parallelism (TrainOptions::dp_mode kAsync; Step refuses it): runs until
  // the engine's step reaches `until_step` — until_step x dp replica steps in all, taken by
  // whichever replica is ready, within the staleness bound — or until a stop request
  // (RequestStop), which ends it at the next whole step. Afterwards every replica holds the
  // owners' parameters and optimizer state, so Save, Weights and a further RunAsync see one
  // model. Failures as in Step.
  absl::StatusOr<AsyncReport> RunAsync(int64_t until_step);
  // Tests and benchmarks (train_testing.h): a straggler replica, an injected failure. Checked by
  // ValidateTrainTestingHooks against this run (nothing changes when it fails); takes effect at
  // the next Step or RunAsync. Not while one runs.
  absl::Status SetTestingHooks(const TrainTestingHooks& hooks);
  int64_t step() const;
  int64_t global_batch() const;
  // Threads each rank of this process runs its CPU kernels on (TrainOptions::threads_per_rank,
  // automatic resolved).
  int threads_per_rank() const;
  float PeakLr() const;
  const RunSpec& run() const;
  const Schedule& schedule() const { return run().schedule; }
  // Layer range [begin, end) of each virtual stage.
  const std::vector<int>& stage_boundaries() const { return run().boundaries; }
  const Topology& topology() const;
  // One rank per process under a launcher (World::multi_process); the root process prints.
  bool multi_process() const;
  bool is_root() const;

  // Replica 0's weights in model order with their global names (host copies). In a launcher's
  // world, only the stages this process holds.
  std::vector<std::pair<std::string, Tensor>> Weights() const;
  // The live parameters of global rank `global_rank` when this process runs it (else empty).
  std::vector<Parameter*> RankParameters(int global_rank) const;
  // Current and peak bytes of that rank's allocator (weights, gradients, optimizer state,
  // activations); the peak restarts at every step. 0 for a rank of another process.
  int64_t RankMemoryBytes(int global_rank) const;
  int64_t RankPeakMemoryBytes(int global_rank) const;

  // Checkpoint with global tensor names (docs/checkpoint.md): any plan can resume it.
  absl::Status Save(const std::string& dir) const;
  // Resumes a checkpoint, or the newest one of a checkpoint directory that verifies and suits
  // this run (ReadCheckpoint): the same model, global batch, optimizer kind and seed, every
  // parameter with its shape. Nothing is changed unless one suits. `info` (when not null)
  // receives what was resumed and the warnings: checkpoints skipped, and settings that differ
  // from the checkpoint's (the learning-rate schedule, optimizer, precision, data, dp).
  absl::Status Resume(const std::string& dir, ResumeInfo* info = nullptr);

  // Flight recorder (docs/runtime.md, "Flight recorder"): writes DIR/flight-rank-<G>.json for
  // each rank of this process — its last actions, with start and end, peer, tag, bytes and
  // what each waited on — and one line per rank on stderr saying where it is now. Safe to call
  // from another thread while a step runs.
  absl::Status DumpFlightRecords(const std::string& dir) const;

  // Multi-process: collects every process's rank times and events (Communicator::AllGather)
  // so that Summary and Events describe the whole world on every process. Collective; a no-op
  // in one process.
  absl::Status GatherReports();
  RunSummary Summary() const;
  // Every rank's recorded events, in (global rank, start) order.
  std::vector<std::vector<RankEvent>> Events() const;

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pipewright

#endif  // PIPEWRIGHT_ENGINE_H_
