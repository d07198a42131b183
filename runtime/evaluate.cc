// Evaluation of a checkpoint on held-out data (train.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "pipewright/checkpoint.h"
#include "pipewright/device.h"
#include "pipewright/input.h"
#include "pipewright/model.h"
#include "pipewright/run_memory.h"
#include "pipewright/train.h"
#include "runtime/generate.h"
#include "runtime/train_state.h"

namespace pipewright {
namespace {

using json = nlohmann::json;

// The integer `key` of `obj` (`fallback` when absent and given): a JSON integer within int64, so
// a float or a huge number is an error, never an undefined conversion.
absl::StatusOr<int64_t> IntField(const json& obj, const char* key, const std::string& where,
                                 std::optional<int64_t> fallback = std::nullopt) {
  if (!obj.contains(key) && fallback) return *fallback;
  if (!obj.contains(key) || !obj[key].is_number_integer() ||
      (obj[key].is_number_unsigned() && obj[key].get<uint64_t>() > uint64_t{INT64_MAX})) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " is ",
                                                   obj.contains(key) ? obj[key].dump() : "missing",
                                                   ": expected an integer"));
  }
  return obj[key].get<int64_t>();
}

// The graph the manifest of the checkpoint at `path` describes: a GPT from model.gpt, else a
// preset from model.preset, checked by fingerprint. Errors name `path`/manifest.json.
absl::StatusOr<LayerGraph> GraphOfManifest(const std::string& path, const std::string& text) {
  const std::string where = absl::StrCat(path, "/manifest.json");
  // A manifest field of an unexpected JSON type makes nlohmann throw: an error, not a crash.
  try {
    PW_RETURN_IF_ERROR(CheckJsonNesting(text, where));
    json m = json::parse(text, nullptr, false);
    if (m.is_discarded() || !m.is_object() || !m.contains("model") || !m["model"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": model missing"));
    }
    const json& model = m["model"];
    const std::string name = model.value("name", "");
    if (model.contains("gpt") && model["gpt"].is_object()) {  // a GPT: rebuilt from its shape
      const json& a = model["gpt"];
      PW_ASSIGN_OR_RETURN(const int64_t layers, IntField(a, "layers", where + ": model.gpt"));
      PW_ASSIGN_OR_RETURN(const int64_t hidden, IntField(a, "hidden", where + ": model.gpt"));
      PW_ASSIGN_OR_RETURN(const int64_t heads, IntField(a, "heads", where + ": model.gpt"));
      PW_ASSIGN_OR_RETURN(const int64_t seq, IntField(a, "seq", where + ": model.gpt"));
      PW_ASSIGN_OR_RETURN(const int64_t vocab, IntField(a, "vocab", where + ": model.gpt"));
      const GptConfig c{.layers = layers,
                        .hidden = hidden,
                        .heads = heads,
                        .seq = seq,
                        .vocab = vocab,
                        .tied = a.at("tied").get<bool>()};
      // Every field in its range before anything is built (Note [GPT limits] in model.cc).
      PW_ASSIGN_OR_RETURN(const int64_t micro_batch_size,
                          IntField(model, "micro_batch_size", where + ": model", 1));
      PW_RETURN_IF_ERROR(CheckGptConfig(c, absl::StrCat(where, ": model.gpt"), micro_batch_size));
      absl::StatusOr<LayerGraph> graph = GptModel(name, c, micro_batch_size);
      if (!graph.ok() || graph->Fingerprint() != model.value("fingerprint", "")) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": model.gpt does not rebuild the model of model.fingerprint"));
      }
      return graph;
    }
    if (!model.contains("preset") || !model["preset"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " holds the custom model '", name,
          "' (not a preset): build its LayerGraph and call EvaluateCheckpoint(graph, dir, data, "
          "batches) from C++"));
    }
    PW_ASSIGN_OR_RETURN(const int64_t micro_batch_size,
                        IntField(model, "micro_batch_size", where + ": model", 0));
    PW_ASSIGN_OR_RETURN(LayerGraph graph,
                        ModelFromSpec(model["preset"].get<std::string>(), micro_batch_size));
    if (model.value("fingerprint", "") != graph.Fingerprint()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": fingerprint does not match preset '",
                                                     model["preset"].get<std::string>(), "'"));
    }
    return graph;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": malformed (", e.what(), ")"));
  }
}

// Bytes of the tensor files of the checkpoint ReadCheckpoint(dir) would try first (the sizes on
// disk; 0 when there is none: ReadCheckpoint then says why).
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

