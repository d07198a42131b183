#include "runtime/train_state.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "pipewright/input.h"
#include "pipewright/tensor_parallel.h"

namespace pipewright::internal {
namespace {
using json = nlohmann::json;
constexpr char kCheckpointFormat[] = "pipewright.checkpoint/v1";
const char* OptimizerName(OptimizerKind k) { return k == OptimizerKind::kAdamW ? "adamw" : "sgd"; }
}  // namespace

std::string BuildManifest(const ManifestInfo& info) {
  const LayerGraph& graph = *info.graph;
  const TrainOptions& options = *info.options;
  json m;
  m["format"] = kCheckpointFormat;
  m["model"] = {{"name", graph.name()},
                {"fingerprint", graph.Fingerprint()},
                {"num_layers", graph.num_layers()},
                {"micro_batch_size", graph.shape().batch},
                {"seq_len", graph.shape().seq_len}};
  // A preset or a spec ("llama:…", ModelFromSpec) rebuilds itself from its name.
  absl::StatusOr<LayerGraph> preset = ModelFromSpec(graph.name(), graph.shape().batch);
  if (preset.ok() && preset->Fingerprint() == graph.Fingerprint()) {
    m["model"]["preset"] = graph.name();
  }
  json layers = json::array();
  for (const LayerNode& n : graph.nodes()) {
    layers.push_back({{"name", n.name}, {"kind", n.spec->kind()}, {"config", n.spec->Config()}});
  }
  m["model"]["layers"] = std::move(layers);
  // The architecture, so a checkpoint of any GPT is self-describing (eval, export).
  if (absl::StatusOr<GptConfig> c = GptConfigOf(graph); c.ok()) {
    m["model"]["gpt"] = {{"layers", c->layers}, {"hidden", c->hidden}, {"heads", c->heads},
                         {"seq", c->seq},       {"vocab", c->vocab},   {"tied", c->tied}};
  }
  // (The layout only describes the run: tensors are whole, any layout resumes them.)
  m["plan"] = {{"pipeline_parallel", info.pp},
               {"data_parallel", info.dp},
               {"tensor_parallel", info.tp},
               {"sequence_parallel", info.sequence_parallel},
               {"schedule", info.schedule},
               {"chunks", info.chunks},
               {"micro_batches", info.layout.micro_batches},
               {"micro_batch_size", info.layout.micro_batch_size},
               {"global_batch", info.layout.global_batch()}};
  m["step"] = info.step;
  const OptimizerConfig& oc = options.optimizer;
  m["optimizer"] = {{"kind", OptimizerName(oc.kind)},
                    {"step", info.optimizer_step},
                    {"beta1", oc.beta1},
                    {"beta2", oc.beta2},
                    {"eps", oc.eps},
                    {"momentum", oc.momentum},
                    {"weight_decay", oc.weight_decay}};
  m["lr_schedule"] = {{"peak", info.lr.peak},
                      {"warmup_steps", info.lr.warmup_steps},
                      {"total_steps", info.lr.total_steps},
                      {"min_ratio", info.lr.min_ratio}};
  m["rng"] = {{"seed", options.seed}};
  m["precision"] = {{"compute", PrecisionName(options.precision)}};
  if (info.scaler != nullptr && info.scaler->enabled()) {
    m["precision"]["loss_scale"] = {{"scale", info.scaler->scale()},
                                    {"good_steps", info.scaler->good_steps()},
                                    {"skipped_steps", info.scaler->skipped_steps()}};
  }
  if (options.grad_compression.enabled()) {
    m["grad_sync"] = {{"compression", GradCompressionName(options.grad_compression)},
                      {"data_parallel", info.dp},
                      {"tensor_parallel", info.tp}};
  }
  m["data"] = {{"source", info.data_source},
               {"next_step", info.step},
               {"next_sample", info.step * info.layout.global_batch()}};
  return m.dump(2);
}

namespace {

// A data source as the resume compares it: its kind and size, not its path ("text:PATH (N
// bytes)" -> "text: (N bytes)"), without a benchmark delay.
std::string DataIdentity(const std::string& source) {
  std::string s = source;
  if (size_t plus = s.find(" + "); plus != std::string::npos) s.resize(plus);
  const size_t colon = s.find(':'), paren = s.rfind(" (");
  if (colon != std::string::npos && paren != std::string::npos && paren > colon) {
    s.erase(colon + 1, paren - colon - 1);
  }
  return s;
}

std::string Num(double v) { return absl::StrFormat("%.6g", v); }

// The settings of `run` that differ from the manifest's, as warnings (CheckManifest).
void CompareSettings(const json& m, const ResumePoint& at, const RunSettings& run,
                     const std::string& where, std::vector<std::string>* warnings) {
  auto number = [](const json& obj, const char* key, double fallback) {
    return obj.is_object() && obj.contains(key) && obj[key].is_number() ? obj[key].get<double>()
                                                                        : fallback;
  };
  // A float from the manifest, converted only when it fits one (a damaged 1e300 does not).
  auto real = [&](const json& obj, const char* key, float fallback) {
    const double v = number(obj, key, fallback);
    return std::isfinite(v) && std::abs(v) <= FLT_MAX ? static_cast<float>(v) : fallback;
  };
  // A count from the manifest, converted only when it fits (a damaged 1e300 is not a count).
  auto count = [&](const json& obj, const char* key, int64_t fallback) {
    const double v = number(obj, key, static_cast<double>(fallback));
    return v >= -9.0e18 && v <= 9.0e18 ? static_cast<int64_t>(v) : fallback;
  };
  // The learning-rate schedule: what the rate at the resumed step was and is now.
  if (m.contains("lr_schedule") && m["lr_schedule"].is_object()) {
    const json& l = m["lr_schedule"];
    LrSchedule was;
    was.peak = real(l, "peak", run.lr.peak);
    was.warmup_steps = count(l, "warmup_steps", run.lr.warmup_steps);
    was.total_steps = count(l, "total_steps", run.lr.total_steps);
    was.min_ratio = real(l, "min_ratio", run.lr.min_ratio);
    std::vector<std::string> changed;
    auto cmp = [&](const char* name, double a, double b) {
      if (a != b) changed.push_back(absl::StrCat(name, " ", Num(a), " -> ", Num(b)));
    };
    cmp("total steps", was.total_steps, run.lr.total_steps);
    cmp("peak", was.peak, run.lr.peak);
    cmp("warm-up steps", was.warmup_steps, run.lr.warmup_steps);
    cmp("minimum ratio", was.min_ratio, run.lr.min_ratio);
    if (!changed.empty()) {
      warnings->push_back(absl::StrCat(
          where, ": the learning-rate schedule differs from the checkpoint's (",
          absl::StrJoin(changed, ", "), "): the rate at step ", at.step, " is ",
          Num(run.lr.At(at.step)), " where the checkpoint's run had ", Num(was.At(at.step))));
    }
  }
  if (m.contains("optimizer") && m["optimizer"].is_object()) {
    const json& o = m["optimizer"];
    std::vector<std::string> changed;
    auto cmp = [&](const char* key, float now) {
      const float was = real(o, key, now);
      if (was != now) {
        changed.push_back(absl::StrCat(key, " ", Num(was), " -> ", Num(now)));
      }
    };
    cmp("beta1", run.optimizer.beta1);
    cmp("beta2", run.optimizer.beta2);
    cmp("eps", run.optimizer.eps);
    cmp("momentum", run.optimizer.momentum);
    cmp("weight_decay", run.optimizer.weight_decay);
    if (!changed.empty()) {
      warnings->push_back(absl::StrCat(where, ": optimizer settings differ from the checkpoint's (",
                                       absl::StrJoin(changed, ", "), ")"));
    }
  }
  if (m.contains("precision") && m["precision"].is_object() &&
      m["precision"].value("compute", std::string()) != PrecisionName(run.precision)) {
    warnings->push_back(absl::StrCat(where, ": precision ",
                                     m["precision"].value("compute", std::string("?")), " -> ",
                                     PrecisionName(run.precision)));
  }
  if (m.contains("data") && m["data"].is_object() && m["data"].contains("source") &&
      m["data"]["source"].is_string()) {
    const std::string was = m["data"]["source"].get<std::string>();
    if (DataIdentity(was) != DataIdentity(run.data_source)) {
      warnings->push_back(absl::StrCat(where, ": the checkpoint was trained on ", was,
                                       "; this run reads ", run.data_source,
                                       ": it continues on other data"));
    }
  }
  // Note [Resume across dp]: the replicas' gradients are summed in another grouping at another
  // dp (or micro-batching), so the continuation agrees with an uninterrupted run only to fp32
  // rounding.
  if (m.contains("plan") && m["plan"].is_object()) {
    const json& p = m["plan"];
    const int64_t dp = count(p, "data_parallel", run.layout.replicas);
    const int64_t mb = count(p, "micro_batches", run.layout.micro_batches);
    const int64_t b = count(p, "micro_batch_size", run.layout.micro_batch_size);
    if (dp != run.layout.replicas || mb != run.layout.micro_batches ||
        b != run.layout.micro_batch_size) {
      warnings->push_back(absl::StrCat(
          where, ": written at dp ", dp, " x ", mb, " micro-batches of ", b, ", resumed at dp ",
          run.layout.replicas, " x ", run.layout.micro_batches, " of ", run.layout.micro_batch_size,
          ": the same global batch, but gradients are summed in another order, so the losses "
          "agree with an uninterrupted run to fp32 rounding, not bit for bit"));
    }
  }
}

absl::StatusOr<ResumePoint> CheckManifestFields(const std::string& dir,
                                                const std::string& manifest_json,
                                                const LayerGraph& graph, const BatchLayout& layout,
                                                OptimizerKind optimizer, const RunSettings* run) {
  PW_RETURN_IF_ERROR(CheckJsonNesting(manifest_json, absl::StrCat(dir, "/manifest.json")));
  json m = json::parse(manifest_json, nullptr, false);
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/manifest.json: ", what));
  };
  if (m.is_discarded() || !m.is_object()) return bad("not valid JSON");
  if (m.value("format", "") != kCheckpointFormat)
    return bad("format is not pipewright.checkpoint/v1");
  if (!m.contains("model") || !m["model"].is_object() ||
      m["model"].value("fingerprint", "") != graph.Fingerprint()) {
    return bad(absl::StrCat("model.fingerprint does not match this model (", graph.name(), ")"));
  }
  if (!m.contains("data") || !m["data"].is_object() || !m["data"].contains("next_sample") ||
      !m["data"]["next_sample"].is_number_integer() || !m.contains("step") ||
      !m["step"].is_number_integer()) {
    return bad("step or data.next_sample missing");
  }
  ResumePoint r;
  r.step = m["step"].get<int64_t>();
  // A step beyond what the sample counter can hold is damage, not a position (and step x global
  // batch would overflow).
  if (m["step"].is_number_unsigned() && m["step"].get<uint64_t>() > uint64_t{INT64_MAX})
    r.step = -1;
  if (r.step < 0 || r.step > INT64_MAX / std::max<int64_t>(1, layout.global_batch())) {
    return bad(absl::StrCat("step ", m["step"].dump(), " is out of range"));
  }
  if (m["data"]["next_sample"].get<int64_t>() != r.step * layout.global_batch()) {
    return bad(absl::StrCat("data position ", m["data"]["next_sample"].get<int64_t>(),
                            " does not match step ", r.step, " x global batch ",
                            layout.global_batch(), " (resume with the same global batch)"));
  }
  if (!m.contains("optimizer") || !m["optimizer"].is_object() ||
      m["optimizer"].value("kind", std::string()) != OptimizerName(optimizer)) {
    return bad("optimizer.kind differs from this run's optimizer");
  }
  const json& step = m["optimizer"].contains("step") ? m["optimizer"]["step"] : m["step"];
  if (!step.is_number_integer() || step.get<int64_t>() < 0 ||
      (step.is_number_unsigned() && step.get<uint64_t>() > uint64_t{INT64_MAX})) {
    return bad("optimizer.step is not a non-negative integer");
  }
  r.optimizer_step = step.get<int64_t>();
  if (m.contains("precision") && m["precision"].is_object() &&
      m["precision"].contains("loss_scale")) {
    const json& ls = m["precision"]["loss_scale"];
    if (!ls.is_object() || !ls.contains("scale") || !ls["scale"].is_number() ||
        !(ls["scale"].get<double>() > 0) || !(ls["scale"].get<double>() <= FLT_MAX) ||
        !ls.contains("good_steps") || !ls["good_steps"].is_number_integer() ||
        ls["good_steps"].get<int64_t>() < 0 || !ls.contains("skipped_steps") ||
        !ls["skipped_steps"].is_number_integer() || ls["skipped_steps"].get<int64_t>() < 0) {
      return bad(
          "precision.loss_scale needs a positive finite fp32 scale and non-negative integer "
          "good_steps and "
          "skipped_steps");
    }
    r.has_loss_scale = true;
    r.loss_scale = ls["scale"].get<float>();
    r.loss_scale_good_steps = ls["good_steps"].get<int64_t>();
    r.skipped_steps = ls["skipped_steps"].get<int64_t>();
  }
  if (m.contains("grad_sync")) {
    const json& gs = m["grad_sync"];
    if (!gs.is_object() || !gs.contains("compression") || !gs["compression"].is_string() ||
        !gs.contains("data_parallel") || !gs["data_parallel"].is_number_integer() ||
        gs["data_parallel"].get<int64_t>() < 1 || gs["data_parallel"].get<int64_t>() > INT32_MAX) {
      return bad("grad_sync needs a compression name and a positive integer data_parallel");
    }
    r.grad_compression = gs["compression"].get<std::string>();
    r.grad_sync_dp = gs["data_parallel"].get<int>();
    // Absent before tensor parallelism: 1.
    if (gs.contains("tensor_parallel")) {
      const json& tp = gs["tensor_parallel"];
      if (!tp.is_number_integer() || tp.get<int64_t>() < 1 || tp.get<int64_t>() > INT32_MAX) {
        return bad("grad_sync.tensor_parallel must be a positive integer");
      }
      r.grad_sync_tp = tp.get<int>();
    }
  }
  if (run != nullptr) {
    // The seed picks every sample (data.h): another one would continue on another sample order.
    if (m.contains("rng") && m["rng"].is_object() && m["rng"].contains("seed")) {
      const json& seed = m["rng"]["seed"];
      if (!seed.is_number_unsigned() || seed.get<uint64_t>() != run->seed) {
        return bad(absl::StrCat("rng.seed is ", seed.dump(), ", this run's seed is ", run->seed,
                                ": the samples of every step depend on it (resume with seed ",
                                seed.dump(), ")"));
      }
    }
    CompareSettings(m, r, *run, absl::StrCat(dir, "/manifest.json"), &r.warnings);
  }
  return r;
}

}  // namespace

