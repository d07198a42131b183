// The pipeline engine: pp x dp ranks, each a RankExecutor that interprets its lowered Program
// (schedule.h) over its stages of the model. On the embedded default every rank is a thread
// of this process with its own CPU allocator and the ranks talk only through the Communicator
// (comm.h, local backend).
//
//   EngineOptions o;  o.pp = 4;  o.dp = 2;  o.schedule = ScheduleKind::k1F1B;
//   o.train.micro_batches = 8;   // per replica
//   PW_ASSIGN_OR_RETURN(auto engine, Engine::Create(graph, o));
//   PW_ASSIGN_OR_RETURN(StepReport r, engine->Step());
//
// One step, on every rank: load (first stage) or receive each micro-batch's input, forward,
// loss on the last stage, backward (I and W separately where the schedule splits them),
// weight gradients accumulated across micro-batches in the schedule's order, gradients
// all-reduced across replicas in buckets launched as soon as the bucket's last weight
// gradient is done, then one agreement all-reduce over the world (losses, per-parameter
// squared norms, failures) so that global-norm clipping and the optimizer step happen on every
// rank or on none. With the same global batch the losses and weights are bit-identical to
// pp = 1 for every schedule and recompute setting (docs/runtime.md).
#ifndef PIPEWRIGHT_ENGINE_H_
#define PIPEWRIGHT_ENGINE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/model.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"
#include "pipewright/simulator.h"
#include "pipewright/train.h"

namespace pipewright {

struct EngineOptions {
  TrainOptions train;  // micro_batches is per replica; global batch = dp * M * B
  int pp = 1;
  int dp = 1;
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int chunks = 1;  // model chunks per rank (interleaved; zb-v uses 2)
  Recompute recompute = Recompute::kNone;
  // Per virtual stage (size = pp * chunks), overriding `recompute`; empty = `recompute` on all.
  std::vector<Recompute> stage_recompute;
  // Virtual-stage boundaries: S + 1 increasing layer indices from 0 to num_layers. Empty =
  // contiguous stages balancing forward + backward FLOPs (the minimum possible maximum).
  std::vector<int> stage_boundaries;
  // A receive, collective or data wait that takes longer fails the step on every rank.
  absl::Duration timeout = absl::Seconds(60);
  int64_t bucket_bytes = int64_t{1} << 20;  // gradient all-reduce bucket size

  // Where the ranks run. CPU: every rank is a thread with its own host allocator. CUDA: rank g
  // runs on GPU cuda_devices[g % n] (empty = every visible GPU) with its own stream and
  // stream-ordered allocator; the ranks talk through NCCL when each has a GPU of its own, and
  // through the local backend with device buffers when several share one (so a whole pipeline
  // runs on one GPU). `comm` forces a backend: "auto", "local" or "nccl".
  Device device = Device::Cpu();
  std::vector<int> cuda_devices;
  std::string comm = "auto";

  // Fault injection for tests of failure handling: global rank `inject_failure_rank` fails
  // with Internal "injected failure" at its first backward action of step
  // `inject_failure_step` (-1: never).
  int inject_failure_rank = -1;
  int64_t inject_failure_step = -1;
};

// One recorded interval of a rank's step (times in seconds from the engine's creation).
enum class EventKind {
  kCompute,    // F, B, I, W (action set)
  kRecompute,  // the forward recomputed before a backward
  kSend,
  kRecvWait,
  kAllReduce,  // waiting for gradient buckets and the step agreement
  kOptimizer,
  kDataWait,
};
const char* EventKindName(EventKind k);

struct RankEvent {
  EventKind kind = EventKind::kCompute;
  Action action;  // the action this interval belongs to
  int peer = -1;  // global rank of the peer for sends and receives
  int64_t tag = -1;
  int64_t step = 0;
  double start = 0, end = 0;
};

// Time of one rank over the steps taken so far, by category (seconds).
struct RankTimes {
  int global_rank = 0, pipeline_rank = 0, replica = 0;
  double compute = 0, recompute = 0, p2p_wait = 0, all_reduce = 0, optimizer = 0, data_wait = 0,
         idle = 0, wall = 0;
  int64_t peak_memory_bytes = 0;                  // allocator peak over any step
  int64_t peak_activation_bytes = 0;              // peak above the step's starting usage
  int64_t static_memory_bytes = 0;                // weights + gradients + optimizer state
  std::vector<int> stages;                        // virtual stages on this rank
  std::vector<double> stage_f, stage_b, stage_w;  // mean seconds per micro-batch, per stage
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

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const LayerGraph& graph,
                                                        const EngineOptions& options);
  // A multi-process run (docs/cluster.md): this process runs only global rank
  // `world->rank()` of the pp x dp grid and talks to the other processes through `world` (the
  // MPI backend, or NCCL bootstrapped through it), whose size must be pp x dp
  // (InvalidArgument naming both otherwise). Every process calls every method below; the
  // reports (Summary, Events) need GatherReports first.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const LayerGraph& graph,
                                                        const EngineOptions& options,
                                                        std::unique_ptr<Communicator> world);
  // Multi-process: collects every process's rank times and events so that Summary and Events
  // describe the whole world on every process. Collective; a no-op in one process.
  absl::Status GatherReports();
  ~Engine();

  // One optimizer step on every rank. Any rank's failure (a layer error or exception, a
  // non-finite loss or gradient, a timed-out receive) aborts every rank, the step is applied
  // nowhere, and the first error is returned naming the rank, the action and the peer. After
  // a failure the engine refuses further steps.
  absl::StatusOr<StepReport> Step();
  int64_t step() const;
  int64_t global_batch() const;
  float PeakLr() const;
  const Schedule& schedule() const;
  // Layer range [begin, end) of each virtual stage.
  const std::vector<int>& stage_boundaries() const;
  const Topology& topology() const;

  // Replica 0's weights in model order with their global names (copies).
  std::vector<std::pair<std::string, Tensor>> Weights() const;

  // Checkpoint with global tensor names (docs/checkpoint.md): any plan can resume it.
  absl::Status Save(const std::string& dir) const;
  absl::Status Resume(const std::string& dir);

  RunSummary Summary() const;
  // Every rank's recorded events, in (global rank, start) order.
  std::vector<std::vector<RankEvent>> Events() const;

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// OK when a backend without message tags (NCCL: receives match sends in posting order) runs
// `sched` correctly: for every ordered pair of pipeline ranks the receiver posts its receives in
// the order the sender posts the sends. Otherwise InvalidArgument naming the pair. The engine
// checks it before running a schedule on NCCL.
absl::Status CheckFifoOrder(const Schedule& sched);

// Contiguous split of `graph` into `stages` non-empty ranges minimising the largest stage's
// forward + backward FLOPs; returns stages + 1 boundaries.
absl::StatusOr<std::vector<int>> BalancedBoundaries(const LayerGraph& graph, int stages);

}  // namespace pipewright

#endif  // PIPEWRIGHT_ENGINE_H_
