// pipewright.model/v1 and pipewright.plan/v1 JSON: writing, strict parsing and validation
// (docs/plan.md lists every rule).
//
// Reading is one pass over the parsed document that both checks and fills the struct, so the
// rules PlanFromJson enforces and the problems ValidatePlanJson lists cannot drift apart. Each
// check records "path: message" and carries on, so one run reports every problem of a file.
// Nothing here throws: nlohmann's parse exceptions are caught, every value's type is checked
// before it is read, and writing replaces invalid UTF-8 instead of throwing. The reading itself,
// bounded whatever the text, is json_reader.cc's (Note [Hostile documents]).
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "partitioner/json_reader.h"
#include "partitioner/partition_internal.h"
#include "pipewright/input.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"

namespace pipewright {
namespace {

// Read documents are std::map-backed json (json_reader.h); written ones are ordered_json,
// which keeps members in the order written, so files read like DESIGN.md's example.
using ordered_json = nlohmann::ordered_json;
using namespace internal;  // NOLINT: the reader's helpers

constexpr int64_t kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// Validation generates the plan's schedule, whose size is p * v * m (stage, micro-batch)
// pairs: kMaxStageMicroBatches (schedule.h) keeps a hostile "micro_batches": 2000000000 from
// exhausting memory.

std::string Dump(const ordered_json& j) {
  return j.dump(2, ' ', false, ordered_json::error_handler_t::replace);
}

constexpr ListLimit kPlanList{"stages", kMaxPlanStages, "a plan has"};
constexpr ListLimit kModelList{"layers", kMaxModelLayers, "a layer graph has"};

// --- typed reads of single values -----------------------------------------------------------

std::optional<int64_t> ReadInt(const json& v, const std::string& path, int64_t lo, int64_t hi,
                               Problems& p) {
  // A JSON integer only: 3.0 and "3" are refused, so a count is never silently truncated.
  if (!v.is_number_integer()) {
    p.Add(path, absl::StrCat("must be an integer >= ", lo, ", got ", Describe(v)));
    return std::nullopt;
  }
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kInt64Max)) {
    p.Add(path, absl::StrCat("must be <= ", hi, ", got ", Describe(v)));
    return std::nullopt;
  }
  const int64_t x = v.get<int64_t>();
  if (x < lo) {
    p.Add(path, absl::StrCat("must be >= ", lo, ", got ", x));
    return std::nullopt;
  }
  if (x > hi) {
    p.Add(path, absl::StrCat("must be <= ", hi, ", got ", x));
    return std::nullopt;
  }
  return x;
}

// Seconds, FLOPs and ratios: any JSON number (integers too), finite and >= 0.
std::optional<double> ReadNumber(const json& v, const std::string& path, Problems& p) {
  if (!v.is_number()) {
    p.Add(path, absl::StrCat("must be a number >= 0, got ", Describe(v)));
    return std::nullopt;
  }
  const double x = v.get<double>();
  if (!std::isfinite(x)) {
    p.Add(path, absl::StrCat("must be a finite number, got ", x));
    return std::nullopt;
  }
  if (x < 0) {
    p.Add(path, absl::StrCat("must be >= 0, got ", x));
    return std::nullopt;
  }
  return x;
}

std::optional<std::string> ReadString(const json& v, const std::string& path, Problems& p) {
  if (!v.is_string()) {
    p.Add(path, absl::StrCat("must be a string, got ", Describe(v)));
    return std::nullopt;
  }
  return v.get<std::string>();
}

// The members of one JSON object. Construction reports a value that is not an object and every
// key outside `keys`; each read reports a missing or mistyped member. A Fields over nullptr
// (its parent was missing or mistyped, already reported) reads nothing and reports nothing.
class Fields {
 public:
  Fields(const json* v, std::string path, std::initializer_list<const char*> keys, Problems& p,
         const std::string& doc = "")
      : path_(std::move(path)), p_(p) {
    if (v == nullptr) return;
    if (!v->is_object()) {
      p_.Add(doc.empty() ? path_ : doc, absl::StrCat("must be a JSON object, got ", Describe(*v)));
      return;
    }
    obj_ = v;
    for (const auto& [key, value] : v->items()) {
      bool known = false;
      for (const char* k : keys) known = known || key == k;
      if (!known) p_.Add(Member(path_, ShownKey(key)), "unknown key");
    }
  }

  bool ok() const { return obj_ != nullptr; }
  const std::string& path() const { return path_; }
  std::string At(absl::string_view key) const { return Member(path_, key); }

