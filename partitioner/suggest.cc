// What would fit when a configuration does not (partition_internal.h, Suggestions): each
// alternative is partitioned for real, without further suggestions.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "partitioner/partition_internal.h"
#include "pipewright/partitioner.h"

namespace pipewright {

std::vector<std::string> internal::Suggestions(const ModelCosts& model, const DeviceSpec& dev,
                                               const PartitionOptions& o, int64_t b, int S,
                                               int64_t budget, int64_t static_bytes) {
  std::vector<std::string> out;
  auto fits = [&](PartitionOptions alt) {
    alt.suggest = false;
    alt.micro_batch_size = alt.micro_batch_size ? alt.micro_batch_size : b;
    absl::StatusOr<Plan> p = Partition(model, dev, alt);
    return p.ok();
  };
  if (!o.allow_recompute) {
    PartitionOptions alt = o;
    alt.allow_recompute = true;
    if (fits(alt)) out.push_back("allowing activation recomputation");
  }
  for (int zero = o.zero + 1; zero <= 2 && o.dp >= 2; ++zero) {
    PartitionOptions alt = o;
    alt.zero = zero;
    if (fits(alt)) {
      out.push_back(absl::StrCat("PartitionOptions.zero = ", zero, " (splits the optimizer state",
                                 zero == 2 ? " and the gradients" : "", " over the ", o.dp,
                                 " replicas)"));
      break;
    }
  }
  if (o.schedule == ScheduleKind::kGpipe) {
    PartitionOptions alt = o;
    alt.schedule = ScheduleKind::k1F1B;
    if (fits(alt)) {
      out.push_back("PartitionOptions.schedule = 1f1b (holds at most p micro-batches, not m)");
    }
  }
  for (int64_t smaller = b / 2; smaller >= 1; smaller /= 2) {
    PartitionOptions alt = o;
    alt.micro_batch_size = smaller;
    alt.micro_batches = static_cast<int>(
        std::min<int64_t>(int64_t{o.micro_batches} * b / smaller, std::numeric_limits<int>::max()));
    if (fits(alt)) {
      out.push_back(absl::StrCat("PartitionOptions.micro_batch_size = ", smaller,
                                 ", PartitionOptions.micro_batches = ", alt.micro_batches,
                                 " (same global batch)"));
      break;
    }
  }
  const int tp = std::max(1, o.tp);
  for (int pp = o.pp * 2; int64_t{pp} * tp <= dev.count && pp <= model.num_layers(); pp *= 2) {
    if (dev.count % (pp * tp) != 0) break;
    PartitionOptions alt = o;
    alt.pp = pp;
    alt.dp = dev.count / (pp * tp);
    if (alt.zero >= 1 && alt.dp < 2) break;
    if (alt.schedule == ScheduleKind::kInterleaved && alt.micro_batches % pp != 0) break;
    if (fits(alt)) {
      out.push_back(absl::StrCat("PartitionOptions.pp = ", pp, ", PartitionOptions.dp = ", alt.dp));
      break;
    }
  }
  // More tensor parallelism at the same pipeline depth and global batch: half the replicas,
  // each running twice the micro-batches.
  for (int more = tp * 2; o.dp % (more / tp) == 0 && more <= dev.devices_per_node; more *= 2) {
    if (!CheckTensorParallel(model, dev, more, o.sequence_parallel).ok()) continue;
    PartitionOptions alt = o;
    alt.tp = more;
    alt.dp = o.dp / (more / tp);
    if (alt.zero >= 1 && alt.dp < 2) break;
    const int64_t m = int64_t{o.micro_batches} * (more / tp);
    if (m > std::numeric_limits<int>::max()) break;
    alt.micro_batches = static_cast<int>(m);
    if (fits(alt)) {
      out.push_back(absl::StrCat("PartitionOptions.tp = ", more, ", PartitionOptions.dp = ", alt.dp,
                                 ", PartitionOptions.micro_batches = ", m, " (same global batch)"));
      break;
    }
  }
  const int64_t min_devices = static_bytes / std::max<int64_t>(1, budget) +
                              (static_bytes % std::max<int64_t>(1, budget) != 0);
  if (out.empty()) {
    out.push_back(absl::StrCat(
        "weights, gradients and optimizer state alone need ", Bytes(static_bytes),
        ", i.e. at "
        "least ",
        min_devices, " pipeline stages of ", Bytes(budget), " (", S,
        " now): use more devices, more device memory, bf16/fp16 weights or a smaller model"));
  }
  return out;
}

}  // namespace pipewright
