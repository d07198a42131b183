// Hugging Face interop (checkpoint.h, docs/checkpoint.md "Hugging Face"): a GPT checkpoint as a
// transformers GPT2LMHeadModel directory, and back.
//
// The model is GPT-2's (docs/checkpoint.md, "The model, exactly"): pre-LN blocks, tanh GELU
// ("gelu_new"), LayerNorm epsilon 1e-5, learned positions, attention scaled by 1/sqrt(D), no
// dropout in training here. Names map one to one; HF's Conv1D stores [in, out], the transpose of
// our Linear's [out, in], so qkv, attention and MLP projections are transposed on the way.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "pipewright/checkpoint.h"
#include "pipewright/input.h"
#include "pipewright/model.h"
#include "pipewright/ops.h"
#include "pipewright/train.h"
#include "runtime/train_state.h"

namespace pipewright {
namespace {

using json = nlohmann::json;

// One of our tensors and its Hugging Face name; `conv1d`: stored transposed there.
struct HfName {
  std::string ours, hf;
  bool conv1d = false;
};

std::vector<HfName> HfNames(const GptConfig& c) {
  std::vector<HfName> names = {{"embed.wte.weight", "transformer.wte.weight"},
                               {"embed.wpe.weight", "transformer.wpe.weight"}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string o = absl::StrCat("blocks.", i, "."),
                      h = absl::StrCat("transformer.h.", i, ".");
    for (const char* ln : {"ln_1", "ln_2"}) {
      names.push_back({absl::StrCat(o, ln, ".weight"), absl::StrCat(h, ln, ".weight")});
      names.push_back({absl::StrCat(o, ln, ".bias"), absl::StrCat(h, ln, ".bias")});
    }
    for (const auto& [ours, hf] : {std::pair<const char*, const char*>{"attn.qkv", "attn.c_attn"},
                                   {"attn.proj", "attn.c_proj"},
                                   {"mlp.fc", "mlp.c_fc"},
                                   {"mlp.proj", "mlp.c_proj"}}) {
      names.push_back({absl::StrCat(o, ours, ".weight"), absl::StrCat(h, hf, ".weight"), true});
      names.push_back({absl::StrCat(o, ours, ".bias"), absl::StrCat(h, hf, ".bias")});
    }
  }
  names.push_back({"ln_f.weight", "transformer.ln_f.weight"});
  names.push_back({"ln_f.bias", "transformer.ln_f.bias"});
  if (!c.tied) names.push_back({"lm_head.weight", "lm_head.weight"});
  return names;
}

// A host f32 [r, c] matrix as [c, r].
Tensor Transposed(const Tensor& t) {
  const int64_t r = t.dim(0), c = t.dim(1);
  Tensor out = Tensor::Empty({c, r}, DType::kF32);
  const float* s = t.data<float>();
  float* d = out.data<float>();
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < c; ++j) d[j * r + i] = s[i * c + j];
  }
  return out;
}

absl::StatusOr<json> ReadJsonFile(const std::string& path) {
  PW_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, "JSON file", kMaxJsonFileBytes));
  PW_RETURN_IF_ERROR(CheckJsonNesting(text, path));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  return j;
}

// An output directory that holds nothing yet (nothing is ever overwritten), made when `create`.
absl::Status FreshDirectory(const std::string& dir, bool create) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_empty(dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " already exists and is not empty; choose a new directory"));
  }
  if (!create) return absl::OkStatus();
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": cannot create (", ec.message(), ")"));
  return absl::OkStatus();
}

}  // namespace