  const json* Find(const char* key) const {
    if (obj_ == nullptr) return nullptr;
    auto it = obj_->find(key);
    return it == obj_->end() ? nullptr : &*it;
  }
  // The member, or nullptr after reporting it missing with what was expected.
  const json* Require(const char* key, absl::string_view expected) {
    if (obj_ == nullptr) return nullptr;
    const json* v = Find(key);
    if (v == nullptr) p_.Add(At(key), absl::StrCat("missing (expected ", expected, ")"));
    return v;
  }
  std::optional<int64_t> Int(const char* key, int64_t lo, int64_t hi) {
    const json* v = Require(key, absl::StrCat("an integer >= ", lo));
    return v ? ReadInt(*v, At(key), lo, hi, p_) : std::nullopt;
  }
  std::optional<double> Number(const char* key) {
    const json* v = Require(key, "a number >= 0");
    return v ? ReadNumber(*v, At(key), p_) : std::nullopt;
  }
  // `expected` says what a missing member should have been, for the message.
  std::optional<std::string> String(const char* key, bool non_empty = true,
                                    absl::string_view expected = "a string") {
    const json* v = Require(key, expected);
    std::optional<std::string> s = v ? ReadString(*v, At(key), p_) : std::nullopt;
    if (s && non_empty && s->empty()) {
      p_.Add(At(key), "must not be empty");
      return std::nullopt;
    }
    return s;
  }
  const json* Object(const char* key) { return Typed(key, "an object", &json::is_object); }
  const json* Array(const char* key) { return Typed(key, "an array", &json::is_array); }

  // The "format" member must be exactly `format`.
  void Format(const char* format) {
    const json* v = Require("format", absl::StrCat("\"", format, "\""));
    if (v != nullptr && !(v->is_string() && v->get<std::string>() == format)) {
      p_.Add(At("format"), absl::StrCat("must be \"", format, "\", got ", Describe(*v)));
    }
  }

 private:
  const json* Typed(const char* key, absl::string_view what, bool (json::*is)() const noexcept) {
    const json* v = Require(key, what);
    if (v != nullptr && !(v->*is)()) {
      p_.Add(At(key), absl::StrCat("must be ", what, ", got ", Describe(*v)));
      return nullptr;
    }
    return v;
  }

  const json* obj_ = nullptr;
  std::string path_;
  Problems& p_;
};

void CheckFingerprint(const std::string& path, const std::string& fp, Problems& p) {
  if (!absl::StartsWith(fp, "sha256:")) {
    p.Add(path,
          absl::StrCat("must start with \"sha256:\" (LayerGraph::Fingerprint), got ", Quote(fp)));
  }
}

// --- pipewright.model/v1 ---------------------------------------------------------------------

void ReadLayers(const json& layers, ModelCosts& m, Problems& p) {
  if (layers.empty()) p.Add("layers", "must list at least one layer");
  // Names first, so tied_to can tell a later layer from a missing one.
  std::vector<std::string> names(layers.size());
  std::map<std::string, size_t> first;
  for (size_t i = 0; i < layers.size(); ++i) {
    const json& l = layers[i];
    if (l.is_object() && l.contains("name") && l["name"].is_string()) {
      names[i] = l["name"].get<std::string>();
      first.emplace(names[i], i);
    }
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string path = Element("layers", i);
    Fields f(&layers[i], path,
             {"name", "kind", "params", "forward_flops", "backward_flops", "activation_bytes",
              "output_bytes", "forward_time_s", "backward_time_s", "tied_to",
              "selective_saving_bytes", "selective_recompute_flops", "largest_group_params"},
             p);
    LayerCost c;
    if (std::optional<std::string> name = f.String("name")) {
      c.name = *name;
      if (size_t j = first.at(*name); j != i) {
        p.Add(f.At("name"), absl::StrCat("duplicate layer name ", Quote(*name), " (also layers[", j,
                                         "]); names must be unique"));
      }
    }
    if (std::optional<std::string> kind = f.String("kind")) c.kind = *kind;
    const std::optional<int64_t> params = f.Int("params", 0, kInt64Max);
    if (params) c.params = *params;
    if (auto v = f.Number("forward_flops")) c.forward_flops = *v;
    if (auto v = f.Number("backward_flops")) c.backward_flops = *v;
    if (auto v = f.Int("activation_bytes", 0, kInt64Max)) c.activation_bytes = *v;
    if (auto v = f.Int("output_bytes", 0, kInt64Max)) c.output_bytes = *v;
    if (f.Find("selective_saving_bytes") != nullptr) {
      if (auto v = f.Int("selective_saving_bytes", 0, c.activation_bytes)) {
        c.selective_saving_bytes = *v;
      }
    }
    if (f.Find("selective_recompute_flops") != nullptr) {
      if (auto v = f.Number("selective_recompute_flops")) c.selective_recompute_flops = *v;
    }
    if (f.Find("largest_group_params") != nullptr) {
      if (auto v = f.Int("largest_group_params", 0, params ? *params : kInt64Max)) {
        c.largest_group_params = *v;
      }
    }
    if (const json* v = f.Find("forward_time_s"))
      c.forward_time_s = ReadNumber(*v, f.At("forward_time_s"), p);
    if (const json* v = f.Find("backward_time_s"))
      c.backward_time_s = ReadNumber(*v, f.At("backward_time_s"), p);
    if (const json* v = f.Find("tied_to")) {
      if (std::optional<std::string> t = ReadString(*v, f.At("tied_to"), p)) {
        auto it = first.find(*t);
        if (t->empty()) {
          p.Add(f.At("tied_to"), "must name an earlier layer (omit the key for an untied layer)");
        } else if (it == first.end()) {
          p.Add(f.At("tied_to"), absl::StrCat("no layer is named ", Quote(*t),
                                              " (expected the name of an earlier layer)"));
        } else if (it->second >= i) {
          p.Add(f.At("tied_to"),
                absl::StrCat(Quote(*t), " is layers[", it->second,
                             it->second == i ? "], this layer itself" : "], a later layer",
                             "; tied_to must name an earlier layer"));
        } else {
          c.tied_to = *t;
        }
      }
    }
    m.layers.push_back(std::move(c));
  }
}

