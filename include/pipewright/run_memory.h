// What a run will hold in memory, predicted before anything is allocated, and the check of that
// prediction against what this machine can give the process (docs/memory.md, "Checked at
// start"). Engine::Create and EvaluateCheckpoint call the checks, so a run too big for the
// machine — a huge micro-batch size, a huge model rebuilt from a checkpoint — is refused with an
// error naming what it would need instead of being killed by the kernel halfway through.
//
//   PW_ASSIGN_OR_RETURN(RunMemoryNeed need,
//                       PredictRunMemory(graph, run, options, data->Spec(), {{0}, {1}}));
//   std::printf("%s\n", need.Describe().c_str());
//
// The prediction is the partitioner's memory model (PredictRankMemory: weights, gradients,
// optimizer state and the activations of the micro-batches the schedule holds at once) plus the
// data loader's step batches. It is an estimate: the checks refuse only what exceeds the
// machine's physical memory, never what merely comes close.
#ifndef PIPEWRIGHT_RUN_MEMORY_H_
#define PIPEWRIGHT_RUN_MEMORY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/data.h"
#include "pipewright/model.h"
#include "pipewright/partitioner.h"
#include "pipewright/run_spec.h"
#include "pipewright/train.h"

namespace pipewright {

// The memory this process may use: the machine's physical memory and its cgroup's limit.
struct HostMemory {
  int64_t total_bytes = 0;         // /proc/meminfo MemTotal; 0: unknown
  int64_t available_bytes = 0;     // /proc/meminfo MemAvailable; 0: unknown
  int64_t cgroup_limit_bytes = 0;  // the smallest memory limit of this process's cgroups; 0: none
  std::string cgroup_file;         // the file that limit was read from ("" when none)

  // The smaller of total_bytes and cgroup_limit_bytes, of those known; 0 when neither is.
  int64_t limit_bytes() const;
  // "23.5 GiB (MemTotal; cgroup: none)", "4.0 GiB (cgroup limit, /sys/fs/cgroup/memory.max;
  // MemTotal 23.5 GiB)".
  std::string Describe() const;
};

// Reads HostMemory from the files under `proc` (meminfo; self/cgroup, which names this
// process's cgroups) and `sys` (cgroup v2 memory.max, or v1 memory/…/memory.limit_in_bytes, of
// the process's cgroup and every ancestor: the smallest limit counts; "max" and v1's
// near-2^63 "unlimited" are no limit). A file missing or unreadable leaves its field unknown.
HostMemory ReadHostMemory(const std::string& proc = "/proc", const std::string& sys = "/sys");

// What the runtime's checks compare with: ReadHostMemory() of the running system, or what
// SetHostMemoryForTesting set. Thread-safe.
HostMemory ThisHostMemory();
// Makes ThisHostMemory return `memory` (nullopt: the real one again). For tests.
void SetHostMemoryForTesting(std::optional<HostMemory> memory);

// "93.4 GiB", "0.9 MiB", "512 B"; kMemoryOverflow is "more than 8 EiB".
std::string FormatBytes(int64_t bytes);

// A rank this process runs: its global rank and its GPU (-1: the CPU).
struct RankPlace {
  int global_rank = 0;
  int cuda_device = -1;
};

// One rank's predicted memory. Counts saturate at kMemoryOverflow.
struct RankMemoryNeed {
  int global_rank = 0, pipeline_rank = 0, replica = 0;
  int cuda_device = -1;
  // The partitioner's model for the rank's stages: weights, gradients, optimizer state and
  // activations (on the rank's device).
  RankMemory model;
  // The data loader's step batches (host memory), on ranks holding the first or the last stage:
  // the steps built ahead and the one in use, each micro_batches x micro_batch_size samples.
  int64_t data_bytes = 0;
  // What it needs on the host: everything on the CPU, the data batches only on a GPU.
  int64_t host_bytes() const;
};

// The prediction for the ranks one process runs.
struct RunMemoryNeed {
  int64_t micro_batch_size = 0;
  int micro_batches = 0;  // per replica
  std::vector<RankMemoryNeed> ranks;
  int64_t host_bytes() const;  // summed over the ranks (saturating)
  // "12.3 GiB on this process (2 ranks; the largest, rank 0: weights …, gradients …,
  // optimizer …, activations … for 4 micro-batches of 8 sequences, data batches …)"; with one
  // rank "(rank 3: …)".
  std::string Describe() const;
};

// Predicts what the ranks `places` of a run need (Engine::Create: every rank in one process;
// its own under a launcher), from `graph`'s costs at its micro-batch size, `run`'s schedule,
// split and recomputation, options.precision, options.zero (and ZeRO-2's options.bucket_bytes),
// and the data's sample shape.
// Nothing is allocated beyond the result. InvalidArgument when `run` does not fit `graph`.
absl::StatusOr<RunMemoryNeed> PredictRunMemory(const LayerGraph& graph, const RunSpec& run,
                                               const TrainOptions& options,
                                               const SampleSpec& sample,
                                               const std::vector<RankPlace>& places);

// PredictRunMemory, then refuses the run when it cannot fit: FailedPrecondition when what the
// ranks need on the host exceeds host.limit_bytes() (unless that is unknown), or what the ranks
// on one GPU need exceeds its total memory (where the device reports it); InvalidArgument when
// a count overflows 64 bits. The message says what the run would need, of what it is made, what
// there is, and what would fit (a smaller --micro-batch-size, --recompute full) when something
// does.
absl::Status CheckRunMemory(const LayerGraph& graph, const RunSpec& run,
                            const TrainOptions& options, const SampleSpec& sample,
                            const std::vector<RankPlace>& places, const HostMemory& host);

// What evaluating a checkpoint of `graph` holds (EvaluateCheckpoint): the whole model's weights
// and gradients on one CPU stage, the activations of one micro-batch, the checkpoint's tensors
// (`checkpoint_bytes`, the files' sizes) and `batches` held-out batches of `sample`s; refused as
// CheckRunMemory refuses.
absl::Status CheckEvaluationMemory(const LayerGraph& graph, const SampleSpec& sample,
                                   int64_t batches, int64_t checkpoint_bytes,
                                   const HostMemory& host);

}  // namespace pipewright

#endif  // PIPEWRIGHT_RUN_MEMORY_H_
