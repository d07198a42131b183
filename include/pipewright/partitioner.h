// The partitioner: given a model's per-layer costs (plan.h ModelCosts) and the devices, find
// the contiguous split into pipeline stages with the smallest predicted step time that fits
// in every device's memory, and search over pp x dp, micro-batch sizes and schedules.
//
//   DeviceSpec dev;  dev.count = 8;  dev.memory_bytes = 80 * kGiB;
//   PartitionOptions o;  o.pp = 4;  o.dp = 2;  o.schedule = ScheduleKind::k1F1B;
//   o.micro_batches = 8;  o.micro_batch_size = 4;
//   PW_ASSIGN_OR_RETURN(Plan plan, Partition(model, dev, o));
//
// Cost and memory model: docs/memory.md. Pure C++: no device, MPI or BLAS headers.
#ifndef PIPEWRIGHT_PARTITIONER_H_
#define PIPEWRIGHT_PARTITIONER_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/plan.h"
#include "pipewright/precision_kind.h"
#include "pipewright/schedule.h"

namespace pipewright {

inline constexpr int64_t kGiB = int64_t{1} << 30;

struct DeviceSpec {
  int count = 1;
  int64_t memory_bytes = 80 * kGiB;
  int64_t reserve_bytes = 0;       // kept free on every device (workspace, fragmentation)
  double tflops = 100;             // sustained compute throughput (TFLOP/s)
  double link_bandwidth = 25e9;    // P2P and all-reduce bytes per second
  double link_latency_s = 10e-6;   // per message
  double memory_bandwidth = 2e12;  // bytes per second, for the optimizer step
  // Fixed cost of running one layer's forward or backward once (kernel launches, small-GEMM
  // inefficiency): what makes tiny micro-batches slower than their FLOPs. Profiled times
  // already include it.
  double layer_overhead_s = 20e-6;
  // Tensor parallelism's collectives run inside a node (docs/memory.md, "Tensor parallelism"):
  // a tensor-parallel group is at most devices_per_node devices, and its ring all-reduces,
  // reduce-scatters and all-gathers move their bytes at tp_bandwidth (bytes per second per
  // device, NCCL's "bus bandwidth": an H100 SXM's NVLink 4 carries 450 GB/s each way) with
  // tp_latency_s per ring step. Data-parallel and pipeline traffic stay on link_bandwidth.
  int devices_per_node = 8;
  double tp_bandwidth = 450e9;
  double tp_latency_s = 5e-6;
};

// Bytes per parameter on a stage's device (docs/memory.md).
struct ParamBytes {
  int64_t weights = 4, grads = 4, optimizer = 8;  // fp32 Adam: 16
  int64_t total() const { return weights + grads + optimizer; }
};
ParamBytes BytesPerParam(Precision precision);  // fp32 4+4+8; bf16/fp16 2+4+(4+8) = 18

// TrainOptions::bucket_bytes' default (train.h; tests/runtime/run_memory_test.cc checks that they
// agree): the gradient bucket a plan assumes for ZeRO-2's in-flight buffers, since neither a
// layer graph nor a plan carries the run's bucket size.
inline constexpr int64_t kDefaultGradBucketBytes = int64_t{1} << 20;

// How ZeRO splits a stage's state over its data-parallel replicas (docs/memory.md, "Memory of a
// stage"). Counts saturate at kMemoryOverflow.
struct ZeroSharding {
  int zero = 0;  // 0: every replica holds everything; 1: the optimizer state is split; 2: and
                 // the gradients (dp >= 2 for 1 and 2)
  int dp = 1;    // the stage's replicas
  // ZeRO-2: gradients are reduce-scattered bucket by bucket as the backward produces them; a
  // replica holds its 1/dp shard of the stage's gradients and `buffers` bucket buffers
  // (TrainOptions.zero_buffers: 2 overlap the reduce-scatter with the backward; plans use 2).
  int64_t bucket_bytes = kDefaultGradBucketBytes;
  // The largest gradient group's bytes (LayerCost::largest_group_params): a bucket holds whole
  // groups and closes before one that would take it past bucket_bytes, so one bucket is at most
  // max(bucket_bytes, this) (the partitioner and the run's prediction fill it from the model).
  int64_t largest_group_bytes = 0;
  int buffers = 2;

