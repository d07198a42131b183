// `pipewright bench --suite partitioner`: how long the exact partitioner and the plan search
// take on large models (the target: 1,000 layers over 64 stages well under a second).
#ifndef PIPEWRIGHT_BENCH_PARTITIONER_SUITE_H_
#define PIPEWRIGHT_BENCH_PARTITIONER_SUITE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pipewright::bench {

struct PartitionerRow {
  std::string name;  // what was partitioned
  int layers = 0, stages = 0, micro_batches = 0;
  std::string schedule;
  double seconds = 0;        // median wall time of one Partition or SearchPlans call
  int candidates = 1;        // partitions computed by the call (plan search: every candidate)
  double bottleneck_s = 0;   // the plan's largest stage time per micro-batch
  double lower_bound_s = 0;  // max(sum / stages, largest layer)
  int recomputed_stages = 0;
};

absl::StatusOr<std::vector<PartitionerRow>> RunPartitionerSuite(int repetitions);

}  // namespace pipewright::bench

#endif  // PIPEWRIGHT_BENCH_PARTITIONER_SUITE_H_