void ReadModel(const json& doc, ModelCosts& m, Problems& p) {
  Fields top(&doc, "",
             {"format", "name", "fingerprint", "micro_batch_size", "seq_len", "input_bytes",
              "layers", "transformer"},
             p, "model");
  if (!top.ok()) return;
  top.Format(kModelFormat);
  if (auto s = top.String("name")) m.name = *s;
  if (auto s = top.String("fingerprint")) {
    CheckFingerprint("fingerprint", *s, p);
    m.fingerprint = *s;
  }
  if (auto v = top.Int("micro_batch_size", 1, kInt64Max)) m.micro_batch_size = *v;
  if (auto v = top.Int("seq_len", 1, kInt64Max)) m.seq_len = *v;
  if (auto v = top.Int("input_bytes", 0, kInt64Max)) m.input_bytes = *v;
  if (const json* layers = top.Array("layers")) ReadLayers(*layers, m, p);
  if (top.Find("transformer") != nullptr) {
    Fields t(top.Object("transformer"), "transformer",
             {"hidden", "heads", "ffn_hidden", "vocab", "kv_heads"}, p);
    TransformerShape shape;
    std::optional<int64_t> dims[] = {t.Int("hidden", 1, kInt64Max), t.Int("heads", 1, kInt64Max),
                                     t.Int("ffn_hidden", 1, kInt64Max),
                                     t.Int("vocab", 1, kInt64Max)};
    if (t.ok() && dims[0] && dims[1] && dims[2] && dims[3]) {
      shape = {*dims[0], *dims[1], *dims[2], *dims[3]};
      if (shape.hidden % shape.heads != 0) {
        p.Add(
            "transformer.heads",
            absl::StrCat(shape.heads, " does not divide transformer.hidden (", shape.hidden, ")"));
      }
      if (t.Find("kv_heads") != nullptr) {
        if (auto kv = t.Int("kv_heads", 1, shape.heads)) {
          shape.kv_heads = *kv;
          if (shape.heads % *kv != 0) {
            p.Add("transformer.kv_heads",
                  absl::StrCat(*kv, " does not divide transformer.heads (", shape.heads, ")"));
          }
        }
      }
      m.transformer = shape;
    }
  }
}

// --- pipewright.plan/v1 ----------------------------------------------------------------------

std::optional<ScheduleKind> ReadPlanKind(Fields& f, Problems& p) {
  std::optional<std::string> name =
      f.String("kind", true, "one of gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipev");
  if (!name) return std::nullopt;
  absl::StatusOr<ScheduleKind> kind = ParseScheduleKind(*name);
  if (!kind.ok() || *kind == ScheduleKind::kCustom) {
    // A custom schedule is a hand-written program, which a plan has no room for.
    p.Add(f.At("kind"),
          absl::StrCat(kind.ok() ? "custom schedules cannot be planned"
                                 : absl::StrCat("unknown schedule ", Quote(*name)),
                       "; expected one of gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipev"));
    return std::nullopt;
  }
  return *kind;
}

// The stage's [begin, end): two integers in int range.
std::optional<std::pair<int, int>> ReadRange(const json* v, const std::string& path, Problems& p) {
  if (v == nullptr) return std::nullopt;
  auto in_range = [](const json& x) {
    return x.is_number_integer() && !(x.is_number_unsigned() && x.get<uint64_t>() > kIntMax) &&
           x.get<int64_t>() >= 0 && x.get<int64_t>() <= kIntMax;
  };
  if (!v->is_array() || v->size() != 2 || !in_range((*v)[0]) || !in_range((*v)[1])) {
    p.Add(path, absl::StrCat("must be [begin, end], two integers >= 0, got ", Describe(*v)));
    return std::nullopt;
  }
  return std::make_pair(static_cast<int>((*v)[0].get<int64_t>()),
                        static_cast<int>((*v)[1].get<int64_t>()));
}

