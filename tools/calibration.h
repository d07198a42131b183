// Plan calibration from the command line (Note [Calibration] in partitioner/calibrate.cc):
// `train --calibrate-out MODEL.json` writes the model's costs calibrated to the run, and `plan
// --calibrate RUN.json` calibrates the model it plans from to the `train --json` output of a run.
#ifndef PIPEWRIGHT_TOOLS_CALIBRATION_H_
#define PIPEWRIGHT_TOOLS_CALIBRATION_H_

#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/statusor.h"
#include "pipewright/partitioner.h"
#include "pipewright/plan.h"

namespace pipewright::tools {

// The largest `train --json` output `plan --calibrate` reads (one line per step: about 200
// bytes each, so a million steps).
inline constexpr int64_t kMaxRunOutputBytes = int64_t{256} << 20;

// The last {"summary": ...} line of a `train --json` output (or a file holding only that line).
absl::StatusOr<nlohmann::json> ReadRunSummary(const std::string& path);

// `model` calibrated to the run a summary describes: its schedule (regenerated from the summary's
// kind, pp, micro-batches and chunks, or `ran` when given: a hand-written program), stage
// boundaries, recompute, micro-batch size, precision, ZeRO stage and replica 0's per-stage times
// and per-rank peaks. `where` names the summary's source in errors (a file, or "the run").
// InvalidArgument when the summary lacks a field, is for another model (name or layer count),
// or ran no step.
absl::StatusOr<ModelCosts> CalibrateFromSummary(const ModelCosts& model,
                                                const nlohmann::json& summary,
                                                const std::string& where,
                                                const Schedule* ran = nullptr);

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_CALIBRATION_H_