absl::Status ExportHuggingFace(const std::string& checkpoint, const std::string& out) {
  PW_ASSIGN_OR_RETURN(auto read, internal::ReadCheckpointAndGraph(checkpoint));
  auto& [ck, graph] = read;
  absl::StatusOr<GptConfig> gpt = GptConfigOf(graph);
  if (!gpt.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(checkpoint, ": model '", graph.name(),
                     "' is not a GPT; the Hugging Face format holds GPTs only"));
  }
  const GptConfig& c = *gpt;
  const json manifest = json::parse(ck.manifest_json, nullptr, false);
  uint64_t seed = 0;
  if (manifest.is_object() && manifest.contains("rng") && manifest["rng"].is_object()) {
    seed = manifest["rng"].value("seed", uint64_t{0});
  }
  NamedTensors tensors;
  for (const HfName& n : HfNames(c)) {
    auto it = ck.model.find(n.ours);
    if (it == ck.model.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(ck.path, "/model.safetensors: tensor '", n.ours, "' missing"));
    }
    tensors.emplace_back(n.hf, n.conv1d ? Transposed(it->second) : it->second);
  }
  // The fields transformers' GPT2Config reads, set to what this model computes.
  json config = {{"architectures", {"GPT2LMHeadModel"}},
                 {"model_type", "gpt2"},
                 {"vocab_size", c.vocab},
                 {"n_positions", c.seq},
                 {"n_ctx", c.seq},
                 {"n_embd", c.hidden},
                 {"n_layer", c.layers},
                 {"n_head", c.heads},
                 {"n_inner", nullptr},
                 {"activation_function", "gelu_new"},
                 {"layer_norm_epsilon", 1e-5},
                 {"resid_pdrop", 0.0},
                 {"embd_pdrop", 0.0},
                 {"attn_pdrop", 0.0},
                 {"initializer_range", 0.02},
                 {"scale_attn_weights", true},
                 {"scale_attn_by_inverse_layer_idx", false},
                 {"reorder_and_upcast_attn", false},
                 {"tie_word_embeddings", c.tied},
                 // GPT-2's end-of-text token where the vocabulary has it; none for bytes.
                 {"bos_token_id", c.vocab > 50256 ? json(50256) : json(nullptr)},
                 {"eos_token_id", c.vocab > 50256 ? json(50256) : json(nullptr)},
                 {"use_cache", true},
                 {"torch_dtype", "float32"},
                 // Where it came from; import takes the run's seed (its data order) back.
                 {"pipewright",
                  {{"model", graph.name()}, {"fingerprint", graph.Fingerprint()}, {"seed", seed}}}};
  PW_RETURN_IF_ERROR(FreshDirectory(out, /*create=*/true));
  {
    std::ofstream f(out + "/config.json");
    f << config.dump(2) << "\n";
    if (!f) return absl::DataLossError(absl::StrCat(out, "/config.json: write failed"));
  }
  return WriteSafetensors(out + "/model.safetensors", tensors, {{"format", "pt"}});
}