// What the stage list needs from the rest of the plan; unset where that part was invalid.
struct StageContext {
  std::optional<int64_t> num_layers, pp, chunks, device_memory;
  // Stage placement (kind, pp, chunks): known even when the schedule itself is refused, since
  // StageRank does not depend on the micro-batches.
  std::optional<ScheduleSpec> spec;
  std::optional<int64_t> want_stages;
};

void ReadStageMemory(const json* v, const std::string& path, StageMemory& mem, bool& ok,
                     Problems& p) {
  Fields f(v, path, {"params", "grads", "optimizer", "activations", "total"}, p);
  std::optional<int64_t> parts[4] = {f.Int("params", 0, kInt64Max), f.Int("grads", 0, kInt64Max),
                                     f.Int("optimizer", 0, kInt64Max),
                                     f.Int("activations", 0, kInt64Max)};
  std::optional<int64_t> total = f.Int("total", 0, kInt64Max);
  ok = total.has_value();
  if (total) mem.total = *total;
  if (!parts[0] || !parts[1] || !parts[2] || !parts[3] || !total) return;
  mem.params = *parts[0];
  mem.grads = *parts[1];
  mem.optimizer = *parts[2];
  mem.activations = *parts[3];
  int64_t sum = 0;
  bool overflow = false;
  for (const auto& part : parts) overflow = overflow || __builtin_add_overflow(sum, *part, &sum);
  if (overflow) {
    p.Add(f.At("total"), "params + grads + optimizer + activations overflows 64 bits");
  } else if (sum != *total) {
    p.Add(f.At("total"), absl::StrCat("must be params + grads + optimizer + activations = ", sum,
                                      ", got ", *total));
  }
}

