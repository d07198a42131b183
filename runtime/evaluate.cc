// Evaluation of a checkpoint on held-out data (train.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "pipewright/checkpoint.h"
#include "pipewright/model.h"
#include "pipewright/run_memory.h"
#include "pipewright/train.h"

namespace pipewright {
namespace {

using json = nlohmann::json;

// The manifest alone (the tensors are not read).
absl::StatusOr<json> ReadManifest(const std::string& checkpoint) {
  PW_ASSIGN_OR_RETURN(const std::string dir, ResolveCheckpointDir(checkpoint));
  std::ifstream in(dir + "/manifest.json");
  if (!in) return absl::NotFoundError(absl::StrCat(dir, "/manifest.json cannot be opened"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  json m = json::parse(text, nullptr, false);
  if (m.is_discarded() || !m.is_object() || !m.contains("model") || !m["model"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/manifest.json: model missing"));
  }
  return m;
}

// Bytes of the tensor files of the checkpoint ReadCheckpoint(dir) would read first (the
// sizes on disk; 0 when there is none: ReadCheckpoint then says why).
int64_t CheckpointTensorBytes(const std::string& dir) {
  absl::StatusOr<std::string> resolved = ResolveCheckpointDir(dir);
  if (!resolved.ok()) return 0;
  std::error_code ec;
  int64_t bytes = 0;
  // increment(ec), not a range-for: iterating must not throw.
  for (std::filesystem::directory_iterator it(*resolved, ec), end; !ec && it != end;
       it.increment(ec)) {
    std::error_code size_ec;
    if (it->path().extension() != ".safetensors" || !it->is_regular_file(size_ec)) continue;
    const uintmax_t size = it->file_size(size_ec);
    if (!size_ec) bytes += static_cast<int64_t>(std::min<uintmax_t>(size, INT64_MAX - bytes));
  }
  return bytes;
}

}  // namespace

absl::StatusOr<LayerGraph> CheckpointPresetModel(const std::string& dir) {
  // A manifest field of an unexpected JSON type makes nlohmann throw: an error, not a crash.
  try {
    PW_ASSIGN_OR_RETURN(json m, ReadManifest(dir));
    const json& model = m["model"];
    const std::string name = model.value("name", "");
    if (model.contains("gpt") && model["gpt"].is_object()) {  // a GPT: rebuilt from its shape
      const json& a = model["gpt"];
      const GptConfig c{.layers = a.at("layers").get<int64_t>(),
                        .hidden = a.at("hidden").get<int64_t>(),
                        .heads = a.at("heads").get<int64_t>(),
                        .seq = a.at("seq").get<int64_t>(),
                        .vocab = a.at("vocab").get<int64_t>(),
                        .tied = a.at("tied").get<bool>()};
      PW_RETURN_IF_ERROR(CheckGptConfig(c, absl::StrCat(dir, "/manifest.json: model.gpt")));
      const int64_t micro_batch_size = model.value("micro_batch_size", int64_t{1});
      // Its costs at that micro-batch size within 64 bits (GptModelCosts checks) before the
      // graph computes them.
      if (absl::Status s = GptModelCosts(name, c, micro_batch_size).status(); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(dir, "/manifest.json: model.micro_batch_size: ", s.message()));
      }
      absl::StatusOr<LayerGraph> graph = GptModel(name, c, micro_batch_size);
      if (!graph.ok() || graph->Fingerprint() != model.value("fingerprint", "")) {
        return absl::InvalidArgumentError(absl::StrCat(
            dir, "/manifest.json: model.gpt does not rebuild the model of model.fingerprint"));
      }
      return graph;
    }
    if (!model.contains("preset") || !model["preset"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir, " holds the custom model '", name,
          "' (not a preset): build its LayerGraph and call EvaluateCheckpoint(graph, dir, data, "
          "batches) from C++"));
    }
    PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetModel(model["preset"].get<std::string>(),
                                                      model.value("micro_batch_size", int64_t{0})));
    if (model.value("fingerprint", "") != graph.Fingerprint()) {
      return absl::InvalidArgumentError(absl::StrCat(dir,
                                                     "/manifest.json: fingerprint does not "
                                                     "match preset '",
                                                     model["preset"].get<std::string>(), "'"));
    }
    return graph;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/manifest.json: malformed (", e.what(), ")"));
  }
}

absl::StatusOr<EvalResult> EvaluateCheckpoint(const LayerGraph& graph, const std::string& dir,
                                              const Dataset& data, int64_t batches) {
  // A manifest field of an unexpected JSON type makes nlohmann throw: an error, not a crash.
  try {
    if (batches < 1) return absl::InvalidArgumentError("--batches must be >= 1");
    // Before anything is read or allocated: the whole model, one micro-batch and the
    // checkpoint's tensors must fit this process (run_memory.h).
    PW_RETURN_IF_ERROR(CheckEvaluationMemory(graph, data.Spec(), batches,
                                             CheckpointTensorBytes(dir), ThisHostMemory()));
    PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir));
    json m = json::parse(ck.manifest_json, nullptr, false);
    if (m.is_discarded() || !m.contains("model") || !m["model"].is_object() ||
        m["model"].value("fingerprint", "") != graph.Fingerprint()) {
      return absl::InvalidArgumentError(
          absl::StrCat(ck.path, "/manifest.json: model.fingerprint does not match this model (",
                       graph.name(), ")"));
    }
    PW_ASSIGN_OR_RETURN(auto stage, graph.Instantiate(0, graph.num_layers(), 0));
    for (Parameter* p : stage->Parameters()) {
      auto it = ck.model.find(p->name);
      if (it == ck.model.end() || it->second.shape() != p->value.shape() ||
          it->second.dtype() != DType::kF32) {
        return absl::InvalidArgumentError(absl::StrCat(ck.path, "/model.safetensors: tensor '",
                                                       p->name, "' missing or misshapen"));
      }
      std::copy_n(it->second.data<float>(), it->second.numel(), p->value.data<float>());
    }
    BatchLayout layout{1, graph.shape().batch, graph.shape().seq_len, 1};
    constexpr int64_t kHeldOutStep = int64_t{1} << 40;  // far from any training step
    double sum = 0;
    std::vector<Tensor> inputs, targets;
    for (int64_t i = 0; i < batches; ++i) {
      StepBatch b = MakeStepBatch(data, layout, kHeldOutStep / layout.global_batch() + i, 0);
      LayerContext ctx{nullptr, &b.targets[0]};
      std::vector<Saved> saved;
      PW_ASSIGN_OR_RETURN(Tensor loss, stage->Forward(b.inputs[0], ctx, &saved));
      sum += loss.data<float>()[0];
      inputs.push_back(b.inputs[0]);
      targets.push_back(b.targets[0]);
    }
    EvalResult r;
    r.inputs = std::move(inputs);
    r.targets = std::move(targets);
    r.loss = sum / batches;
    r.perplexity = std::exp(r.loss);
    r.tokens = batches * layout.global_batch() * layout.seq_len;
    r.model = graph.name();
    r.step = m.value("step", int64_t{0});
    return r;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/manifest.json: malformed (", e.what(), ")"));
  }
}

absl::StatusOr<EvalResult> EvaluateCheckpoint(const std::string& dir, const std::string& data,
                                              int64_t batches) {
  // A manifest field of an unexpected JSON type makes nlohmann throw: an error, not a crash.
  try {
    if (batches < 1) return absl::InvalidArgumentError("--batches must be >= 1");
    PW_ASSIGN_OR_RETURN(LayerGraph graph, CheckpointPresetModel(dir));
    PW_ASSIGN_OR_RETURN(json m, ReadManifest(dir));
    const uint64_t seed = m.contains("rng") ? m["rng"].value("seed", uint64_t{0}) : 0;
    PW_ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> ds,
                        OpenDataset(data, graph.shape().seq_len, seed));
    PW_RETURN_IF_ERROR(CheckVocabulary(*ds, 256));  // the presets are byte-level
    return EvaluateCheckpoint(graph, dir, *ds, batches);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/manifest.json: malformed (", e.what(), ")"));
  }
}

}  // namespace pipewright
