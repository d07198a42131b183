// Model specs (model.h: ParseLlamaSpec, ModelSpecName, ModelFromSpec): one string names any
// model the command line can build — a preset, "gpt:…" or "llama:…" — and is the graph's name,
// so a plan or a checkpoint made from it rebuilds the model from its name alone.
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "pipewright/model.h"

namespace pipewright {
namespace {

constexpr char kLlamaKeys[] = "layers, hidden, heads, kv_heads, ffn, seq, vocab, tied, rope_theta";

// "k=v,k=v" into a map, every key among `known` and given once.
absl::StatusOr<std::map<std::string, std::string>> Pairs(absl::string_view spec,
                                                         const std::string& context,
                                                         const std::vector<std::string>& known,
                                                         const char* listing) {
  std::map<std::string, std::string> out;
  if (absl::StripAsciiWhitespace(spec).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": empty; expected key=value,… (keys: ", listing, ")"));
  }
  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    item = absl::StripAsciiWhitespace(item);
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": '", item, "' is not key=value"));
    }
    const std::string name(absl::StripAsciiWhitespace(item.substr(0, eq)));
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": unknown key '", name, "' (keys: ", listing, ")"));
    }
    if (!out.emplace(name, std::string(absl::StripAsciiWhitespace(item.substr(eq + 1)))).second) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": ", name, " given twice"));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<LlamaConfig> ParseLlamaSpec(absl::string_view spec) {
  const std::string context = absl::StrCat("Llama spec '", spec, "'");
  PW_ASSIGN_OR_RETURN(auto pairs, Pairs(spec, context,
                                        {"layers", "hidden", "heads", "kv_heads", "ffn", "seq",
                                         "vocab", "tied", "rope_theta"},
                                        kLlamaKeys));
  LlamaConfig c;
  auto integer = [&](const char* key, int64_t* out, bool required) -> absl::Status {
    auto it = pairs.find(key);
    if (it == pairs.end()) {
      return required ? absl::InvalidArgumentError(absl::StrCat(context, ": missing ", key, "="))
                      : absl::OkStatus();
    }
    if (!absl::SimpleAtoi(it->second, out)) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": ", key, "='", it->second, "' is not an integer"));
    }
    return absl::OkStatus();
  };
  PW_RETURN_IF_ERROR(integer("layers", &c.layers, true));
  PW_RETURN_IF_ERROR(integer("hidden", &c.hidden, true));
  PW_RETURN_IF_ERROR(integer("heads", &c.heads, true));
  c.kv_heads = c.heads;  // multi-head attention unless kv_heads says otherwise
  PW_RETURN_IF_ERROR(integer("kv_heads", &c.kv_heads, false));
  PW_RETURN_IF_ERROR(integer("ffn", &c.ffn, true));
  PW_RETURN_IF_ERROR(integer("seq", &c.seq, true));
  PW_RETURN_IF_ERROR(integer("vocab", &c.vocab, true));
  int64_t tied = 0;
  PW_RETURN_IF_ERROR(integer("tied", &tied, false));
  if (tied != 0 && tied != 1) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": tied=", tied, " must be 0 or 1"));
  }
  c.tied = tied == 1;
  if (auto it = pairs.find("rope_theta"); it != pairs.end()) {
    if (!absl::SimpleAtod(it->second, &c.rope_theta)) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": rope_theta='", it->second, "' is not a number"));
    }
  }
  PW_RETURN_IF_ERROR(CheckLlamaConfig(c, context));
  return c;
}

std::string ModelSpecName(const GptConfig& c) {
  return absl::StrFormat("gpt:layers=%d,hidden=%d,heads=%d,seq=%d,vocab=%d,tied=%d", c.layers,
                         c.hidden, c.heads, c.seq, c.vocab, c.tied ? 1 : 0);
}

std::string ModelSpecName(const LlamaConfig& c) {
  return absl::StrFormat(
      "llama:layers=%d,hidden=%d,heads=%d,kv_heads=%d,ffn=%d,seq=%d,vocab=%d,tied=%d,"
      "rope_theta=%.17g",
      c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.seq, c.vocab, c.tied ? 1 : 0, c.rope_theta);
}

bool IsModelSpec(absl::string_view name) {
  return absl::StartsWith(name, "gpt:") || absl::StartsWith(name, "llama:");
}

absl::StatusOr<LayerGraph> ModelFromSpec(absl::string_view spec, int64_t micro_batch_size) {
  if (micro_batch_size < 0) return absl::InvalidArgumentError("micro-batch size must be >= 1");
  const int64_t b = micro_batch_size > 0 ? micro_batch_size : 1;
  if (absl::ConsumePrefix(&spec, "gpt:")) {
    PW_ASSIGN_OR_RETURN(const GptConfig c, ParseGptSpec(spec));
    return GptModel(ModelSpecName(c), c, b);
  }
  if (absl::ConsumePrefix(&spec, "llama:")) {
    PW_ASSIGN_OR_RETURN(const LlamaConfig c, ParseLlamaSpec(spec));
    return LlamaModel(ModelSpecName(c), c, b);
  }
  return PresetModel(spec, micro_batch_size);
}

}  // namespace pipewright