  int optimizer_shards() const { return zero >= 1 && dp > 1 ? dp : 1; }
  int gradient_shards() const { return zero >= 2 && dp > 1 ? dp : 1; }
  // One replica's share of a stage whose whole optimizer state is `bytes`: ceil(bytes / shards).
  int64_t OptimizerBytes(int64_t bytes) const;
  // One replica's gradient bytes for a stage whose whole gradients are `bytes`: `bytes`, or under
  // ZeRO-2 ceil(bytes / dp) + min(2 x max(bucket_bytes, largest_group_bytes), bytes).
  int64_t GradientBytes(int64_t bytes) const;
};

// What one stage's data-parallel gradient synchronization costs per step (docs/memory.md,
// "Predicted step time"), with G its gradient bytes, W its weight bytes and m micro-batches:
//   zero 0: ring all-reduce of G, 2 (dp - 1)/dp G over each link, 2 (dp - 1) latencies;
//   zero 1: reduce-scatter of G, all-gather of the updated W: (dp - 1)/dp (G + W), 2 (dp - 1);
//   zero 2: a reduce-scatter of G per micro-batch, one all-gather of W:
//           (dp - 1)/dp (m G + W), (m + 1)(dp - 1) latencies.
// Nothing with dp = 1.
struct GradSyncCost {
  double bytes = 0;       // over each link
  int64_t latencies = 0;  // messages in sequence
  double seconds = 0;     // bytes / link_bandwidth + latencies x link_latency_s
};
GradSyncCost PredictGradSync(int64_t params, const ParamBytes& param_bytes,
                             const ZeroSharding& sharding, int micro_batches,
                             const DeviceSpec& devices);

struct PartitionOptions {
  int pp = 1;
  int dp = 1;
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int chunks = 1;                // interleaved: v >= 2; zb-v: 2; others 1
  int micro_batches = 1;         // per replica
  int64_t micro_batch_size = 0;  // 0: the model's
  Precision precision = Precision::kFp32;
  // ZeRO (ZeroSharding): 1 splits each stage's optimizer state over the dp replicas, 2 its
  // gradients too (dp >= 2 for either).
  int zero = 0;
  // Tensor parallelism (Plan::tensor_parallel, sequence_parallel): pp x dp x tp = devices.count;
  // tp divides the model's heads, hidden and MLP sizes and vocabulary and is at most
  // DeviceSpec::devices_per_node (CheckTensorParallel).
  int tp = 1;
  bool sequence_parallel = false;
  bool allow_recompute = true;  // recompute a stage when (and only when) it does not fit without
  // When nothing fits, partition alternatives (recomputation, 1f1b, smaller micro-batches, more
  // stages) and name those that would fit in the error.
  bool suggest = true;
};

// The memory model's parameter and byte counts saturate at this value instead of overflowing
// int64: a count that reaches it stands for "more than 8 EiB", which no device holds.
inline constexpr int64_t kMemoryOverflow = std::numeric_limits<int64_t>::max();
// a + b and a * b for such counts (non-negative), kMemoryOverflow where int64 would overflow, so
// a saturated count stays saturated through every sum and product.
inline int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? kMemoryOverflow : r;
}
inline int64_t SaturatingMul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? kMemoryOverflow : r;
}

// Per-micro-batch peak number of micro-batches whose activations a virtual stage holds under
// `schedule` (from each rank's program order: F adds one, the last backward action frees it).
std::vector<int> PeakInflightPerStage(const Schedule& schedule);

// The optimal plan for fixed (pp, dp, schedule, micro-batching): contiguous non-empty stages
// covering every layer once; minimises the largest stage time per micro-batch (the
// steady-state throughput of every schedule), then the sum of stage times (fill and drain);
// every device within memory; recomputation only on stages that do not fit without it.
// The result is exact (dynamic programming, O(stages * layers^2) worst case).
// When nothing fits, FailedPrecondition names the stage, its layers and the shortfall in bytes
// and suggests what would fit.
absl::StatusOr<Plan> Partition(const ModelCosts& model, const DeviceSpec& devices,
                               const PartitionOptions& options);
