// `pipewright bench --suite overhead` and `--suite scaling`: the real pipeline engine, measured.
//
// overhead: p = 4, m = 16, every schedule, over Delay layers that sleep a fixed time instead
//   of computing (so the ranks' threads do not compete for this machine's cores). The
//   simulator's makespan for the same nominal costs is what a zero-overhead runtime would
//   take; measured / predicted is the engine's overhead factor.
// scaling: gpt-small with real compute (one BLAS thread per rank) at pp = 1 and pp = 2 under
//   1F1B; the speedup against the ideal 2m / (m + 1) of a two-stage pipeline.
#ifndef PIPEWRIGHT_BENCH_PIPELINE_SUITE_H_
#define PIPEWRIGHT_BENCH_PIPELINE_SUITE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pipewright::bench {

struct OverheadRow {
  std::string schedule;
  int stages = 0, micro_batches = 0, chunks = 1;
  double measured_step_s = 0;   // median over the timed steps
  double predicted_step_s = 0;  // simulator makespan at the nominal delays
  double ratio = 0;             // measured / predicted
  double measured_bubble = 0, predicted_bubble = 0;
};

struct OverheadConfig {
  int stages = 4;
  int micro_batches = 16;
  double stage_seconds = 0.01;  // forward = input-gradient = weight-gradient time of a stage
  int steps = 3;                // timed steps (after one warm-up step)
};

absl::StatusOr<std::vector<OverheadRow>> RunOverheadSuite(const OverheadConfig& config);

struct ScalingRow {
  int stages = 0, micro_batches = 0;
  double step_s = 0;  // median over the timed steps
  double tokens_per_s = 0;
};

struct ScalingResult {
  std::vector<ScalingRow> rows;  // pp = 1, pp = 2
  double speedup = 0;            // step_s(pp=1) / step_s(pp=2)
  double ideal = 0;              // 2m / (m + 1)
  double efficiency = 0;         // speedup / ideal
};

absl::StatusOr<ScalingResult> RunScalingSuite(int micro_batches, int steps);

}  // namespace pipewright::bench

#endif  // PIPEWRIGHT_BENCH_PIPELINE_SUITE_H_