void ReadStages(const json& stages, const StageContext& ctx, Plan& plan, Problems& p) {
  const size_t n = stages.size();
  if (ctx.want_stages && static_cast<int64_t>(n) != *ctx.want_stages) {
    p.Add("stages",
          absl::StrCat(n, " entries but pipeline_parallel ", *ctx.pp, " x schedule.chunks ",
                       *ctx.chunks, " = ", *ctx.want_stages, " stages are expected"));
  } else if (n == 0) {
    p.Add("stages", "must list at least one stage");
  }
  // Per rank: the stages it holds and their summed predicted total (saturating).
  std::map<int, std::pair<std::vector<size_t>, int64_t>> by_rank;
  // Where the next stage must start; unknown after a stage whose range is unreadable.
  int64_t next_begin = 0;
  bool next_known = true;
  for (size_t i = 0; i < n; ++i) {
    const std::string path = Element("stages", i);
    Fields f(&stages[i], path, {"index", "rank", "layers", "recompute", "predicted"}, p);
    PlanStage s;
    s.index = static_cast<int>(i);
    if (auto idx = f.Int("index", 0, kIntMax); idx && *idx != static_cast<int64_t>(i)) {
      p.Add(f.At("index"),
            absl::StrCat("must be ", i, " (stages are listed in model order), got ", *idx));
    }
    std::optional<int64_t> rank = f.Int("rank", 0, kIntMax);
    if (rank && ctx.spec && static_cast<int64_t>(i) < *ctx.want_stages) {
      const int want = StageRank(*ctx.spec, static_cast<int>(i));
      if (*rank != want) {
        p.Add(f.At("rank"), absl::StrCat("must be ", want, " (", ScheduleKindName(ctx.spec->kind),
                                         " with pipeline_parallel ", ctx.spec->ranks,
                                         " places stage ", i, " on rank ", want, "), got ", *rank));
        rank.reset();
      }
    } else if (rank && ctx.pp && *rank >= *ctx.pp) {
      p.Add(f.At("rank"), absl::StrCat("must be < pipeline_parallel (", *ctx.pp, "), got ", *rank));
      rank.reset();
    }
    if (rank) s.rank = static_cast<int>(*rank);

    const std::string lp = f.At("layers");
    if (auto range = ReadRange(f.Require("layers", "[begin, end]"), lp, p)) {
      const auto [b, e] = *range;
      s.begin = b;
      s.end = e;
      if (b >= e) p.Add(lp, absl::StrCat("range [", b, ", ", e, ") is empty"));
      if (next_known && b != next_begin) {
        const int64_t want = next_begin;
        if (i == 0) {
          p.Add(lp,
                absl::StrCat("starts at ", b, " but the first stage must start at 0 (layers 0..",
                             b - 1, " would be dropped)"));
        } else {
          p.Add(lp,
                absl::StrCat(
                    "starts at ", b, " but stages[", i - 1, "] ends at ", want,
                    b > want ? absl::StrCat(" (layers ", want, "..", b - 1, " would be dropped)")
                             : absl::StrCat(" (layers ", b, "..", want - 1, " would run twice)")));
        }
      }
      if (i + 1 == n && ctx.num_layers && e != *ctx.num_layers) {
        const int64_t L = *ctx.num_layers;
        p.Add(lp,
              absl::StrCat("ends at ", e, " but model.num_layers is ", L,
                           e < L ? absl::StrCat(" (layers ", e, "..", L - 1, " would be dropped)")
                                 : absl::StrCat(" (layers ", L, "..", e - 1, " do not exist)")));
      }
      next_begin = e;
      next_known = true;
    } else {
      next_known = false;
    }

    if (auto r = f.String("recompute", false, "\"none\", \"selective\" or \"full\"")) {
      absl::StatusOr<Recompute> rc = ParseRecompute(*r);
      if (rc.ok()) {
        s.recompute = *rc;
      } else {
        p.Add(f.At("recompute"),
              absl::StrCat("must be \"none\", \"selective\" or \"full\", got ", Quote(*r)));
      }
    }

    Fields pr(f.Object("predicted"), f.At("predicted"), {"forward_s", "backward_s", "memory_bytes"},
              p);
    if (auto v = pr.Number("forward_s")) s.forward_s = *v;
    if (auto v = pr.Number("backward_s")) s.backward_s = *v;
    bool total_ok = false;
    ReadStageMemory(pr.Object("memory_bytes"), pr.At("memory_bytes"), s.memory, total_ok, p);
    if (rank && total_ok) {
      auto& [held, sum] = by_rank[s.rank];
      held.push_back(i);
      if (__builtin_add_overflow(sum, s.memory.total, &sum)) sum = kInt64Max;
    }
    plan.stages.push_back(s);
  }

  if (!ctx.device_memory) return;
  for (const auto& [rank, entry] : by_rank) {
    const auto& [held, sum] = entry;
    if (sum <= *ctx.device_memory) continue;
    if (held.size() == 1) {
      p.Add(Element("stages", held[0]) + ".predicted.memory_bytes.total",
            absl::StrCat(sum, " bytes on rank ", rank, " exceed devices.memory_bytes (",
                         *ctx.device_memory, ")"));
    } else {
      // At most 8 stage indices: a rank may hold thousands.
      constexpr size_t kShown = 8;
      const std::string stages =
          held.size() <= kShown
              ? absl::StrJoin(held, ", ")
              : absl::StrCat(absl::StrJoin(held.begin(), held.begin() + kShown, ", "), ", ... (",
                             held.size(), " stages)");
      p.Add("stages", absl::StrCat("rank ", rank, " holds stages ", stages, " with ", sum,
                                   " bytes in total, more than devices.memory_bytes (",
                                   *ctx.device_memory, ")"));
    }
  }
}

