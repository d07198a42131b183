// The one check of what Partition is given (ValidatePartitionOptions, partitioner.h): every
// message names the field (Note [Field names in errors] in pipewright/train.h).
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "partitioner/partition_internal.h"
#include "pipewright/partitioner.h"

namespace pipewright {

absl::Status ValidatePartitionOptions(const ModelCosts& model, const DeviceSpec& dev,
                                      const PartitionOptions& o) {
  using internal::Bytes;
  if (model.num_layers() < 1) return absl::InvalidArgumentError("the model has no layers");
  if (dev.count < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceSpec.count = ", dev.count, ": must be >= 1"));
  }
  if (dev.memory_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceSpec.memory_bytes = ", dev.memory_bytes, ": must be > 0"));
  }
  if (dev.reserve_bytes < 0 || dev.reserve_bytes >= dev.memory_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceSpec.reserve_bytes (", Bytes(dev.reserve_bytes),
        ") must be >= 0 and below DeviceSpec.memory_bytes (", Bytes(dev.memory_bytes), ")"));
  }
  // (The times and rates are checked without their values: the CLI sets them in other units.)
  const std::pair<const char*, double> positive[] = {
      {"DeviceSpec.tflops", dev.tflops},
      {"DeviceSpec.link_bandwidth", dev.link_bandwidth},
      {"DeviceSpec.memory_bandwidth", dev.memory_bandwidth}};
  for (const auto& [field, x] : positive) {
    if (!(x > 0) || !std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrCat(field, " must be finite and > 0"));
    }
  }
  const std::pair<const char*, double> non_negative[] = {
      {"DeviceSpec.link_latency_s", dev.link_latency_s},
      {"DeviceSpec.layer_overhead_s", dev.layer_overhead_s}};
  for (const auto& [field, x] : non_negative) {
    if (!(x >= 0) || !std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrCat(field, " must be finite and >= 0"));
    }
  }
  if (o.pp < 1 || o.dp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("PartitionOptions.pp = ", o.pp,
                                                   " and PartitionOptions.dp = ", o.dp,
                                                   ": both must be >= 1"));
  }
  if (o.zero < 0 || o.zero > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("PartitionOptions.zero = ", o.zero, ": must be 0, 1 or 2"));
  }
  if (o.zero >= 1 && o.dp < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PartitionOptions.zero = ", o.zero, " splits the optimizer state",
        o.zero == 2 ? " and the gradients" : "", " over PartitionOptions.dp >= 2 replicas"));
  }
  if (absl::Status s = CheckTensorParallel(model, dev, o.tp, o.sequence_parallel); !s.ok()) {
    return s;
  }
  // pp x dp fits an int64 (two ints); a product that overflows is no device count either.
  int64_t devices = 0;
  if (__builtin_mul_overflow(int64_t{o.pp} * o.dp, int64_t{o.tp}, &devices)) devices = -1;
  if (o.tp == 1 && devices != dev.count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PartitionOptions.pp = ", o.pp, " x PartitionOptions.dp = ", o.dp, " = ",
        int64_t{o.pp} * o.dp, " ranks, but there are ", dev.count, " devices (DeviceSpec.count)"));
  }
  if (devices != dev.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("PartitionOptions.pp = ", o.pp, " x PartitionOptions.dp = ", o.dp,
                     " x PartitionOptions.tp = ", o.tp, " = ",
                     devices < 0 ? std::string("more than 2^63") : absl::StrCat(devices),
                     " devices, but there are ", dev.count, " (DeviceSpec.count)"));
  }
  if (o.micro_batch_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PartitionOptions.micro_batch_size = ", o.micro_batch_size,
                     ": must be >= 1 (0: the model's)"));
  }
  return absl::OkStatus();
}

}  // namespace pipewright
