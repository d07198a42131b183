// Partitioner internals shared by partition.cc and search.cc.
#ifndef PIPEWRIGHT_PARTITIONER_PARTITION_INTERNAL_H_
#define PIPEWRIGHT_PARTITIONER_PARTITION_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "pipewright/partitioner.h"

namespace pipewright::internal {

// "1.50 GiB", "12.0 KiB", "300 B"; kMemoryOverflow as "more than 8 EiB (...)".
std::string Bytes(int64_t b);

// Partition() that also reports, when nothing fits, by how many bytes the best split's worst
// stage overflows (0 otherwise): the plan search names the closest miss. `schedule`, when given,
// is GenerateSchedule of the options' schedule, pp, micro-batches and chunks (the search makes it
// once for the three ZeRO stages).
absl::StatusOr<Plan> Partition(const ModelCosts& model, const DeviceSpec& devices,
                               const PartitionOptions& options, int64_t* shortfall,
                               const Schedule* schedule = nullptr);

// What would fit instead of a configuration that does not (recomputation, a higher ZeRO stage,
// 1f1b instead of gpipe, smaller micro-batches, a deeper pipeline, more tensor parallelism),
// each tried for real by partitioning it without further suggestions; `b` is the micro-batch
// size, `S` the stages, `budget` a stage's memory and `static_bytes` the model's weights and
// state on one device. Never empty (suggest.cc).
std::vector<std::string> Suggestions(const ModelCosts& model, const DeviceSpec& dev,
                                     const PartitionOptions& o, int64_t b, int S, int64_t budget,
                                     int64_t static_bytes);

// "" when tp divides the shape's heads, hidden size, MLP hidden size and vocabulary; otherwise
// what it does not divide ("does not divide the model's 96 attention heads").
std::string TensorParallelShapeProblem(const TransformerShape& shape, int64_t tp);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_PARTITIONER_PARTITION_INTERNAL_H_