void ReadPlan(const json& doc, const ModelCosts* model, Plan& plan, Problems& p) {
  Fields top(&doc, "",
             {"format", "model", "devices", "pipeline_parallel", "data_parallel", "tensor_parallel",
              "sequence_parallel", "zero", "schedule", "stages", "predicted"},
             p, "plan");
  if (!top.ok()) return;
  top.Format(kPlanFormat);
  StageContext ctx;

  Fields mj(top.Object("model"), "model", {"name", "num_layers", "fingerprint"}, p);
  std::optional<std::string> name = mj.String("name");
  ctx.num_layers = mj.Int("num_layers", 1, kIntMax);
  std::optional<std::string> fingerprint = mj.String("fingerprint");
  if (fingerprint) CheckFingerprint("model.fingerprint", *fingerprint, p);
  if (name) plan.model_name = *name;
  if (ctx.num_layers) plan.num_layers = static_cast<int>(*ctx.num_layers);
  if (fingerprint) plan.fingerprint = *fingerprint;

  Fields dev(top.Object("devices"), "devices", {"count", "memory_bytes"}, p);
  std::optional<int64_t> count = dev.Int("count", 1, kIntMax);
  ctx.device_memory = dev.Int("memory_bytes", 1, kInt64Max);
  if (count) plan.devices = static_cast<int>(*count);
  if (ctx.device_memory) plan.device_memory_bytes = *ctx.device_memory;

  ctx.pp = top.Int("pipeline_parallel", 1, kIntMax);
  std::optional<int64_t> dp = top.Int("data_parallel", 1, kIntMax);
  if (ctx.pp) plan.pipeline_parallel = static_cast<int>(*ctx.pp);
  if (dp) plan.data_parallel = static_cast<int>(*dp);
  if (top.Find("zero") != nullptr) {
    if (std::optional<int64_t> z = top.Int("zero", 0, 2)) {
      plan.zero = static_cast<int>(*z);
      if (plan.zero >= 1 && dp && *dp < 2) {
        p.Add("zero", absl::StrCat(plan.zero, " splits the optimizer state",
                                   plan.zero == 2 ? " and the gradients" : "",
                                   " over the replicas: it needs data_parallel >= 2"));
      }
    }
  }
  // Absent in plans written before tensor parallelism: 1 and false.
  std::optional<int64_t> tp = 1;
  if (top.Find("tensor_parallel") != nullptr) tp = top.Int("tensor_parallel", 1, kIntMax);
  if (tp) plan.tensor_parallel = static_cast<int>(*tp);
  if (const json* v = top.Find("sequence_parallel")) {
    if (!v->is_boolean()) {
      p.Add("sequence_parallel", absl::StrCat("must be true or false, got ", Describe(*v)));
    } else {
      plan.sequence_parallel = v->get<bool>();
      if (plan.sequence_parallel && tp && *tp < 2) {
        p.Add("sequence_parallel",
              "true splits activations along the sequence over the "
              "tensor-parallel group: it needs tensor_parallel >= 2");
      }
    }
  }
  if (ctx.pp && dp && tp && count && *tp == 1 && *ctx.pp * *dp != *count) {
    p.Add("pipeline_parallel", absl::StrCat(*ctx.pp, " x data_parallel ", *dp, " = ", *ctx.pp * *dp,
                                            " ranks but devices.count is ", *count));
  } else if (ctx.pp && dp && tp && count && *tp > 1) {
    // Three ints: the product can pass 2^63, and is then no device count either.
    int64_t devices = 0;
    const bool overflow = __builtin_mul_overflow(*ctx.pp * *dp, *tp, &devices);
    if (overflow || devices != *count) {
      p.Add("pipeline_parallel",
            absl::StrCat(*ctx.pp, " x data_parallel ", *dp, " x tensor_parallel ", *tp, " = ",
                         overflow ? std::string("more than 2^63") : absl::StrCat(devices),
                         " devices but devices.count is ", *count));
    }
  }

  Fields sj(top.Object("schedule"), "schedule",
            {"kind", "micro_batches", "micro_batch_size", "chunks"}, p);
  std::optional<ScheduleKind> kind = ReadPlanKind(sj, p);
  std::optional<int64_t> m = sj.Int("micro_batches", 1, kIntMax);
  std::optional<int64_t> mbs = sj.Int("micro_batch_size", 1, kInt64Max);
  ctx.chunks = sj.Int("chunks", 1, kIntMax);
  if (kind) plan.schedule.kind = *kind;
  plan.schedule.ranks = plan.pipeline_parallel;
  if (m) plan.schedule.micro_batches = static_cast<int>(*m);
  if (ctx.chunks) plan.schedule.chunks = static_cast<int>(*ctx.chunks);
  if (mbs) plan.micro_batch_size = *mbs;
  if (ctx.pp && ctx.chunks) ctx.want_stages = *ctx.pp * *ctx.chunks;
  if (kind && ctx.pp && ctx.chunks) {
    ctx.spec = ScheduleSpec{*kind, static_cast<int>(*ctx.pp), m ? static_cast<int>(*m) : 1,
                            static_cast<int>(*ctx.chunks)};
  }
  if (ctx.want_stages && *ctx.want_stages > kMaxPlanStages) {
    // Checked before the schedule is generated: its size grows with the stages.
    p.Add("pipeline_parallel",
          absl::StrCat(*ctx.pp, " x schedule.chunks ", *ctx.chunks, " = ", *ctx.want_stages,
                       " stages; a plan has at most ", kMaxPlanStages));
  } else if (kind && ctx.pp && m && ctx.chunks) {
    // The schedule's own rules (chunk counts, interleaved's m % p, ...) are whatever
    // GenerateSchedule accepts: one mechanism, so a plan never names a schedule that cannot run.
    const ScheduleSpec spec{*kind, static_cast<int>(*ctx.pp), static_cast<int>(*m),
                            static_cast<int>(*ctx.chunks)};
    if (*ctx.want_stages > kMaxStageMicroBatches / *m) {
      p.Add("schedule",
            absl::StrCat("pipeline_parallel x chunks x micro_batches = ", *ctx.want_stages, " x ",
                         *m, " is more than the ", kMaxStageMicroBatches,
                         " (stage, micro-batch) pairs a plan may schedule"));
    } else if (absl::StatusOr<Schedule> s = GenerateSchedule(spec); !s.ok()) {
      p.Add("schedule", s.status().message());
    } else if (s->spec.chunks != spec.chunks) {
      // zb-v and dualpipev accept chunks 1 as "the default, 2"; a plan must say what it runs.
      p.Add("schedule.chunks", absl::StrCat(ScheduleKindName(*kind), " runs ", s->spec.chunks,
                                            " chunks per rank: chunks must be ", s->spec.chunks,
                                            ", got ", spec.chunks));
      ctx.want_stages = s->num_stages;
    }
  }

  const json* stages = top.Array("stages");
  if (stages) ReadStages(*stages, ctx, plan, p);

  Fields pj(top.Object("predicted"), "predicted",
            {"step_time_s", "bubble_fraction", "samples_per_s", "peak_memory_bytes",
             "bottleneck_stage", "lower_bound_step_time_s", "lower_bound_gap"},
            p);
  PlanPrediction& pred = plan.predicted;
  if (auto v = pj.Number("step_time_s")) pred.step_time_s = *v;
  if (auto v = pj.Number("bubble_fraction")) {
    if (*v > 1) p.Add("predicted.bubble_fraction", absl::StrCat("must be in [0, 1], got ", *v));
    pred.bubble_fraction = *v;
  }
  if (auto v = pj.Number("samples_per_s")) pred.samples_per_s = *v;
  if (auto v = pj.Int("peak_memory_bytes", 0, kInt64Max)) pred.peak_memory_bytes = *v;
  if (auto v = pj.Int("bottleneck_stage", 0, kIntMax)) {
    if (stages && *v >= static_cast<int64_t>(stages->size())) {
      p.Add("predicted.bottleneck_stage",
            absl::StrCat("must be a stage index in [0, ", stages->size(), "), got ", *v));
    }
    pred.bottleneck_stage = static_cast<int>(*v);
  }
  if (auto v = pj.Number("lower_bound_step_time_s")) pred.lower_bound_step_time_s = *v;
  if (auto v = pj.Number("lower_bound_gap")) pred.lower_bound_gap = *v;

  if (model != nullptr) {
    if (tp && *tp > 1 && !model->transformer) {
      p.Add("tensor_parallel", absl::StrCat(*tp,
                                            " but the model's layer graph has no transformer "
                                            "shape (heads, hidden size, vocabulary) to split"));
    } else if (tp && *tp > 1) {
      if (std::string problem = TensorParallelShapeProblem(*model->transformer, *tp);
          !problem.empty()) {
        p.Add("tensor_parallel", absl::StrCat(*tp, " ", problem));
      } else if (plan.sequence_parallel && model->seq_len % *tp != 0) {
        p.Add("sequence_parallel",
              absl::StrCat("true splits the sequence over tensor_parallel ", *tp,
                           " devices, which does not divide the model's sequence length ",
                           model->seq_len));
      }
    }
    if (name && *name != model->name) {
      p.Add("model.name", absl::StrCat("the plan is for ", Quote(*name), " but the model is ",
                                       Quote(model->name)));
    }
    if (ctx.num_layers && *ctx.num_layers != model->num_layers()) {
      p.Add("model.num_layers",
            absl::StrCat(*ctx.num_layers, " but the model has ", model->num_layers(), " layers"));
    }
    if (fingerprint && *fingerprint != model->fingerprint) {
      p.Add("model.fingerprint",
            absl::StrCat("the plan has ", *fingerprint, " but the model's is ", model->fingerprint,
                         " (the plan was made for another model)"));
    }
  }
}

}  // namespace

