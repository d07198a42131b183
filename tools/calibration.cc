// Plan calibration from the command line (calibration.h).
#include "tools/calibration.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "pipewright/input.h"
#include "pipewright/precision_kind.h"
#include "pipewright/status.h"
#include "tools/commands.h"

namespace pipewright::tools {

using json = nlohmann::json;

absl::StatusOr<json> ReadRunSummary(const std::string& path) {
  PW_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "--calibrate", kMaxRunOutputBytes));
  // The summary is the last line that holds one; JSON lines are parsed from the end.
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n', absl::SkipWhitespace());
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    if (it->size() > static_cast<size_t>(kMaxJsonFileBytes)) continue;
    // The parser recurses: a line nested too deep is refused before it sees it.
    PW_RETURN_IF_ERROR(CheckJsonNesting(*it, absl::StrCat("--calibrate ", path)));
    json j = json::parse(it->begin(), it->end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("summary") && j["summary"].is_object()) return j["summary"];
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--calibrate ", path,
                   ": no {\"summary\": ...} line; give the output of `pipewright train --json`"));
}

namespace {

// summary[key] as T, or InvalidArgument naming the file and the key.
template <typename T>
absl::StatusOr<T> Field(const json& j, const std::string& key, const std::string& where) {
  if (!j.contains(key)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the summary has no '", key, "'"));
  }
  const json& v = j[key];
  bool ok = false;
  if constexpr (std::is_same_v<T, std::string>) {
    ok = v.is_string();
  } else if constexpr (std::is_integral_v<T>) {
    ok = v.is_number_integer();
  } else if constexpr (std::is_floating_point_v<T>) {
    ok = v.is_number();
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    // Every element an integer that fits an int (get<> would truncate 4.5 or 2^40 silently).
    ok = v.is_array() && std::all_of(v.begin(), v.end(), [](const json& e) {
           return e.is_number_integer() && e.get<int64_t>() >= std::numeric_limits<int>::min() &&
                  (e.is_number_unsigned() ? e.get<uint64_t>() <= uint64_t{INT32_MAX}
                                          : e.get<int64_t>() <= INT32_MAX);
         });
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    ok = v.is_array() &&
         std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_number(); });
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    ok = v.is_array() &&
         std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); });
  } else {
    ok = v.is_array();
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": summary.", key, " has the wrong type (", v.type_name(), ")"));
  }
  if constexpr (std::is_integral_v<T>) {
    // get<T> would truncate silently: the value must fit T and not be negative.
    const bool fits =
        v.is_number_unsigned()
            ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
            : v.get<int64_t>() >= 0;
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": summary.", key, " = ", v.dump(),
                                                     ": must be in [0, ",
                                                     std::numeric_limits<T>::max(), "]"));
    }
  }
  try {
    return v.get<T>();
  } catch (const json::exception&) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": summary.", key, " is out of range (", v.dump(), ")"));
  }
}

}  // namespace