// Bytes of the tensors a checkpoint read holds.
int64_t LoadedBytes(const Checkpoint& ck) {
  int64_t bytes = 0;
  for (const auto* tensors : {&ck.model, &ck.optimizer, &ck.grad_sync}) {
    for (const auto& [name, t] : *tensors) bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

// The samples eval reads: byte-level tokens, input and next-token target.
SampleSpec TokenSpec(int64_t seq_len) { return {{seq_len}, DType::kI32, {seq_len}, DType::kI32}; }

// A fresh instance of every layer of `graph` holding the weights of `ck`, each parameter checked
// (f32, its shape). Errors name the checkpoint's file.
absl::StatusOr<std::unique_ptr<Stage>> LoadWeights(const LayerGraph& graph, const Checkpoint& ck) {
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Stage> stage, graph.Instantiate(0, graph.num_layers(), 0));
  for (Parameter* p : stage->Parameters()) {
    auto it = ck.model.find(p->name);
    if (it == ck.model.end() || it->second.shape() != p->value.shape() ||
        it->second.dtype() != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat(ck.path, "/model.safetensors: tensor '", p->name, "' missing or misshapen"));
    }
    std::copy_n(it->second.data<float>(), it->second.numel(), p->value.data<float>());
  }
  return stage;
}

// The loss of `graph`, instantiated as `stage` with the weights of `ck`, over `batches` of
// `data`.
absl::StatusOr<EvalResult> Evaluate(const LayerGraph& graph, Stage& stage, const Checkpoint& ck,
                                    const Dataset& data, int64_t batches) {
  BatchLayout layout{1, graph.shape().batch, graph.shape().seq_len, 1};
  constexpr int64_t kHeldOutStep = int64_t{1} << 40;  // far from any training step
  double sum = 0;
  std::vector<Tensor> inputs, targets;
  for (int64_t i = 0; i < batches; ++i) {
    StepBatch b = MakeStepBatch(data, layout, kHeldOutStep / layout.global_batch() + i, 0);
    LayerContext ctx{nullptr, &b.targets[0]};
    std::vector<Saved> saved;
    PW_ASSIGN_OR_RETURN(Tensor loss, stage.Forward(b.inputs[0], ctx, &saved));
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
  json m = json::parse(ck.manifest_json, nullptr, false);
  r.step = m.is_object() && m.contains("step") && m["step"].is_number_integer()
               ? m["step"].get<int64_t>()
               : 0;
  r.path = ck.path;
  r.warnings = ck.warnings;
  return r;
}

}  // namespace

namespace internal {

absl::StatusOr<std::pair<Checkpoint, LayerGraph>> ReadCheckpointAndGraph(const std::string& dir) {
  std::optional<LayerGraph> graph;
  auto accept = [&](const Checkpoint& ck) -> absl::Status {
    PW_ASSIGN_OR_RETURN(graph, GraphOfManifest(ck.path, ck.manifest_json));
    return absl::OkStatus();
  };
  PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir, nullptr, accept));
  return std::make_pair(std::move(ck), *std::move(graph));
}

}  // namespace internal

absl::StatusOr<LayerGraph> CheckpointPresetModel(const std::string& dir) {
  PW_ASSIGN_OR_RETURN(auto read, internal::ReadCheckpointAndGraph(dir));
  return std::move(read.second);
}

absl::StatusOr<EvalResult> EvaluateWeights(
    const LayerGraph& graph, const std::vector<std::pair<std::string, Tensor>>& weights,
    const Dataset& data, int64_t batches, std::unique_ptr<Stage>* stage) {
  if (batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("EvaluateWeights: batches = ", batches, ": must be >= 1"));
  }
  const SampleSpec spec = data.Spec();
  if (spec.input_shape.empty() || spec.input_shape[0] != graph.shape().seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EvaluateWeights: the data (", data.Describe(), ") does not give sequences of ",
        graph.shape().seq_len, ", the length ", graph.name(), " was staged for"));
  }
  std::unique_ptr<Stage> local;
  if (stage == nullptr) stage = &local;
  if (*stage == nullptr) {
    PW_ASSIGN_OR_RETURN(*stage, graph.Instantiate(0, graph.num_layers(), 0));
  }
  for (Parameter* p : (*stage)->Parameters()) {
    const Tensor* w = nullptr;
    for (const auto& [name, t] : weights) {
      if (name == p->name) w = &t;
    }
    if (w == nullptr || w->shape() != p->value.shape() || w->dtype() != DType::kF32 ||
        !w->device().is_cpu()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "EvaluateWeights: weight '", p->name, "' missing, misshapen or not an f32 host tensor"));
    }
    std::copy_n(w->data<float>(), w->numel(), p->value.data<float>());
  }
  Checkpoint none;
  none.manifest_json = "{}";
  return Evaluate(graph, **stage, none, data, batches);
}

