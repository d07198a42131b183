// Hugging Face interop (checkpoint.h, docs/checkpoint.md "Hugging Face"): a GPT checkpoint as a
// transformers GPT2LMHeadModel directory, a Llama one as a LlamaForCausalLM directory, and back.
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
#include "absl/strings/str_join.h"
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

// A new directory `out` with config.json and model.safetensors.
absl::Status WriteHfDirectory(const std::string& out, const json& config,
                              const NamedTensors& tensors) {
  PW_RETURN_IF_ERROR(FreshDirectory(out, /*create=*/true));
  {
    std::ofstream f(out + "/config.json");
    f << config.dump(2) << "\n";
    if (!f) return absl::DataLossError(absl::StrCat(out, "/config.json: write failed"));
  }
  return WriteSafetensors(out + "/model.safetensors", tensors, {{"format", "pt"}});
}

// The run seed an imported checkpoint records: the one given, else the one an export recorded,
// else train's default (1).
uint64_t ImportSeed(const json& hf, std::optional<uint64_t> seed) {
  if (seed) return *seed;
  if (hf.contains("pipewright") && hf["pipewright"].is_object()) {
    return hf["pipewright"].value("seed", uint64_t{1});
  }
  return 1;
}

// ---- Llama (docs/models.md): transformers' LlamaForCausalLM ----
//
// Our fused products are row blocks of theirs: self_attn.qkv = q_proj | k_proj | v_proj and
// mlp.gate_up = gate_proj | up_proj, every weight [out, in] in both. The rotary convention is
// transformers' own (rotate_half), so q and k need no permutation.
struct LlamaPart {
  std::string ours;
  int64_t row = 0, rows = -1;  // the row block of `ours` (-1: all)
  std::string hf;
};

std::vector<LlamaPart> LlamaParts(const LlamaConfig& c) {
  const int64_t C = c.hidden, K = c.kv_heads * (c.hidden / c.heads), F = c.ffn;
  std::vector<LlamaPart> parts = {{"embed.wte.weight", 0, -1, "model.embed_tokens.weight"}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string o = absl::StrCat("blocks.", i, "."),
                      h = absl::StrCat("model.layers.", i, ".");
    for (const char* norm : {"input_layernorm", "post_attention_layernorm"}) {
      parts.push_back({absl::StrCat(o, norm, ".weight"), 0, -1, absl::StrCat(h, norm, ".weight")});
    }
    const std::string qkv = absl::StrCat(o, "self_attn.qkv.weight");
    parts.push_back({qkv, 0, C, absl::StrCat(h, "self_attn.q_proj.weight")});
    parts.push_back({qkv, C, K, absl::StrCat(h, "self_attn.k_proj.weight")});
    parts.push_back({qkv, C + K, K, absl::StrCat(h, "self_attn.v_proj.weight")});
    parts.push_back({absl::StrCat(o, "self_attn.o_proj.weight"), 0, -1,
                     absl::StrCat(h, "self_attn.o_proj.weight")});
    const std::string gate_up = absl::StrCat(o, "mlp.gate_up.weight");
    parts.push_back({gate_up, 0, F, absl::StrCat(h, "mlp.gate_proj.weight")});
    parts.push_back({gate_up, F, F, absl::StrCat(h, "mlp.up_proj.weight")});
    parts.push_back(
        {absl::StrCat(o, "mlp.down_proj.weight"), 0, -1, absl::StrCat(h, "mlp.down_proj.weight")});
  }
  parts.push_back({"norm.weight", 0, -1, "model.norm.weight"});
  if (!c.tied) parts.push_back({"lm_head.weight", 0, -1, "lm_head.weight"});
  return parts;
}

// Rows [row, row + rows) of a host f32 tensor (all rows when rows < 0) as a new tensor.
absl::StatusOr<Tensor> Rows(const Tensor& t, int64_t row, int64_t rows) {
  if (rows < 0) return t;
  const int64_t width = t.numel() / std::max<int64_t>(1, t.dim(0));
  PW_ASSIGN_OR_RETURN(Tensor v, t.View(row * width, {rows, width}));
  return v.Clone();
}