absl::StatusOr<ModelCosts> CalibrateFromSummary(const ModelCosts& model, const json& summary,
                                                const std::string& where, const Schedule* ran) {
  PW_ASSIGN_OR_RETURN(const std::string name, Field<std::string>(summary, "model", where));
  if (name != model.name) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the run trained '", name, "', not '", model.name, "'"));
  }
  PW_ASSIGN_OR_RETURN(const int64_t steps, Field<int64_t>(summary, "steps", where));
  if (steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the run took no step"));
  }
  RunMeasurement m;
  PW_ASSIGN_OR_RETURN(m.boundaries, Field<std::vector<int>>(summary, "stage_boundaries", where));
  PW_ASSIGN_OR_RETURN(m.micro_batch_size, Field<int64_t>(summary, "micro_batch_size", where));
  PW_ASSIGN_OR_RETURN(const int pp, Field<int>(summary, "pipeline_parallel", where));
  PW_ASSIGN_OR_RETURN(const int dp, Field<int>(summary, "data_parallel", where));
  // A tensor-parallel rank computes a part of each layer (and its collectives): its times are
  // not the whole layers' that the calibration writes back.
  if (summary.contains("tensor_parallel")) {
    PW_ASSIGN_OR_RETURN(const int tp, Field<int>(summary, "tensor_parallel", where));
    if (tp != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tensor_parallel ", tp,
                       ": a run at tp > 1 measures parts of layers; calibrate from a run at tp 1"));
    }
  }
  PW_ASSIGN_OR_RETURN(const int chunks, Field<int>(summary, "chunks", where));
  PW_ASSIGN_OR_RETURN(const int micro_batches, Field<int>(summary, "micro_batches", where));
  PW_ASSIGN_OR_RETURN(const int zero, Field<int>(summary, "zero", where));
  PW_ASSIGN_OR_RETURN(const std::string kind_name, Field<std::string>(summary, "schedule", where));
  PW_ASSIGN_OR_RETURN(const std::string precision_name,
                      Field<std::string>(summary, "precision", where));
  PW_ASSIGN_OR_RETURN(const std::vector<std::string> recompute,
                      Field<std::vector<std::string>>(summary, "stage_recompute", where));
  if (m.boundaries.empty() || m.boundaries.back() != model.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": the run's stages end at layer ", m.boundaries.empty() ? 0 : m.boundaries.back(),
        "; the model has ", model.num_layers(), " layers"));
  }
  if (ran != nullptr) {
    m.schedule = *ran;
  } else {
    absl::StatusOr<ScheduleKind> kind = ParseScheduleKind(kind_name);
    if (!kind.ok() || *kind == ScheduleKind::kCustom) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": schedule '", kind_name,
          "' cannot be regenerated (a hand-written program): calibrate with `train --program "
          "... --calibrate-out MODEL.json` instead"));
    }
    absl::StatusOr<Schedule> s = GenerateSchedule({*kind, pp, micro_batches, chunks});
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", s.status().message()));
    m.schedule = *std::move(s);
  }
  for (const std::string& r : recompute) {
    absl::StatusOr<Recompute> parsed = ParseRecompute(r);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": summary.stage_recompute: ", parsed.status().message()));
    }
    m.recompute.push_back(*parsed);
  }
  PW_ASSIGN_OR_RETURN(const Precision precision, ParsePrecision(precision_name));
  m.param_bytes = BytesPerParam(precision);
  m.sharding = ZeroSharding{zero, dp};
  const int S = m.schedule.num_stages;
  m.stage_forward_s.assign(S, 0);
  m.stage_backward_s.assign(S, 0);
  m.rank_peak_bytes.assign(m.schedule.programs.size(), 0);
  std::vector<bool> seen(S, false);
  PW_ASSIGN_OR_RETURN(const json ranks, Field<json>(summary, "ranks", where));
  for (const json& r : ranks) {
    // Replica 0's ranks: every replica runs the same stages.
    if (!r.is_object() || r.value("replica", -1) != 0) continue;
    const std::string at = absl::StrCat(where, ": summary.ranks[rank ", r.value("rank", -1), "]");
    PW_ASSIGN_OR_RETURN(const int pipe, Field<int>(r, "pipeline_rank", at));
    PW_ASSIGN_OR_RETURN(const std::vector<int> stages, Field<std::vector<int>>(r, "stages", at));
    PW_ASSIGN_OR_RETURN(const std::vector<double> f,
                        Field<std::vector<double>>(r, "stage_forward_s", at));
    PW_ASSIGN_OR_RETURN(const std::vector<double> b,
                        Field<std::vector<double>>(r, "stage_backward_s", at));
    PW_ASSIGN_OR_RETURN(const std::vector<double> w,
                        Field<std::vector<double>>(r, "stage_weight_s", at));
    PW_ASSIGN_OR_RETURN(const int64_t peak, Field<int64_t>(r, "peak_memory_bytes", at));
    if (pipe < 0 || pipe >= static_cast<int>(m.rank_peak_bytes.size()) ||
        f.size() != stages.size() || b.size() != stages.size() || w.size() != stages.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": its pipeline rank or per-stage times do not fit the schedule"));
    }
    m.rank_peak_bytes[pipe] = peak;
    for (size_t k = 0; k < stages.size(); ++k) {
      const int s = stages[k];
      if (s < 0 || s >= S) {
        return absl::InvalidArgumentError(absl::StrCat(at, ": stage ", s, " is not in the run"));
      }
      m.stage_forward_s[s] = f[k];
      m.stage_backward_s[s] = b[k] + w[k];
      seen[s] = true;
    }
  }
  for (int s = 0; s < S; ++s) {
    if (!seen[s]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": no rank of replica 0 reports stage ", s));
    }
  }
  DeviceSpec dev;  // only shares a stage's time among its layers (FLOPs + per-layer overhead)
  absl::StatusOr<ModelCosts> out = CalibrateModelCosts(model, dev, m);
  if (!out.ok())
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", out.status().message()));
  return out;
}

}  // namespace pipewright::tools