absl::StatusOr<EvalResult> EvaluateCheckpoint(const LayerGraph& graph, const std::string& dir,
                                              const Dataset& data, int64_t batches) {
  if (batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("EvaluateCheckpoint: batches = ", batches, ": must be >= 1"));
  }
  std::unique_ptr<Stage> stage;
  auto accept = [&](const Checkpoint& ck) -> absl::Status {
    json m = json::parse(ck.manifest_json, nullptr, false);
    if (m.is_discarded() || !m.is_object() || !m.contains("model") || !m["model"].is_object() ||
        !m["model"].contains("fingerprint") || !m["model"]["fingerprint"].is_string() ||
        m["model"]["fingerprint"].get<std::string>() != graph.Fingerprint()) {
      return absl::InvalidArgumentError(
          absl::StrCat(ck.path, "/manifest.json: model.fingerprint does not match this model (",
                       graph.name(), ")"));
    }
    PW_ASSIGN_OR_RETURN(stage, LoadWeights(graph, ck));
    return absl::OkStatus();
  };
  // Before anything is read or allocated: the whole model, one micro-batch and the checkpoint's
  // tensors must fit this process (run_memory.h).
  PW_RETURN_IF_ERROR(CheckEvaluationMemory(graph, data.Spec(), batches, CheckpointTensorBytes(dir),
                                           ThisHostMemory()));
  PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir, nullptr, accept));
  return Evaluate(graph, *stage, ck, data, batches);
}

namespace {

// A checkpoint's model instantiated with its weights.
struct LoadedCheckpoint {
  Checkpoint ck;
  std::optional<LayerGraph> graph;
  std::unique_ptr<Stage> stage;
};

// The newest checkpoint of `dir` whose model this runtime can rebuild, instantiated with its
// weights: one that fails (a model this runtime cannot rebuild, a misshapen tensor) is skipped
// for an older one. Before any tensor is read, the model the first checkpoint describes, with
// its tensor files and `batches` micro-batches, must fit this process (run_memory.h); each one
// read is checked again before it is built.
absl::StatusOr<LoadedCheckpoint> LoadCheckpointModel(const std::string& dir, int64_t batches) {
  LoadedCheckpoint out;
  auto accept = [&](const Checkpoint& ck) -> absl::Status {
    PW_ASSIGN_OR_RETURN(out.graph, GraphOfManifest(ck.path, ck.manifest_json));
    PW_RETURN_IF_ERROR(CheckEvaluationMemory(*out.graph, TokenSpec(out.graph->shape().seq_len),
                                             batches, LoadedBytes(ck), ThisHostMemory()));
    PW_ASSIGN_OR_RETURN(out.stage, LoadWeights(*out.graph, ck));
    return absl::OkStatus();
  };
  if (absl::StatusOr<std::string> first = ResolveCheckpointDir(dir); first.ok()) {
    absl::StatusOr<std::string> text = ReadCheckpointManifest(dir);
    absl::StatusOr<LayerGraph> g =
        text.ok() ? GraphOfManifest(*first, *text) : absl::StatusOr<LayerGraph>(text.status());
    if (g.ok()) {
      PW_RETURN_IF_ERROR(CheckEvaluationMemory(*g, TokenSpec(g->shape().seq_len), batches,
                                               CheckpointTensorBytes(dir), ThisHostMemory()));
    }
  }
  PW_ASSIGN_OR_RETURN(out.ck, ReadCheckpoint(dir, nullptr, accept));
  return out;
}

int64_t ManifestStep(const std::string& manifest_json) {
  json m = json::parse(manifest_json, nullptr, false);
  return m.is_object() && m.contains("step") && m["step"].is_number_integer()
             ? m["step"].get<int64_t>()
             : 0;
}

}  // namespace