std::string ModelCostsToJson(const ModelCosts& model) {
  ordered_json j;
  j["format"] = kModelFormat;
  j["name"] = model.name;
  j["fingerprint"] = model.fingerprint;
  j["micro_batch_size"] = model.micro_batch_size;
  j["seq_len"] = model.seq_len;
  j["input_bytes"] = model.input_bytes;
  ordered_json layers = ordered_json::array();
  for (const LayerCost& l : model.layers) {
    ordered_json o;
    o["name"] = l.name;
    o["kind"] = l.kind;
    o["params"] = l.params;
    o["forward_flops"] = l.forward_flops;
    o["backward_flops"] = l.backward_flops;
    o["activation_bytes"] = l.activation_bytes;
    o["output_bytes"] = l.output_bytes;
    if (l.forward_time_s) o["forward_time_s"] = *l.forward_time_s;
    if (l.backward_time_s) o["backward_time_s"] = *l.backward_time_s;
    if (!l.tied_to.empty()) o["tied_to"] = l.tied_to;
    if (l.selective_saving_bytes > 0) o["selective_saving_bytes"] = l.selective_saving_bytes;
    if (l.selective_recompute_flops > 0)
      o["selective_recompute_flops"] = l.selective_recompute_flops;
    if (l.largest_group_params > 0) o["largest_group_params"] = l.largest_group_params;
    layers.push_back(std::move(o));
  }
  j["layers"] = std::move(layers);
  if (const std::optional<TransformerShape>& t = model.transformer) {
    j["transformer"] = {{"hidden", t->hidden},
                        {"heads", t->heads},
                        {"ffn_hidden", t->ffn_hidden},
                        {"vocab", t->vocab}};
    if (t->kv_heads > 0 && t->kv_heads != t->heads) j["transformer"]["kv_heads"] = t->kv_heads;
  }
  return Dump(j);
}

