// Model costs calibrated to a measured run (partitioner.h, CalibrateModelCosts).
//
// Note [Calibration]. The planner predicts a stage's time from FLOPs and a device's throughput
// (or from `model --profile`'s per-layer times, measured one layer at a time on an idle
// machine) and its memory from each layer's saved bytes. A run measures what those became on
// this machine with this schedule: each virtual stage's mean F and B (or I + W) per
// micro-batch, and each rank's peak memory. Calibration writes them back into the layers:
//  - time: within a stage, every layer keeps its predicted share of the stage's time, and the
//    shares are scaled so that they sum to the measured forward (backward) time; the result is
//    the layers' forward_time_s / backward_time_s, as a profile would give them;
//  - memory: a rank's measured peak less its predicted weights, gradients and optimizer state
//    (which are exact counts) is what its activations and transient buffers took; every layer on
//    that rank has its activation_bytes (and selective_saving_bytes) scaled by the same factor,
//    so that the rank's predicted peak under this schedule equals the measured one.
// A plan of the same configuration then predicts the measured stage times and peaks; a plan of
// another split or depth redistributes the measured per-layer figures. What a run adds beyond
// its stages' compute (P2P waits, the agreement, CPU contention between ranks sharing cores) is
// not in the stage times, so it is not predicted; docs/benchmarks.md, "Plan calibration",
// measures how close the calibrated predictions come.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/partitioner.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

bool PositiveFinite(double v) { return std::isfinite(v) && v > 0; }

// bytes x factor rounded, saturating at kMemoryOverflow (a hostile peak must not wrap).
int64_t ScaleBytes(int64_t bytes, double factor) {
  const double v = static_cast<double>(bytes) * factor;
  if (!(v < static_cast<double>(kMemoryOverflow))) return kMemoryOverflow;
  return v <= 0 ? 0 : static_cast<int64_t>(std::llround(v));
}

}  // namespace

absl::StatusOr<ModelCosts> CalibrateModelCosts(const ModelCosts& model, const DeviceSpec& dev,
                                               const RunMeasurement& run) {
  if (run.micro_batch_size < 1 || run.micro_batch_size > kMaxCalibrationMicroBatchSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunMeasurement.micro_batch_size = ", run.micro_batch_size,
                     ": must be in [1, ", kMaxCalibrationMicroBatchSize, "]"));
  }
  const Schedule& sched = run.schedule;
  const int S = sched.num_stages, L = model.num_layers();
  const int ranks = static_cast<int>(sched.programs.size());
  if (static_cast<int>(run.boundaries.size()) != S + 1 || run.boundaries.front() != 0 ||
      run.boundaries.back() != L) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunMeasurement.boundaries: expected ", S + 1, " layer indices from 0 to ", L,
                     " (the model's layers), one more than the schedule's ", S, " stages"));
  }
  for (int s = 0; s < S; ++s) {
    if (run.boundaries[s] >= run.boundaries[s + 1]) {
      return absl::InvalidArgumentError(absl::StrCat("RunMeasurement.boundaries: stage ", s,
                                                     " has no layers (they must increase)"));
    }
  }
  if (static_cast<int>(run.stage_forward_s.size()) != S ||
      static_cast<int>(run.stage_backward_s.size()) != S ||
      static_cast<int>(run.recompute.size()) != S) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RunMeasurement: stage_forward_s, stage_backward_s and recompute need one entry per "
        "stage (",
        S, ")"));
  }
  if (static_cast<int>(run.rank_peak_bytes.size()) != ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunMeasurement.rank_peak_bytes: ", run.rank_peak_bytes.size(),
                     " entries for ", ranks, " pipeline ranks"));
  }
  ModelCosts out = model.WithMicroBatchSize(run.micro_batch_size);
  const double flops_per_s = dev.tflops * 1e12;
  if (!PositiveFinite(flops_per_s)) {
    return absl::InvalidArgumentError("DeviceSpec.tflops must be positive and finite");
  }
  for (int s = 0; s < S; ++s) {
    const double fm = run.stage_forward_s[s], bm = run.stage_backward_s[s];
    if (!PositiveFinite(fm) || !PositiveFinite(bm)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", s, ": measured forward ", fm, " s and backward ", bm,
          " s per micro-batch must be positive and finite (a stage that never ran cannot be "
          "calibrated)"));
    }
    // Each layer's predicted time (what the planner would use), then its share of the stage's.
    double fsum = 0, bsum = 0;
    std::vector<double> f, b;
    for (int i = run.boundaries[s]; i < run.boundaries[s + 1]; ++i) {
      const LayerCost& l = out.layers[i];
      f.push_back(l.forward_time_s ? *l.forward_time_s
                                   : l.forward_flops / flops_per_s + dev.layer_overhead_s);
      b.push_back(l.backward_time_s ? *l.backward_time_s
                                    : l.backward_flops / flops_per_s + dev.layer_overhead_s);
      fsum += f.back();
      bsum += b.back();
    }
    for (int i = run.boundaries[s], k = 0; i < run.boundaries[s + 1]; ++i, ++k) {
      LayerCost& l = out.layers[i];
      const double n = run.boundaries[s + 1] - run.boundaries[s];
      l.forward_time_s = fsum > 0 ? fm * f[k] / fsum : fm / n;
      l.backward_time_s = bsum > 0 ? bm * b[k] / bsum : bm / n;
    }
  }
  // Memory: the predicted per-rank split at the run's micro-batch size, then each rank's factor.
  PW_ASSIGN_OR_RETURN(
      std::vector<RankMemory> predicted,
      PredictRankMemory(out, sched, run.boundaries, run.recompute, run.param_bytes, run.sharding));
  for (const RankMemory& r : predicted) {
    const int64_t fixed = r.memory.params + r.memory.grads + r.memory.optimizer;
    const int64_t measured = run.rank_peak_bytes[r.rank];
    if (measured <= 0 || r.memory.activations <= 0) continue;  // nothing to scale by
    // Never below zero: a rank whose peak is under its fixed state keeps its layers' bytes.
    const double factor =
        measured > fixed ? static_cast<double>(measured - fixed) / r.memory.activations : 1.0;
    for (int s : r.stages) {
      for (int i = run.boundaries[s]; i < run.boundaries[s + 1]; ++i) {
        LayerCost& l = out.layers[i];
        l.activation_bytes = ScaleBytes(l.activation_bytes, factor);
        l.selective_saving_bytes =
            std::min(l.activation_bytes, ScaleBytes(l.selective_saving_bytes, factor));
      }
    }
  }
  return out;
}

}  // namespace pipewright
