// The one check of TrainOptions and of TrainTestingHooks (train.h, train_testing.h; Note [Field
// names in errors] in train.h): every message names the field a C++ caller set.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "pipewright/status.h"
#include "pipewright/train.h"
#include "pipewright/train_testing.h"

namespace pipewright {
namespace {

// ThreadPool's limit (kernels/cpu/parallel.h).
constexpr int kMaxThreadsPerRank = 255;
constexpr int kMaxDataWorkers = 64;

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// Each field alone. (NaN fails every comparison: each test is written to be false for it.)
absl::Status CheckFields(const TrainOptions& o) {
  if (o.steps < 0) return Invalid(absl::StrCat("TrainOptions.steps = ", o.steps, ": must be >= 0"));
  if (!(o.lr > 0) || !std::isfinite(o.lr)) {
    return Invalid(absl::StrCat("TrainOptions.lr = ", o.lr, ": must be a finite number > 0"));
  }
  if (!(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1)) {
    return Invalid(absl::StrCat("TrainOptions.min_lr_ratio = ", o.min_lr_ratio,
                                ": must be a number in [0, 1]"));
  }
  if (!(o.clip_norm >= 0) || !std::isfinite(o.clip_norm)) {
    return Invalid(absl::StrCat("TrainOptions.clip_norm = ", o.clip_norm,
                                ": must be a finite number >= 0 (0: off)"));
  }
  if (!(o.optimizer.weight_decay >= 0) || !std::isfinite(o.optimizer.weight_decay)) {
    return Invalid(absl::StrCat("TrainOptions.optimizer.weight_decay = ", o.optimizer.weight_decay,
                                ": must be a finite number >= 0"));
  }
  if (o.warmup_steps < 0) {
    return Invalid(absl::StrCat("TrainOptions.warmup_steps = ", o.warmup_steps, ": must be >= 0"));
  }
  if (o.base_batch < 1) {
    return Invalid(absl::StrCat("TrainOptions.base_batch = ", o.base_batch, ": must be >= 1"));
  }
  if (o.precision == Precision::kFp16) PW_RETURN_IF_ERROR(LossScaler::Validate(o.loss_scale));
  if (o.bucket_bytes < 1) {
    // (Without "= value": the CLI sets it in MiB.)
    return Invalid(absl::StrCat("TrainOptions.bucket_bytes must be at least one byte (got ",
                                o.bucket_bytes, ")"));
  }
  if (o.threads_per_rank < 0 || o.threads_per_rank > kMaxThreadsPerRank) {
    return Invalid(absl::StrCat("TrainOptions.threads_per_rank = ", o.threads_per_rank,
                                ": must be in [0, ", kMaxThreadsPerRank, "] (0: automatic)"));
  }
  if (o.data_workers < 0 || o.data_workers > kMaxDataWorkers) {
    return Invalid(absl::StrCat("TrainOptions.data_workers = ", o.data_workers, ": must be in [0, ",
                                kMaxDataWorkers, "]"));
  }
  if (o.staleness < 0) {
    return Invalid(
        absl::StrCat("TrainOptions.staleness = ", o.staleness, ": must be >= 0 (0: lock-step)"));
  }
  if (o.zero < 0 || o.zero > 2) {
    return Invalid(absl::StrCat("TrainOptions.zero = ", o.zero, ": must be 0, 1 or 2"));
  }
  if (o.zero_buffers < 1 || o.zero_buffers > 2) {
    return Invalid(
        absl::StrCat("TrainOptions.zero_buffers = ", o.zero_buffers, ": must be 1 or 2"));
  }
  if (o.zero_buffers != 2 && o.zero != 2) {
    return Invalid(absl::StrCat("TrainOptions.zero_buffers = ", o.zero_buffers,
                                " sets ZeRO-2's gradient buffers: it needs TrainOptions.zero = 2 "
                                "(got ",
                                o.zero, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateTrainOptions(const TrainOptions& o, int data_parallel) {
  PW_RETURN_IF_ERROR(CheckFields(o));
  const std::string compression = GradCompressionName(o.grad_compression);
  if (o.grad_compression.enabled() && o.precision == Precision::kFp16) {
    // A skipped (overflowing) step would leave infinities in the error buffers, and a change of
    // loss scale would leave them in the wrong units.
    return Invalid(absl::StrCat("TrainOptions.grad_compression = ", compression,
                                " does not support TrainOptions.precision = fp16 (loss-scaled "
                                "gradients); use fp32 or bf16"));
  }
  if (o.dp_mode == DpMode::kAsync) {
    if (o.zero > 0) {
      return Invalid(absl::StrCat(
          "TrainOptions.zero = ", o.zero,
          " needs synchronous DP: under TrainOptions.dp_mode = async the owners already hold the "
          "optimizer state apart"));
    }
    if (o.grad_compression.enabled()) {
      return Invalid(absl::StrCat(
          "TrainOptions.dp_mode = async does not combine with TrainOptions.grad_compression = ",
          compression, ": the owners apply each replica's gradients as they come"));
    }
    if (o.precision == Precision::kFp16) {
      return Invalid(
          "TrainOptions.dp_mode = async does not support TrainOptions.precision = fp16 (the loss "
          "scale is agreed by all replicas every step); use fp32 or bf16");
    }
    if (data_parallel < 2) {
      return Invalid(
          "TrainOptions.dp_mode = async needs data parallelism (RunSpec.data_parallel >= 2): with "
          "one replica there is nothing to run asynchronously");
    }
  }
  if (o.grad_compression.enabled() && data_parallel < 2) {
    return Invalid(absl::StrCat(
        "TrainOptions.grad_compression = ", compression,
        " needs data parallelism (RunSpec.data_parallel >= 2): with one replica no gradients are "
        "exchanged"));
  }
  if (o.zero > 0 && data_parallel < 2) {
    return Invalid(absl::StrCat("TrainOptions.zero = ", o.zero,
                                " shards the optimizer state over the data-parallel replicas: it "
                                "needs RunSpec.data_parallel >= 2"));
  }
  if (o.zero > 0 && o.grad_compression.enabled()) {
    // A shard's sum comes from a reduce-scatter of fp32 buckets; the codecs replace the
    // all-reduce of whole buckets.
    return Invalid(absl::StrCat("TrainOptions.zero = ", o.zero,
                                " does not combine with TrainOptions.grad_compression = ",
                                compression, ": the shards are reduce-scattered in fp32"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTrainTestingHooks(const TrainTestingHooks& h, int data_parallel) {
  if (!(h.slow_factor >= 1) || !(h.slow_factor <= 1000)) {
    return Invalid(
        absl::StrCat("TrainTestingHooks.slow_factor = ", h.slow_factor, ": must be in [1, 1000]"));
  }
  if (h.slow_replica < -1 || h.slow_replica >= data_parallel) {
    return Invalid(absl::StrCat("TrainTestingHooks.slow_replica = ", h.slow_replica,
                                ": there are only ", data_parallel, " replicas (0 to ",
                                data_parallel - 1, "; -1: none)"));
  }
  return absl::OkStatus();
}

}  // namespace pipewright
