// ZeRO's share of a stage's state and the data-parallel traffic of each ZeRO stage
// (partitioner.h: ZeroSharding, PredictGradSync; docs/memory.md).
#include <algorithm>

#include "pipewright/partitioner.h"

namespace pipewright {
namespace {

// ceil(bytes / shards), where a saturated count stays saturated.
int64_t Share(int64_t bytes, int shards) {
  if (bytes == kMemoryOverflow || shards <= 1) return bytes;
  return bytes / shards + (bytes % shards != 0);
}

}  // namespace

int64_t ZeroSharding::OptimizerBytes(int64_t bytes) const {
  return Share(bytes, optimizer_shards());
}

int64_t ZeroSharding::GradientBytes(int64_t bytes) const {
  const int shards = gradient_shards();
  if (shards <= 1) return bytes;
  // The shard accumulator, plus the bucket buffers a replica fills and reduce-scatters in turn
  // (with two, one filling and one on the wire), each as large as the largest bucket (whole
  // gradient groups, closed before passing bucket_bytes unless one group alone does), never more
  // than the stage's whole gradient.
  const int64_t bucket =
      std::max(std::max<int64_t>(1, bucket_bytes), std::max<int64_t>(0, largest_group_bytes));
  const int64_t in_flight = std::min(SaturatingMul(std::clamp(buffers, 1, 2), bucket), bytes);
  return SaturatingAdd(Share(bytes, shards), in_flight);
}

GradSyncCost PredictGradSync(int64_t params, const ParamBytes& param_bytes,
                             const ZeroSharding& sharding, int micro_batches,
                             const DeviceSpec& devices) {
  GradSyncCost cost;
  const int dp = sharding.dp;
  if (dp <= 1) return cost;
  const double share = static_cast<double>(dp - 1) / dp;  // of a ring collective, per link
  const double grads = static_cast<double>(params) * static_cast<double>(param_bytes.grads);
  const double weights = static_cast<double>(params) * static_cast<double>(param_bytes.weights);
  const int64_t steps = dp - 1;  // latencies of one ring reduce-scatter or all-gather
  if (sharding.zero >= 2) {
    // A reduce-scatter of every micro-batch's gradients, then one all-gather of the weights.
    const int64_t m = std::max(1, micro_batches);
    cost.bytes = share * (static_cast<double>(m) * grads + weights);
    cost.latencies = (m + 1) * steps;
  } else if (sharding.zero == 1) {
    // One reduce-scatter of the accumulated gradients, one all-gather of the updated weights.
    cost.bytes = share * (grads + weights);
    cost.latencies = 2 * steps;
  } else {
    // A ring all-reduce: a reduce-scatter and an all-gather of the gradients.
    cost.bytes = 2 * share * grads;
    cost.latencies = 2 * steps;
  }
  cost.seconds = cost.bytes / devices.link_bandwidth +
                 static_cast<double>(cost.latencies) * devices.link_latency_s;
  return cost;
}

}  // namespace pipewright