absl::Status ImportHuggingFace(const std::string& in, const std::string& preset,
                               const std::string& out, std::optional<uint64_t> seed) {
  // A manifest field of an unexpected JSON type makes nlohmann throw: an error, not a crash.
  try {
    PW_ASSIGN_OR_RETURN(json hf, ReadJsonFile(in + "/config.json"));
    const std::string where = in + "/config.json";
    if (hf.value("model_type", "") != "gpt2") {
      return absl::InvalidArgumentError(absl::StrCat(where, ": model_type is '",
                                                     hf.value("model_type", ""),
                                                     "'; only GPT-2 models (gpt2) are imported"));
    }
    const std::string act = hf.value("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
      return absl::InvalidArgumentError(absl::StrCat(where, ": activation_function '", act,
                                                     "'; this model computes the tanh GELU"));
    }
    if (std::abs(hf.value("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12 ||
        !hf.value("scale_attn_weights", true) ||
        hf.value("scale_attn_by_inverse_layer_idx", false) ||
        !hf.value("n_inner", json()).is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where,
          ": layer_norm_epsilon 1e-5, scale_attn_weights, no inverse-layer scaling and "
          "n_inner null (4 x n_embd) are what this model computes"));
    }
    PW_ASSIGN_OR_RETURN(GptConfig c, PresetGptConfig(preset));
    c.tied = hf.value("tie_word_embeddings", true);
    const int64_t hf_vocab = hf.at("vocab_size").get<int64_t>();
    const int64_t hf_positions = hf.at("n_positions").get<int64_t>();
    const int64_t layers = hf.at("n_layer").get<int64_t>(), hidden = hf.at("n_embd").get<int64_t>(),
                  heads = hf.at("n_head").get<int64_t>();
    if (layers != c.layers || hidden != c.hidden || heads != c.heads || hf_positions < c.seq ||
        hf_vocab > c.vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": n_layer=", layers, ", n_embd=", hidden, ", n_head=", heads,
          ", n_positions=", hf_positions, ", vocab_size=", hf_vocab, " does not fit preset '",
          preset, "' (layers=", c.layers, ", hidden=", c.hidden, ", heads=", c.heads,
          ", seq <= n_positions: ", c.seq, ", vocab >= vocab_size: ", c.vocab, ")"));
    }
    PW_ASSIGN_OR_RETURN(LayerGraph base, PresetModel(preset, 0));
    PW_ASSIGN_OR_RETURN(LayerGraph graph, GptModel(preset, c, base.shape().batch));
    PW_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(in + "/model.safetensors"));
    // GPT2Model's files have no "transformer." prefix; GPT2LMHeadModel's do.
    auto find = [&](const std::string& name) -> const Tensor* {
      for (const std::string& n : {name, std::string(absl::StripPrefix(name, "transformer."))}) {
        auto it = file.tensors.find(n);
        if (it != file.tensors.end()) return &it->second;
      }
      return nullptr;
    };
    TrainOptions options;
    options.seed = 1;  // train's default
    if (seed) {
      options.seed = *seed;
    } else if (hf.contains("pipewright") && hf["pipewright"].is_object()) {
      options.seed = hf["pipewright"].value("seed", options.seed);
    }
    PW_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(graph, 1, options));
    std::map<std::string, Parameter*> params;
    for (Parameter* p : trainer->Parameters()) params[p->name] = p;
    for (const HfName& n : HfNames(c)) {
      const Tensor* t = find(n.hf);
      if (t == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(in, "/model.safetensors: tensor '", n.hf, "' missing"));
      }
      Tensor v = *t;
      if (v.dtype() != DType::kF32) {  // bf16 / f16 files are widened exactly
        PW_ASSIGN_OR_RETURN(v, ops::Cast(ops::Exec{}, v, DType::kF32));
      }
      if (n.conv1d && v.rank() == 2) v = Transposed(v);
      Parameter* p = params.at(n.ours);
      const std::vector<int64_t>& want = p->value.shape();
      // The vocabulary may be padded (GPT-2's 50257 rows into 50304, zeros) and positions cut to
      // the preset's sequence length.
      const bool rows_differ = v.rank() == 2 && want.size() == 2 && v.dim(1) == want[1] &&
                               (n.ours == "embed.wte.weight" || n.ours == "lm_head.weight"
                                    ? v.dim(0) <= want[0]
                                    : n.ours == "embed.wpe.weight" && v.dim(0) >= want[0]);
      if (v.shape() != want && !rows_differ) {
        return absl::InvalidArgumentError(absl::StrCat(in, "/model.safetensors: tensor '", n.hf,
                                                       "' is ", v.ShapeString(), ", expected ",
                                                       p->value.ShapeString()));
      }
      p->value.SetZero();
      const int64_t count = std::min(v.numel(), p->value.numel());
      std::copy_n(v.data<float>(), count, p->value.data<float>());
    }
    PW_RETURN_IF_ERROR(FreshDirectory(out, /*create=*/false));
    return trainer->Save(out);  // a step-0 checkpoint: Engine::Resume starts from it
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(in, "/config.json: a field is missing or of the wrong type (", e.what(), ")"));
  }
}

}  // namespace pipewright
