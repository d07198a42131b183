// Partitioner internals shared by partition.cc and search.cc.
#ifndef PIPEWRIGHT_PARTITIONER_PARTITION_INTERNAL_H_
#define PIPEWRIGHT_PARTITIONER_PARTITION_INTERNAL_H_

#include <cstdint>
#include <string>

#include "pipewright/partitioner.h"

namespace pipewright::internal {

// "1.50 GiB", "12.0 KiB", "300 B"; kMemoryOverflow as "more than 8 EiB (...)".
std::string Bytes(int64_t b);

// Partition() that also reports, when nothing fits, by how many bytes the best split's worst
// stage overflows (0 otherwise): the plan search names the closest miss.
absl::StatusOr<Plan> Partition(const ModelCosts& model, const DeviceSpec& devices,
                               const PartitionOptions& options, int64_t* shortfall);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_PARTITIONER_PARTITION_INTERNAL_H_