absl::Status ExportLlama(const Checkpoint& ck, const LayerGraph& graph, const LlamaConfig& c,
                         uint64_t seed, const std::string& out) {
  NamedTensors tensors;
  for (const LlamaPart& p : LlamaParts(c)) {
    auto it = ck.model.find(p.ours);
    if (it == ck.model.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(ck.path, "/model.safetensors: tensor '", p.ours, "' missing"));
    }
    PW_ASSIGN_OR_RETURN(Tensor t, Rows(it->second, p.row, p.rows));
    tensors.emplace_back(p.hf, std::move(t));
  }
  // The fields transformers' LlamaConfig reads, set to what this model computes.
  const json config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", c.vocab},
      {"hidden_size", c.hidden},
      {"intermediate_size", c.ffn},
      {"num_hidden_layers", c.layers},
      {"num_attention_heads", c.heads},
      {"num_key_value_heads", c.kv_heads},
      {"head_dim", c.hidden / c.heads},
      {"max_position_embeddings", c.seq},
      {"rms_norm_eps", c.eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"attention_dropout", 0.0},
      {"initializer_range", 0.02},
      {"pretraining_tp", 1},
      {"tie_word_embeddings", c.tied},
      {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},
      {"use_cache", true},
      {"torch_dtype", "float32"},
      {"pipewright",
       {{"model", graph.name()}, {"fingerprint", graph.Fingerprint()}, {"seed", seed}}}};
  return WriteHfDirectory(out, config, tensors);
}

// `hf` (a config.json with model_type llama) into a step-0 checkpoint of `spec` (a Llama preset
// or spec) with the file's tying.
absl::Status ImportLlama(const json& hf, const std::string& in, const std::string& spec,
                         const std::string& out, std::optional<uint64_t> seed) {
  const std::string where = in + "/config.json";
  PW_ASSIGN_OR_RETURN(LayerGraph base, ModelFromSpec(spec, 0));
  PW_ASSIGN_OR_RETURN(LlamaConfig c, LlamaConfigOf(base));
  if (hf.value("hidden_act", "silu") != "silu" || hf.value("attention_bias", false) ||
      hf.value("mlp_bias", false) || !hf.value("rope_scaling", json()).is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ": hidden_act silu, no attention or MLP biases and no rope_scaling "
                     "are what this model computes"));
  }
  const int64_t layers = hf.at("num_hidden_layers").get<int64_t>(),
                hidden = hf.at("hidden_size").get<int64_t>(),
                heads = hf.at("num_attention_heads").get<int64_t>(),
                kv = hf.value("num_key_value_heads", heads),
                ffn = hf.at("intermediate_size").get<int64_t>(),
                vocab = hf.at("vocab_size").get<int64_t>(),
                positions = hf.value("max_position_embeddings", int64_t{0});
  const double theta = hf.value("rope_theta", 10000.0), eps = hf.value("rms_norm_eps", 1e-6);
  if (layers != c.layers || hidden != c.hidden || heads != c.heads || kv != c.kv_heads ||
      ffn != c.ffn || vocab != c.vocab || positions < c.seq ||
      std::abs(theta - c.rope_theta) > 1e-9 * c.rope_theta ||
      std::abs(eps - static_cast<double>(c.eps)) > 1e-3 * static_cast<double>(c.eps) ||
      hf.value("head_dim", hidden / std::max<int64_t>(1, heads)) != hidden / heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": num_hidden_layers=", layers, ", hidden_size=", hidden,
        ", num_attention_heads=", heads, ", num_key_value_heads=", kv, ", intermediate_size=", ffn,
        ", vocab_size=", vocab, ", max_position_embeddings=", positions, ", rope_theta=", theta,
        ", rms_norm_eps=", eps, " does not fit ", spec, " (", ModelSpecName(c), ")"));
  }
  const bool tied = hf.value("tie_word_embeddings", false);
  std::string name = base.name();
  if (tied != c.tied) {
    c.tied = tied;
    name = ModelSpecName(c);
  }
  PW_ASSIGN_OR_RETURN(LayerGraph graph, LlamaModel(name, c, base.shape().batch));
  PW_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(in + "/model.safetensors"));
  TrainOptions options;
  options.seed = ImportSeed(hf, seed);
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(graph, 1, options));
  std::map<std::string, Parameter*> params;
  for (Parameter* p : trainer->Parameters()) params[p->name] = p;
  for (const LlamaPart& part : LlamaParts(c)) {
    auto it = file.tensors.find(part.hf);
    if (it == file.tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(in, "/model.safetensors: tensor '", part.hf, "' missing"));
    }
    Tensor v = it->second;
    if (v.dtype() != DType::kF32) {  // bf16 / f16 files are widened exactly
      PW_ASSIGN_OR_RETURN(v, ops::Cast(ops::Exec{}, v, DType::kF32));
    }
    Parameter* p = params.at(part.ours);
    const int64_t width = p->value.rank() == 2 ? p->value.dim(1) : p->value.numel();
    const int64_t rows = part.rows < 0 ? (p->value.rank() == 2 ? p->value.dim(0) : 1) : part.rows;
    const std::vector<int64_t> want =
        p->value.rank() == 2 ? std::vector<int64_t>{rows, width} : p->value.shape();
    if (v.shape() != want) {
      return absl::InvalidArgumentError(absl::StrCat(in, "/model.safetensors: tensor '", part.hf,
                                                     "' is ", v.ShapeString(), ", expected [",
                                                     absl::StrJoin(want, ", "), "]"));
    }
    std::copy_n(v.data<float>(), v.numel(), p->value.data<float>() + part.row * width);
  }
  PW_RETURN_IF_ERROR(FreshDirectory(out, /*create=*/false));
  return trainer->Save(out);
}

}  // namespace