absl::StatusOr<EvalResult> EvaluateCheckpoint(const std::string& dir, const std::string& data,
                                              int64_t batches) {
  if (batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("EvaluateCheckpoint: batches = ", batches, ": must be >= 1"));
  }
  PW_ASSIGN_OR_RETURN(LoadedCheckpoint loaded, LoadCheckpointModel(dir, batches));
  const Checkpoint& ck = loaded.ck;
  const std::optional<LayerGraph>& graph = loaded.graph;
  json m = json::parse(ck.manifest_json, nullptr, false);
  uint64_t seed = 0;
  if (m.is_object() && m.contains("rng") && m["rng"].is_object() && m["rng"].contains("seed") &&
      m["rng"]["seed"].is_number_unsigned()) {
    seed = m["rng"]["seed"].get<uint64_t>();
  }
  PW_ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> ds,
                      OpenDataset(data, graph->shape().seq_len, seed));
  PW_RETURN_IF_ERROR(CheckVocabulary(*ds, 256));  // the presets are byte-level
  return Evaluate(*graph, *loaded.stage, ck, *ds, batches);
}

absl::StatusOr<GenerateResult> GenerateFromCheckpoint(
    const std::string& dir, const GenerateOptions& o,
    const std::function<void(const std::string&)>& emit) {
  PW_RETURN_IF_ERROR(internal::CheckGenerateOptions(o));
  PW_ASSIGN_OR_RETURN(LoadedCheckpoint m, LoadCheckpointModel(dir, 1));
  if (!m.graph.has_value() || m.stage == nullptr) {  // (LoadCheckpointModel's accept sets both)
    return absl::InternalError(absl::StrCat(dir, ": checkpoint read without its model"));
  }
  const LayerGraph& graph = *m.graph;
  const int L = graph.num_layers();
  const int64_t T = graph.shape().seq_len;
  // A language model over byte tokens: [B, T] i32 in, then layers up to [B, T, V] logits, then
  // the loss.
  const std::vector<int64_t> logits_shape = L >= 2 ? graph.node(L - 2).spec->OutputShape([&] {
    std::vector<int64_t> at = {1, T};
    for (int i = 0; i < L - 2; ++i) at = graph.node(i).spec->OutputShape(at);
    return at;
  }())
                                                   : std::vector<int64_t>{};
  if (logits_shape.size() != 3 || logits_shape[2] < 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        m.ck.path, ": model ", graph.name(),
        " is not a byte-level language model (its next-to-last layer must give [B, T, V] "
        "logits with V >= 256), so there is nothing to generate from"));
  }
  const int64_t V = logits_shape[2];
  // On a GPU: a stream, its allocator and the model instantiated there with the weights read
  // (declared in this order so that they are destroyed in the reverse one).
  std::unique_ptr<CudaStream> stream;
  std::unique_ptr<Allocator> gpu;
  std::unique_ptr<Stage> on_gpu;
  Stage* stage = m.stage.get();
  if (o.device.is_cuda()) {
    const int gpus = CudaDeviceCount();
    if (o.device.index >= gpus) {
      return absl::FailedPreconditionError(
          absl::StrCat("GenerateOptions.device = ", o.device.ToString(), ": this machine has ",
                       gpus, " usable GPU", gpus == 1 ? "" : "s"));
    }
    PW_RETURN_IF_ERROR(SetCudaDevice(o.device.index));
    PW_ASSIGN_OR_RETURN(CudaStream s, CudaStream::Create(o.device));
    stream = std::make_unique<CudaStream>(std::move(s));
    PW_ASSIGN_OR_RETURN(gpu, CreateCudaAllocator(o.device.index, stream->get()));
    PW_ASSIGN_OR_RETURN(on_gpu, graph.Instantiate(0, L, 0, gpu.get()));
    const std::vector<Parameter*> from = m.stage->Parameters(), to = on_gpu->Parameters();
    if (from.size() != to.size()) {
      return absl::InternalError("generate: the model's parameters differ on the GPU");
    }
    for (size_t i = 0; i < from.size(); ++i)
      PW_RETURN_IF_ERROR(to[i]->value.CopyFrom(from[i]->value));
    PW_RETURN_IF_ERROR(stream->Synchronize());
    stage = on_gpu.get();
  }
  GenerateResult r;
  r.device = o.device.is_cpu() ? "cpu" : o.device.ToString();
  r.model = graph.name();
  r.path = m.ck.path;
  r.step = ManifestStep(m.ck.manifest_json);
  r.warnings = m.ck.warnings;
  PW_RETURN_IF_ERROR(internal::Generate(*stage, L - 1, T, V, o, emit, &r, nullptr, gpu.get()));
  return r;
}

}  // namespace pipewright