absl::StatusOr<ModelCosts> ModelCostsFromJson(absl::string_view text) {
  Problems p("model");
  ModelCosts model;
  if (std::optional<json> doc = Parse(text, kModelList, p)) ReadModel(*doc, model, p);
  if (!p.empty()) return std::move(p).ToStatus();
  return model;
}

std::string PlanToJson(const Plan& plan) {
  ordered_json j;
  j["format"] = kPlanFormat;
  j["model"] = {{"name", plan.model_name},
                {"num_layers", plan.num_layers},
                {"fingerprint", plan.fingerprint}};
  j["devices"] = {{"count", plan.devices}, {"memory_bytes", plan.device_memory_bytes}};
  j["pipeline_parallel"] = plan.pipeline_parallel;
  j["data_parallel"] = plan.data_parallel;
  // Written when not the default (like zero), so that a plan without tensor parallelism is the
  // same file it was before, and reads in builds that predate the keys.
  if (plan.tensor_parallel != 1) j["tensor_parallel"] = plan.tensor_parallel;
  if (plan.sequence_parallel) j["sequence_parallel"] = true;
  if (plan.zero != 0) j["zero"] = plan.zero;
  j["schedule"] = {{"kind", ScheduleKindName(plan.schedule.kind)},
                   {"micro_batches", plan.schedule.micro_batches},
                   {"micro_batch_size", plan.micro_batch_size},
                   {"chunks", plan.schedule.chunks}};
  ordered_json stages = ordered_json::array();
  for (const PlanStage& s : plan.stages) {
    const StageMemory& m = s.memory;
    ordered_json mem = {{"params", m.params},
                        {"grads", m.grads},
                        {"optimizer", m.optimizer},
                        {"activations", m.activations},
                        {"total", m.total}};
    ordered_json o;
    o["index"] = s.index;
    o["rank"] = s.rank;
    o["layers"] = ordered_json::array({s.begin, s.end});
    o["recompute"] = RecomputeName(s.recompute);
    o["predicted"] = {
        {"forward_s", s.forward_s}, {"backward_s", s.backward_s}, {"memory_bytes", mem}};
    stages.push_back(std::move(o));
  }
  j["stages"] = std::move(stages);
  const PlanPrediction& pr = plan.predicted;
  j["predicted"] = {{"step_time_s", pr.step_time_s},
                    {"bubble_fraction", pr.bubble_fraction},
                    {"samples_per_s", pr.samples_per_s},
                    {"peak_memory_bytes", pr.peak_memory_bytes},
                    {"bottleneck_stage", pr.bottleneck_stage},
                    {"lower_bound_step_time_s", pr.lower_bound_step_time_s},
                    {"lower_bound_gap", pr.lower_bound_gap}};
  return Dump(j);
}

std::vector<std::string> ValidatePlanJson(absl::string_view text, const ModelCosts* model) {
  Problems p("plan");
  Plan plan;
  if (std::optional<json> doc = Parse(text, kPlanList, p)) ReadPlan(*doc, model, plan, p);
  return std::move(p).Finish();
}

std::vector<std::string> ValidatePlan(const Plan& plan, const ModelCosts* model) {
  // One mechanism: the in-memory plan is checked in its JSON form, so both see the same rules.
  // (A non-finite prediction is written as null and so reported as "must be a number".)
  std::vector<std::string> problems = ValidatePlanJson(PlanToJson(plan), model);
  // The JSON form has no field for the schedule's rank count (it is pipeline_parallel), so
  // only an in-memory plan can get it wrong.
  if (plan.schedule.ranks != plan.pipeline_parallel) {
    problems.push_back(absl::StrCat("schedule.ranks: must equal pipeline_parallel (",
                                    plan.pipeline_parallel, "), got ", plan.schedule.ranks));
  }
  return problems;
}

absl::StatusOr<Plan> PlanFromJson(absl::string_view text, const ModelCosts* model) {
  Problems p("plan");
  Plan plan;
  if (std::optional<json> doc = Parse(text, kPlanList, p)) ReadPlan(*doc, model, plan, p);
  if (!p.empty()) return std::move(p).ToStatus();
  return plan;
}

}  // namespace pipewright