// What Partition checks first: a model with layers, devices with positive counts, memory,
// throughputs and bandwidths, pp, dp >= 1 with pp x dp x tp = devices.count, a tp that
// CheckTensorParallel accepts, zero 0, 1 or 2 (1 and 2
// with dp >= 2), micro_batch_size >= 0. InvalidArgument naming the field otherwise
// (`PartitionOptions.pp = 0`, `DeviceSpec.memory_bytes`, `PartitionOptions.zero = 3`;
// Note [Field names in errors] in train.h).
absl::Status ValidatePartitionOptions(const ModelCosts& model, const DeviceSpec& devices,
                                      const PartitionOptions& options);

// Fills plan.predicted and every stage's predicted time and memory for the plan's split.
absl::Status Predict(const ModelCosts& model, const DeviceSpec& devices, Precision precision,
                     Plan& plan);

// What one pipeline rank of a run holds (docs/memory.md, "Memory of a stage"): its virtual
// stages' memory summed, as Predict counts it for a plan's stages.
struct RankMemory {
  int rank = 0;             // pipeline rank
  std::vector<int> stages;  // its virtual stages, in model order
  std::vector<int> held;    // per stage: micro-batches whose activations it holds at once
  StageMemory memory;       // weights, gradients, optimizer state and activations, summed
};

// The memory of every pipeline rank of the run `schedule` makes of `model` (its costs at the
// run's micro-batch size), split at `boundaries` (stages + 1 increasing layer indices from 0 to
// the number of layers) with per-stage `recompute`: Predict's per-stage model (held micro-batches
// from PeakInflightPerStage, tied copies linked within a rank) for any schedule, hand-written
// ones included. `sharding`: what ZeRO splits over the data-parallel replicas (optimizer state,
// gradients). Counts saturate at kMemoryOverflow. Nothing is allocated beyond the result.
// InvalidArgument when the boundaries or recompute entries do not fit the schedule, or the
// sharding is not valid (zero 0, 1 or 2, dp >= 1, bucket_bytes >= 1).
absl::StatusOr<std::vector<RankMemory>> PredictRankMemory(const ModelCosts& model,
                                                          const Schedule& schedule,
                                                          const std::vector<int>& boundaries,
                                                          const std::vector<Recompute>& recompute,
                                                          const ParamBytes& param_bytes,
                                                          const ZeroSharding& sharding = {});

// The split used when a run names no plan: `stages` contiguous non-empty layer ranges whose
// largest forward + backward FLOPs is the smallest possible (every layer counts at least 1),
// then the least total, by the same dynamic programs as Partition with memory unbounded.
// Returns stages + 1 boundaries from 0 to the number of layers; InvalidArgument when stages is
// not in [1, layers].
absl::StatusOr<std::vector<int>> BalancedBoundaries(const ModelCosts& model, int stages);

// What a run measured, for CalibrateModelCosts (Note [Calibration] in partitioner/calibrate.cc).
// Times are the mean seconds per micro-batch of each virtual stage's F and of its B (or I + W;
// recomputation excluded, RankTimes::stage_f/stage_b/stage_w); peaks are each pipeline rank's
// allocator peak (RankTimes::peak_memory_bytes, one replica's).
struct RunMeasurement {
  Schedule schedule;                                      // what ran (generated or hand-written)
  int64_t micro_batch_size = 1;                           // sequences per micro-batch
  std::vector<int> boundaries;                            // stages + 1 layer indices, 0 .. layers
  std::vector<Recompute> recompute;                       // per stage
  ParamBytes param_bytes;                                 // BytesPerParam of the run's precision
  ZeroSharding sharding;                                  // the run's ZeRO stage and dp
  std::vector<double> stage_forward_s, stage_backward_s;  // per stage
  std::vector<int64_t> rank_peak_bytes;                   // per pipeline rank
};

// `model` with every layer's forward_time_s / backward_time_s set from the run's measured
// stage times (each layer keeps its predicted share of its stage's; `dev` predicts the layers
// that have no measured time yet) and its activation bytes scaled per rank so that the run's
// configuration predicts the measured peaks. The result is at the run's micro-batch size.
// InvalidArgument naming the field for a measurement that does not fit the model or schedule,
// or a stage time that is not positive and finite.
inline constexpr int64_t kMaxCalibrationMicroBatchSize = int64_t{1} << 24;
absl::StatusOr<ModelCosts> CalibrateModelCosts(const ModelCosts& model, const DeviceSpec& dev,
                                               const RunMeasurement& run);