absl::Status ExportHuggingFace(const std::string& checkpoint, const std::string& out) {
  PW_ASSIGN_OR_RETURN(auto read, internal::ReadCheckpointAndGraph(checkpoint));
  auto& [ck, graph] = read;
  const json manifest = json::parse(ck.manifest_json, nullptr, false);
  uint64_t seed = 0;
  if (manifest.is_object() && manifest.contains("rng") && manifest["rng"].is_object()) {
    seed = manifest["rng"].value("seed", uint64_t{0});
  }
  absl::StatusOr<GptConfig> gpt = GptConfigOf(graph);
  if (!gpt.ok()) {
    if (absl::StatusOr<LlamaConfig> llama = LlamaConfigOf(graph); llama.ok()) {
      return ExportLlama(ck, graph, *llama, seed, out);
    }
    return absl::InvalidArgumentError(
        absl::StrCat(checkpoint, ": model '", graph.name(),
                     "' is neither a GPT nor a Llama model; the Hugging Face format holds those"));
  }
  const GptConfig& c = *gpt;
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
  return WriteHfDirectory(out, config, tensors);
}

absl::Status ImportHuggingFace(const std::string& in, const std::string& preset,
                               const std::string& out, std::optional<uint64_t> seed) {
  // A manifest field of an unexpected JSON type makes nlohmann throw: an error, not a crash.
  try {
    PW_ASSIGN_OR_RETURN(json hf, ReadJsonFile(in + "/config.json"));
    const std::string where = in + "/config.json";
    if (hf.value("model_type", "") == "llama") return ImportLlama(hf, in, preset, out, seed);
    if (hf.value("model_type", "") != "gpt2") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": model_type is '", hf.value("model_type", ""),
                       "'; GPT-2 (gpt2) and Llama (llama) models are imported"));
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
    options.seed = ImportSeed(hf, seed);
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