absl::StatusOr<ResumePoint> CheckManifest(const std::string& dir, const std::string& manifest_json,
                                          const LayerGraph& graph, const BatchLayout& layout,
                                          OptimizerKind optimizer, const RunSettings* run) {
  // A field of an unexpected JSON type makes nlohmann throw (found by tests/runtime/fuzz_test.cc):
  // a malformed manifest is an error naming the file, never a crash.
  try {
    return CheckManifestFields(dir, manifest_json, graph, layout, optimizer, run);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/manifest.json: malformed (", e.what(), ")"));
  }
}

void RestoreLossScaler(const ResumePoint& at, LossScaler* scaler) {
  if (at.has_loss_scale && scaler->enabled()) {
    scaler->Restore(at.loss_scale, at.loss_scale_good_steps, at.skipped_steps);
  }
}

absl::Status CheckParameters(const std::string& dir, const std::map<std::string, Tensor>& tensors,
                             const std::vector<Parameter*>& params) {
  for (Parameter* p : params) {
    const std::string& name = StoredName(*p);  // a tied copy loads its owner
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/model.safetensors: tensor '", name, "' missing"));
    }
    // A tensor-parallel part loads its part of the whole tensor.
    const std::vector<int64_t> whole = WholeShape(*p);
    if (it->second.shape() != whole || it->second.dtype() != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/model.safetensors: tensor '", name, "' is ", it->second.ShapeString(),
                       ", expected [", absl::StrJoin(whole, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pipewright::internal