struct SearchOptions {
  int64_t global_batch = 0;  // sequences per step; 0: devices * the model's micro-batch size
  // Fixed choices; unset means "try every value". tp: every divisor of the devices that
  // CheckTensorParallel accepts (1 for a model without a TransformerShape); sequence_parallel:
  // both where tp >= 2.
  std::optional<int> pp, dp, chunks, tp;
  std::optional<bool> sequence_parallel;
  // ZeRO stage (Plan::zero: 0, 1 or 2); unset: all three where dp >= 2, 0 otherwise.
  std::optional<int> zero;
  std::optional<ScheduleKind> schedule;
  std::optional<int64_t> micro_batch_size;
  Precision precision = Precision::kFp32;
  bool allow_recompute = true;
  int keep = 5;  // best plans returned
  // Threads that partition candidates at once; 0: the CPU cores this process may use. The
  // result does not depend on it.
  int threads = 0;
};

struct SearchResult {
  std::vector<Plan> best;               // fastest first, at most `keep`
  int candidates = 0;                   // (pp, dp, b, schedule) combinations tried
  int feasible = 0;                     // of which fitted in memory
  std::vector<std::string> infeasible;  // why the closest misses did not fit (a few)
};

// Tries every pp x dp x tp = devices.count, sequence parallelism on and off where tp >= 2,
// micro-batch sizes b with dp * b dividing the global
// batch, the schedules (gpipe, 1f1b, interleaved with 2 chunks, zb-h1, zb-v) and, where dp >= 2,
// ZeRO 0, 1 and 2, each partitioned optimally; fastest first, equal times by less memory. An error
// when no combination fits, with the closest shortfall.
absl::StatusOr<SearchResult> SearchPlans(const ModelCosts& model, const DeviceSpec& devices,
                                         const SearchOptions& options);

// ---------------------------------------------------------------------------------------------
// Tensor parallelism (docs/memory.md, "Tensor parallelism"; partitioner/tensor_parallel.cc).

// Whether `model` can be split over tp devices of `devices`: tp >= 1, at most
// DeviceSpec::devices_per_node, and for tp >= 2 a model with a TransformerShape whose heads,
// hidden size, MLP hidden size and vocabulary tp divides; sequence_parallel needs tp >= 2.
// InvalidArgument naming the field (`PartitionOptions.tp = 3 does not divide the model's 8
// attention heads`).
absl::Status CheckTensorParallel(const ModelCosts& model, const DeviceSpec& devices, int tp,
                                 bool sequence_parallel);

// Seconds of one ring collective over a tensor-parallel group of tp devices on a buffer of
// `bytes` (what each device holds before a reduce-scatter or after an all-gather):
// all-reduce 2 (tp - 1)/tp x bytes / tp_bandwidth + 2 (tp - 1) x tp_latency_s, reduce-scatter
// and all-gather half of it. 0 for tp = 1.
enum class TpCollective { kAllReduce, kReduceScatter, kAllGather };
double TensorParallelCollectiveSeconds(TpCollective kind, double bytes, int tp,
                                       const DeviceSpec& devices);

// One tensor-parallel device's view of a model: every layer's parameters, FLOPs (and measured
// times), saved and output bytes as one of the tp devices holds and computes them, and the
// seconds its layers' tensor-parallel collectives add to their forward and backward (not
// overlapped with compute, Megatron-LM's default). tp = 1 returns the model unchanged and no
// communication. The model's costs are at the micro-batch size they are given at.
struct TensorParallelCosts {
  ModelCosts rank;                      // per device
  std::vector<double> forward_comm_s;   // per layer, seconds per micro-batch
  std::vector<double> backward_comm_s;  // per layer
};
absl::StatusOr<TensorParallelCosts> ShardForTensorParallel(const ModelCosts& model,
                                                           const DeviceSpec& devices, int tp,
                                                           bool sequence_parallel);

}  // namespace pipewright

#endif  // PIPEWRIGHT_PARTITIONER_H_
