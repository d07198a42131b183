// pipewright.plan/v1 and pipewright.model/v1: round trips, one test per validation rule (each
// breaks a valid plan in exactly one way and expects the problem at its path), and fuzzing that
// must never crash and must reject every structural damage.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"

namespace {

using ::pipewright::kModelFormat;
using ::pipewright::kPlanFormat;
using ::pipewright::LayerCost;
using ::pipewright::ModelCosts;
using ::pipewright::ModelCostsFromJson;
using ::pipewright::ModelCostsToJson;
using ::pipewright::Plan;
using ::pipewright::PlanFromJson;
using ::pipewright::PlanStage;
using ::pipewright::PlanToJson;
using ::pipewright::Recompute;
using ::pipewright::ScheduleKind;
using ::pipewright::StageRank;
using ::pipewright::ValidatePlan;
using ::pipewright::ValidatePlanJson;
using json = nlohmann::ordered_json;

// A valid plan: `layers` layers split as evenly as possible over pp * chunks stages, placed by
// StageRank, with consistent memory (each stage's total well under the device).
Plan MakePlan(ScheduleKind kind = ScheduleKind::k1F1B, int pp = 4, int dp = 2, int chunks = 1,
              int layers = 10, int micro_batches = 8) {
  Plan p;
  p.model_name = "gpt-tiny";
  p.num_layers = layers;
  p.fingerprint = "sha256:0123abcd";
  p.devices = pp * dp;
  p.device_memory_bytes = int64_t{80} << 30;
  p.pipeline_parallel = pp;
  p.data_parallel = dp;
  p.schedule = {kind, pp, micro_batches, chunks};
  p.micro_batch_size = 4;
  const int S = pp * chunks;
  for (int i = 0; i < S; ++i) {
    PlanStage s;
    s.index = i;
    s.rank = StageRank(p.schedule, i);
    s.begin = layers * i / S;
    s.end = layers * (i + 1) / S;
    s.recompute = i == 0 ? Recompute::kFull : Recompute::kNone;
    s.forward_s = 0.01 * (i + 1) / 3;  // not exactly representable: exercises round trips
    s.backward_s = 0.02 * (i + 1) + 1e-17;
    s.memory = {1000 + i, 1000 + i, 2000 + 2 * i, 12345, 0};
    s.memory.total = s.memory.params + s.memory.grads + s.memory.optimizer + s.memory.activations;
    p.stages.push_back(s);
  }
  p.predicted.step_time_s = 0.123456789;
  p.predicted.bubble_fraction = 0.3;
  p.predicted.samples_per_s = 259.2;
  p.predicted.peak_memory_bytes = 20000;
  p.predicted.bottleneck_stage = S - 1;
  p.predicted.lower_bound_step_time_s = 0.1;
  p.predicted.lower_bound_gap = 0.23456789;
  return p;
}

ModelCosts MakeModel(int layers = 10) {
  ModelCosts m;
  m.name = "gpt-tiny";
  m.fingerprint = "sha256:0123abcd";
  m.micro_batch_size = 4;
  m.seq_len = 32;
  m.input_bytes = 512;
  for (int i = 0; i < layers; ++i) {
    LayerCost l;
    l.name = absl::StrCat("l", i);
    l.kind = i == 0 ? "embedding" : "transformer_block";
    l.params = 1000 * (i + 1);
    l.forward_flops = 1.0 / 3 * (i + 1) * 1e9;
    l.backward_flops = 2.0 * l.forward_flops;
    l.activation_bytes = 4096 + i;
    l.output_bytes = 2048;
    if (i == 2) l.forward_time_s = 0.1;
    if (i == 2) l.backward_time_s = 1e-300;
    if (i == 3) l.selective_saving_bytes = 1024;
    if (i == 3) l.selective_recompute_flops = 1e6;
    if (i == 3) l.largest_group_params = 1500;
    m.layers.push_back(l);
  }
  m.layers.back().tied_to = "l0";
  return m;
}

void ExpectPlansEqual(const Plan& a, const Plan& b) {
  EXPECT_EQ(a.model_name, b.model_name);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.fingerprint, b.fingerprint);
  EXPECT_EQ(a.devices, b.devices);
  EXPECT_EQ(a.device_memory_bytes, b.device_memory_bytes);
  EXPECT_EQ(a.pipeline_parallel, b.pipeline_parallel);
  EXPECT_EQ(a.data_parallel, b.data_parallel);
  EXPECT_EQ(a.schedule.kind, b.schedule.kind);
  EXPECT_EQ(a.schedule.ranks, b.schedule.ranks);
  EXPECT_EQ(a.schedule.micro_batches, b.schedule.micro_batches);
  EXPECT_EQ(a.schedule.chunks, b.schedule.chunks);
  EXPECT_EQ(a.micro_batch_size, b.micro_batch_size);
  ASSERT_EQ(a.stages.size(), b.stages.size());
  for (size_t i = 0; i < a.stages.size(); ++i) {
    const PlanStage &x = a.stages[i], &y = b.stages[i];
    EXPECT_EQ(x.index, y.index);
    EXPECT_EQ(x.rank, y.rank);
    EXPECT_EQ(x.begin, y.begin);
    EXPECT_EQ(x.end, y.end);
    EXPECT_EQ(x.recompute, y.recompute);
    EXPECT_EQ(x.forward_s, y.forward_s);  // exact: doubles must round-trip
    EXPECT_EQ(x.backward_s, y.backward_s);
    EXPECT_EQ(x.memory.params, y.memory.params);
    EXPECT_EQ(x.memory.grads, y.memory.grads);
    EXPECT_EQ(x.memory.optimizer, y.memory.optimizer);
    EXPECT_EQ(x.memory.activations, y.memory.activations);
    EXPECT_EQ(x.memory.total, y.memory.total);
  }
  EXPECT_EQ(a.predicted.step_time_s, b.predicted.step_time_s);
  EXPECT_EQ(a.predicted.bubble_fraction, b.predicted.bubble_fraction);
  EXPECT_EQ(a.predicted.samples_per_s, b.predicted.samples_per_s);
  EXPECT_EQ(a.predicted.peak_memory_bytes, b.predicted.peak_memory_bytes);
  EXPECT_EQ(a.predicted.bottleneck_stage, b.predicted.bottleneck_stage);
  EXPECT_EQ(a.predicted.lower_bound_step_time_s, b.predicted.lower_bound_step_time_s);
  EXPECT_EQ(a.predicted.lower_bound_gap, b.predicted.lower_bound_gap);
}

std::string Joined(const std::vector<std::string>& problems) {
  return absl::StrJoin(problems, "\n");
}

// True when some problem is reported at exactly `path` (and contains `text`, when given).
bool HasProblem(const std::vector<std::string>& problems, const std::string& path,
                const std::string& text = "") {
  for (const std::string& p : problems) {
    if (absl::StartsWith(p, path + ": ") && absl::StrContains(p, text)) return true;
  }
  return false;
}

// The problems of `plan`'s JSON after `mutate` edits it.
std::vector<std::string> ProblemsAfter(const std::function<void(json&)>& mutate,
                                       const Plan& plan = MakePlan(),
                                       const ModelCosts* model = nullptr) {
  json j = json::parse(PlanToJson(plan));
  mutate(j);
  return ValidatePlanJson(j.dump(2), model);
}

// Breaks the default plan with `mutate` and expects a problem at `path` containing `text`.
#define EXPECT_PROBLEM(mutate, path, text)                                   \
  do {                                                                       \
    std::vector<std::string> pw_problems = ProblemsAfter(mutate);            \
    EXPECT_TRUE(HasProblem(pw_problems, path, text)) << Joined(pw_problems); \
  } while (0)

// --- round trips and the valid case ----------------------------------------------------------

TEST(PlanJson, RoundTripPlan) {
  for (const Plan& plan :
       {MakePlan(), MakePlan(ScheduleKind::kInterleaved, 2, 1, 2, 9, 4),
        MakePlan(ScheduleKind::kZbV, 3, 1, 2, 12, 6), MakePlan(ScheduleKind::kGpipe, 1, 1, 1, 1, 1),
        MakePlan(ScheduleKind::kZbH1, 2, 3, 1, 5, 3)}) {
    const std::string text = PlanToJson(plan);
    absl::StatusOr<Plan> parsed = PlanFromJson(text);
    ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << text;
    ExpectPlansEqual(plan, *parsed);
    EXPECT_EQ(PlanToJson(*parsed), text);
  }
}

TEST(PlanJson, WritesDesignLayout) {
  const std::string text = PlanToJson(MakePlan());
  json j = json::parse(text);
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"format", "model", "devices", "pipeline_parallel",
                                            "data_parallel", "schedule", "stages", "predicted"}));
  EXPECT_EQ(j["format"], kPlanFormat);
  EXPECT_EQ(j["schedule"]["kind"], "1f1b");
  EXPECT_EQ(j["stages"][1]["layers"], json::array({2, 5}));
  EXPECT_EQ(j["stages"][0]["recompute"], "full");
  EXPECT_TRUE(j["predicted"].contains("lower_bound_gap"));
  EXPECT_TRUE(absl::StartsWith(text, "{\n  \"format\"")) << text;  // 2-space indent
  EXPECT_NE(text.back(), '\n');
}

TEST(PlanJson, ValidPlanHasNoProblems) {
  const ModelCosts model = MakeModel();
  const std::string text = PlanToJson(MakePlan());
  EXPECT_TRUE(ValidatePlanJson(text).empty()) << Joined(ValidatePlanJson(text));
  EXPECT_TRUE(ValidatePlanJson(text, &model).empty()) << Joined(ValidatePlanJson(text, &model));
  EXPECT_TRUE(PlanFromJson(text, &model).ok());
  EXPECT_TRUE(ValidatePlan(MakePlan()).empty());
  EXPECT_TRUE(ValidatePlan(MakePlan(), &model).empty());
}

TEST(PlanJson, RoundTripModel) {
  const ModelCosts model = MakeModel();
  const std::string text = ModelCostsToJson(model);
  absl::StatusOr<ModelCosts> parsed = ModelCostsFromJson(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << text;
  EXPECT_EQ(parsed->name, model.name);
  EXPECT_EQ(parsed->fingerprint, model.fingerprint);
  EXPECT_EQ(parsed->micro_batch_size, model.micro_batch_size);
  EXPECT_EQ(parsed->seq_len, model.seq_len);
  EXPECT_EQ(parsed->input_bytes, model.input_bytes);
  ASSERT_EQ(parsed->num_layers(), model.num_layers());
  for (int i = 0; i < model.num_layers(); ++i) {
    const LayerCost &a = model.layers[i], &b = parsed->layers[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.params, b.params);
    EXPECT_EQ(a.forward_flops, b.forward_flops);
    EXPECT_EQ(a.backward_flops, b.backward_flops);
    EXPECT_EQ(a.activation_bytes, b.activation_bytes);
    EXPECT_EQ(a.output_bytes, b.output_bytes);
    EXPECT_EQ(a.forward_time_s, b.forward_time_s);
    EXPECT_EQ(a.backward_time_s, b.backward_time_s);
    EXPECT_EQ(a.tied_to, b.tied_to);
    EXPECT_EQ(a.selective_saving_bytes, b.selective_saving_bytes);
    EXPECT_EQ(a.selective_recompute_flops, b.selective_recompute_flops);
    EXPECT_EQ(a.largest_group_params, b.largest_group_params);
  }
  EXPECT_EQ(ModelCostsToJson(*parsed), text);
  // Optional keys are written only when set.
  json j = json::parse(text);
  EXPECT_FALSE(j["layers"][0].contains("forward_time_s"));
  EXPECT_FALSE(j["layers"][0].contains("tied_to"));
  EXPECT_TRUE(j["layers"][2].contains("forward_time_s"));
  EXPECT_EQ(j["layers"][9]["tied_to"], "l0");
  EXPECT_FALSE(j["layers"][0].contains("selective_saving_bytes"));
  EXPECT_EQ(j["layers"][3]["selective_saving_bytes"], 1024);
  EXPECT_FALSE(j["layers"][0].contains("largest_group_params"));
  EXPECT_EQ(j["layers"][3]["largest_group_params"], 1500);
  EXPECT_EQ(j["format"], kModelFormat);
}

// --- the document ----------------------------------------------------------------------------

TEST(PlanJsonRules, NotJson) {
  std::vector<std::string> p = ValidatePlanJson("{\"format\": ");
  ASSERT_EQ(p.size(), 1u) << Joined(p);
  EXPECT_TRUE(absl::StartsWith(p[0], "plan: not valid JSON: ")) << p[0];
  EXPECT_TRUE(HasProblem(ValidatePlanJson(""), "plan", "not valid JSON"));
  EXPECT_TRUE(HasProblem(ValidatePlanJson(PlanToJson(MakePlan()) + " x"), "plan", "JSON"));
}

TEST(PlanJsonRules, NotAnObject) {
  for (const char* text : {"[1, 2]", "3", "\"plan\"", "null"}) {
    EXPECT_TRUE(HasProblem(ValidatePlanJson(text), "plan", "must be a JSON object")) << text;
  }
}

TEST(PlanJsonRules, Format) {
  EXPECT_PROBLEM([](json& j) { j["format"] = "pipewright.plan/v2"; }, "format",
                 "pipewright.plan/v1");
  EXPECT_PROBLEM([](json& j) { j["format"] = 1; }, "format", "");
}

TEST(PlanJsonRules, EveryKeyIsRequired) {
  // Deleting any member anywhere is reported at that member's path.
  json doc = json::parse(PlanToJson(MakePlan()));
  json flat = doc.flatten();
  std::set<std::string> pointers;
  for (const auto& [ptr, v] : flat.items()) {
    // "/stages/0/layers/1" -> every object member along it.
    json::json_pointer p(ptr);
    while (!p.empty()) {
      pointers.insert(p.to_string());
      p = p.parent_pointer();
    }
  }
  int members = 0;
  for (const std::string& ptr : pointers) {
    json::json_pointer p(ptr);
    const json& parent = doc[p.parent_pointer()];
    if (!parent.is_object()) continue;
    ++members;
    json j = doc;
    j[p.parent_pointer()].erase(p.back());
    // "/stages/2/predicted" -> "stages[2].predicted".
    std::string path;
    for (absl::string_view part : absl::StrSplit(ptr.substr(1), '/')) {
      if (!part.empty() && std::isdigit(static_cast<unsigned char>(part[0]))) {
        path += "[" + std::string(part) + "]";
      } else {
        path += (path.empty() ? "" : ".") + std::string(part);
      }
    }
    std::vector<std::string> problems = ValidatePlanJson(j.dump());
    EXPECT_TRUE(HasProblem(problems, path, "missing")) << path << "\n" << Joined(problems);
  }
  EXPECT_GT(members, 40);
}

TEST(PlanJsonRules, UnknownKeys) {
  EXPECT_PROBLEM([](json& j) { j["stages"][0]["recompte"] = "full"; }, "stages[0].recompte",
                 "unknown key");
  EXPECT_PROBLEM([](json& j) { j["extra"] = 1; }, "extra", "unknown key");
  EXPECT_PROBLEM([](json& j) { j["predicted"]["memory"] = 1; }, "predicted.memory", "unknown key");
  EXPECT_PROBLEM([](json& j) { j["stages"][1]["predicted"]["memory_bytes"]["x"] = 0; },
                 "stages[1].predicted.memory_bytes.x", "unknown key");
}

TEST(PlanJsonRules, DuplicateKeys) {
  std::string text = PlanToJson(MakePlan());
  const std::string dup = "\"data_parallel\": 2,\n  \"data_parallel\": 2,";
  text.replace(text.find("\"data_parallel\": 2,"), std::string("\"data_parallel\": 2,").size(),
               dup);
  EXPECT_TRUE(HasProblem(ValidatePlanJson(text), "data_parallel", "duplicate key"))
      << Joined(ValidatePlanJson(text));
}

TEST(PlanJsonRules, IntegersMustBeJsonIntegers) {
  EXPECT_PROBLEM([](json& j) { j["devices"]["count"] = 8.0; }, "devices.count", "integer");
  EXPECT_PROBLEM([](json& j) { j["devices"]["count"] = "8"; }, "devices.count", "integer");
  EXPECT_PROBLEM([](json& j) { j["stages"][2]["index"] = 2.5; }, "stages[2].index", "integer");
  EXPECT_PROBLEM([](json& j) { j["stages"][0]["predicted"]["memory_bytes"]["params"] = 1e3; },
                 "stages[0].predicted.memory_bytes.params", "integer");
}

TEST(PlanJsonRules, CountsWithinIntRange) {
  EXPECT_PROBLEM([](json& j) { j["pipeline_parallel"] = int64_t{1} << 31; }, "pipeline_parallel",
                 "<= 2147483647");
  EXPECT_PROBLEM([](json& j) { j["model"]["num_layers"] = uint64_t{1} << 63; }, "model.num_layers",
                 "");
  EXPECT_PROBLEM([](json& j) { j["devices"]["memory_bytes"] = uint64_t{1} << 63; },
                 "devices.memory_bytes", "");
}

TEST(PlanJsonRules, NumbersNonNegative) {
  EXPECT_PROBLEM([](json& j) { j["stages"][0]["predicted"]["forward_s"] = -1; },
                 "stages[0].predicted.forward_s", ">= 0");
  EXPECT_PROBLEM([](json& j) { j["predicted"]["step_time_s"] = -0.5; }, "predicted.step_time_s",
                 ">= 0");
  EXPECT_PROBLEM([](json& j) { j["predicted"]["samples_per_s"] = "fast"; },
                 "predicted.samples_per_s", "number");
}

TEST(PlanJsonRules, NumbersFinite) {
  // JSON text cannot hold infinity: nlohmann refuses an overflowing literal while parsing.
  std::string text = PlanToJson(MakePlan());
  const std::string from = "\"step_time_s\": 0.123456789";
  text.replace(text.find(from), from.size(), "\"step_time_s\": 1e999");
  EXPECT_TRUE(HasProblem(ValidatePlanJson(text), "plan", "not valid JSON"))
      << Joined(ValidatePlanJson(text));
  // An in-memory plan can: it is written as null, which is not a number.
  Plan p = MakePlan();
  p.predicted.step_time_s = std::numeric_limits<double>::infinity();
  p.stages[1].forward_s = std::nan("");
  EXPECT_TRUE(HasProblem(ValidatePlan(p), "predicted.step_time_s", "number"));
  EXPECT_TRUE(HasProblem(ValidatePlan(p), "stages[1].predicted.forward_s", "number"));
}

TEST(PlanJsonRules, ModelName) {
  EXPECT_PROBLEM([](json& j) { j["model"]["name"] = ""; }, "model.name", "empty");
}

TEST(PlanJsonRules, ModelNumLayers) {
  EXPECT_PROBLEM([](json& j) { j["model"]["num_layers"] = 0; }, "model.num_layers", ">= 1");
}

TEST(PlanJsonRules, ModelFingerprint) {
  EXPECT_PROBLEM([](json& j) { j["model"]["fingerprint"] = "md5:12"; }, "model.fingerprint",
                 "sha256:");
}

TEST(PlanJsonRules, Devices) {
  EXPECT_PROBLEM([](json& j) { j["devices"]["count"] = 0; }, "devices.count", ">= 1");
  EXPECT_PROBLEM([](json& j) { j["devices"]["memory_bytes"] = 0; }, "devices.memory_bytes", ">= 1");
}

TEST(PlanJsonRules, ParallelismAtLeastOne) {
  EXPECT_PROBLEM([](json& j) { j["pipeline_parallel"] = 0; }, "pipeline_parallel", ">= 1");
  EXPECT_PROBLEM([](json& j) { j["data_parallel"] = -2; }, "data_parallel", ">= 1");
}

TEST(PlanJsonRules, RanksMatchDevices) {
  std::vector<std::string> p = ProblemsAfter([](json& j) { j["devices"]["count"] = 6; });
  EXPECT_TRUE(
      HasProblem(p, "pipeline_parallel", "4 x data_parallel 2 = 8 ranks but devices.count is 6"))
      << Joined(p);
}

TEST(PlanJsonRules, ScheduleKind) {
  EXPECT_PROBLEM([](json& j) { j["schedule"]["kind"] = "2f2b"; }, "schedule.kind", "unknown");
  EXPECT_PROBLEM([](json& j) { j["schedule"]["kind"] = "custom"; }, "schedule.kind", "custom");
  EXPECT_PROBLEM([](json& j) { j["schedule"]["kind"] = 1; }, "schedule.kind", "string");
}

TEST(PlanJsonRules, ScheduleCounts) {
  EXPECT_PROBLEM([](json& j) { j["schedule"]["micro_batches"] = 0; }, "schedule.micro_batches",
                 ">= 1");
  EXPECT_PROBLEM([](json& j) { j["schedule"]["micro_batch_size"] = 0; },
                 "schedule.micro_batch_size", ">= 1");
  EXPECT_PROBLEM([](json& j) { j["schedule"]["chunks"] = 0; }, "schedule.chunks", ">= 1");
}

TEST(PlanJsonRules, ScheduleConstraintsComeFromTheGenerator) {
  // interleaved with v = 2 needs m % p == 0: GenerateSchedule's message, under "schedule".
  const Plan interleaved = MakePlan(ScheduleKind::kInterleaved, 4, 1, 2, 16, 8);
  ASSERT_TRUE(ValidatePlan(interleaved).empty()) << Joined(ValidatePlan(interleaved));
  std::vector<std::string> p =
      ProblemsAfter([](json& j) { j["schedule"]["micro_batches"] = 6; }, interleaved);
  EXPECT_TRUE(HasProblem(p, "schedule", "multiple of pipeline ranks")) << Joined(p);
  // 1f1b runs one chunk per rank.
  Plan two_chunks = interleaved;
  two_chunks.schedule.kind = ScheduleKind::k1F1B;
  EXPECT_TRUE(HasProblem(ValidatePlan(two_chunks), "schedule", "chunks must be 1"))
      << Joined(ValidatePlan(two_chunks));
}

TEST(PlanJsonRules, ZbVMustStateTwoChunks) {
  Plan p = MakePlan(ScheduleKind::kZbV, 2, 1, 1, 10, 4);  // chunks 1: GenerateSchedule means 2
  EXPECT_TRUE(HasProblem(ValidatePlan(p), "schedule.chunks", "must be 2"))
      << Joined(ValidatePlan(p));
}

TEST(PlanJsonRules, HugeScheduleIsRefusedNotGenerated) {
  std::vector<std::string> p =
      ProblemsAfter([](json& j) { j["schedule"]["micro_batches"] = 2000000000; });
  EXPECT_TRUE(HasProblem(p, "schedule", "pairs")) << Joined(p);
}

TEST(PlanJsonRules, StageCount) {
  EXPECT_PROBLEM([](json& j) { j["stages"].erase(3); }, "stages", "4 stages are expected");
  EXPECT_PROBLEM([](json& j) { j["stages"].push_back(j["stages"][3]); }, "stages", "5 entries");
  EXPECT_PROBLEM([](json& j) { j["stages"] = json::array(); }, "stages", "");
}

TEST(PlanJsonRules, StageIndex) {
  EXPECT_PROBLEM([](json& j) { j["stages"][2]["index"] = 3; }, "stages[2].index", "must be 2");
}

TEST(PlanJsonRules, StageRankFollowsStageRank) {
  EXPECT_PROBLEM([](json& j) { j["stages"][1]["rank"] = 2; }, "stages[1].rank", "must be 1");
  // zb-v places stages in a V: with p = 2, stage 2 is on rank 1, not 2 mod 2 = 0.
  Plan zbv = MakePlan(ScheduleKind::kZbV, 2, 1, 2, 10, 4);
  ASSERT_TRUE(ValidatePlan(zbv).empty()) << Joined(ValidatePlan(zbv));
  EXPECT_EQ(zbv.stages[2].rank, 1);
  zbv.stages[2].rank = 0;
  zbv.stages[3].rank = 1;
  EXPECT_TRUE(HasProblem(ValidatePlan(zbv), "stages[2].rank", "must be 1"));
  EXPECT_TRUE(HasProblem(ValidatePlan(zbv), "stages[3].rank", "must be 0"));
  // Placement does not depend on the micro-batches, so it is checked even when they are bad.
  std::vector<std::string> p = ProblemsAfter([](json& j) {
    j["schedule"]["micro_batches"] = 0;
    j["stages"][1]["rank"] = 3;
  });
  EXPECT_TRUE(HasProblem(p, "stages[1].rank", "must be 1")) << Joined(p);
  // interleaved: i mod p.
  Plan il = MakePlan(ScheduleKind::kInterleaved, 2, 1, 2, 10, 4);
  EXPECT_EQ(il.stages[2].rank, 0);
}

TEST(PlanJsonRules, LayersIsAPairOfIntegers) {
  EXPECT_PROBLEM([](json& j) { j["stages"][1]["layers"] = json::array({2}); }, "stages[1].layers",
                 "[begin, end]");
  EXPECT_PROBLEM(
      [](json& j) {
        j["stages"][1]["layers"] = json::array({2, 5.0});
      },
      "stages[1].layers", "[begin, end]");
  EXPECT_PROBLEM([](json& j) { j["stages"][1]["layers"] = "2-5"; }, "stages[1].layers", "");
  EXPECT_PROBLEM(
      [](json& j) {
        j["stages"][1]["layers"] = json::array({-1, 5});
      },
      "stages[1].layers", "");
}

TEST(PlanJsonRules, LayersNonEmpty) {
  Plan p = MakePlan(ScheduleKind::k1F1B, 4, 2, 1, 12);
  p.stages[2].begin = 10;
  p.stages[2].end = 8;
  EXPECT_TRUE(HasProblem(ValidatePlan(p), "stages[2].layers", "range [10, 8) is empty"))
      << Joined(ValidatePlan(p));
}

TEST(PlanJsonRules, FirstStageStartsAtZero) {
  EXPECT_PROBLEM([](json& j) { j["stages"][0]["layers"][0] = 1; }, "stages[0].layers",
                 "starts at 1");
}

TEST(PlanJsonRules, StagesAreContiguous) {
  Plan p = MakePlan();  // [0,2) [2,5) [5,7) [7,10)
  p.stages[0].end = 4;
  p.stages[1].begin = 5;
  std::vector<std::string> problems = ValidatePlan(p);
  EXPECT_TRUE(HasProblem(problems, "stages[1].layers",
                         "starts at 5 but stages[0] ends at 4 (layers 4..4 would be dropped)"))
      << Joined(problems);
  Plan overlap = MakePlan();
  overlap.stages[2].begin = 4;
  EXPECT_TRUE(HasProblem(ValidatePlan(overlap), "stages[2].layers", "would run twice"))
      << Joined(ValidatePlan(overlap));
}

TEST(PlanJsonRules, LastStageEndsAtNumLayers) {
  EXPECT_PROBLEM([](json& j) { j["stages"][3]["layers"][1] = 9; }, "stages[3].layers",
                 "would be dropped");
  EXPECT_PROBLEM([](json& j) { j["model"]["num_layers"] = 8; }, "stages[3].layers", "do not exist");
}

TEST(PlanJsonRules, Recompute) {
  EXPECT_PROBLEM([](json& j) { j["stages"][1]["recompute"] = "partial"; }, "stages[1].recompute",
                 "\"none\", \"selective\" or \"full\"");
  EXPECT_PROBLEM([](json& j) { j["stages"][1]["recompute"] = true; }, "stages[1].recompute", "");
}

TEST(PlanJsonRules, MemoryTotalIsTheSum) {
  EXPECT_PROBLEM([](json& j) { j["stages"][2]["predicted"]["memory_bytes"]["total"] = 1; },
                 "stages[2].predicted.memory_bytes.total", "params + grads + optimizer");
  EXPECT_PROBLEM([](json& j) { j["stages"][2]["predicted"]["memory_bytes"]["grads"] = -1; },
                 "stages[2].predicted.memory_bytes.grads", ">= 0");
}

TEST(PlanJsonRules, RankMemoryWithinDevice) {
  Plan p = MakePlan();
  p.device_memory_bytes = p.stages[1].memory.total - 1;
  EXPECT_TRUE(HasProblem(ValidatePlan(p), "stages[1].predicted.memory_bytes.total",
                         "exceed devices.memory_bytes"))
      << Joined(ValidatePlan(p));
  // Several stages per rank: their sum counts.
  Plan il = MakePlan(ScheduleKind::kInterleaved, 2, 1, 2, 10, 4);
  il.device_memory_bytes = il.stages[0].memory.total + il.stages[2].memory.total - 1;
  EXPECT_TRUE(HasProblem(ValidatePlan(il), "stages", "rank 0 holds stages 0, 2"))
      << Joined(ValidatePlan(il));
  il.device_memory_bytes = std::max(il.stages[0].memory.total + il.stages[2].memory.total,
                                    il.stages[1].memory.total + il.stages[3].memory.total);
  EXPECT_FALSE(HasProblem(ValidatePlan(il), "stages")) << Joined(ValidatePlan(il));
}

TEST(PlanJsonRules, BottleneckStage) {
  EXPECT_PROBLEM([](json& j) { j["predicted"]["bottleneck_stage"] = 4; },
                 "predicted.bottleneck_stage", "[0, 4)");
  EXPECT_PROBLEM([](json& j) { j["predicted"]["bottleneck_stage"] = -1; },
                 "predicted.bottleneck_stage", "");
}

TEST(PlanJsonRules, PeakMemory) {
  EXPECT_PROBLEM([](json& j) { j["predicted"]["peak_memory_bytes"] = -1; },
                 "predicted.peak_memory_bytes", ">= 0");
}

TEST(PlanJsonRules, BubbleFraction) {
  EXPECT_PROBLEM([](json& j) { j["predicted"]["bubble_fraction"] = 1.5; },
                 "predicted.bubble_fraction", "[0, 1]");
  EXPECT_PROBLEM([](json& j) { j["predicted"]["bubble_fraction"] = -0.1; },
                 "predicted.bubble_fraction", "");
}

TEST(PlanJsonRules, ModelMustMatch) {
  const std::string text = PlanToJson(MakePlan());
  ModelCosts renamed = MakeModel();
  renamed.name = "gpt-small";
  EXPECT_TRUE(HasProblem(ValidatePlanJson(text, &renamed), "model.name", "gpt-small"));
  ModelCosts shorter = MakeModel(8);
  EXPECT_TRUE(HasProblem(ValidatePlanJson(text, &shorter), "model.num_layers", "8 layers"));
  ModelCosts other = MakeModel();
  other.fingerprint = "sha256:ffff";
  std::vector<std::string> p = ValidatePlanJson(text, &other);
  ASSERT_TRUE(HasProblem(p, "model.fingerprint")) << Joined(p);
  EXPECT_TRUE(HasProblem(p, "model.fingerprint", "sha256:0123abcd")) << Joined(p);
  EXPECT_TRUE(HasProblem(p, "model.fingerprint", "sha256:ffff")) << Joined(p);
  EXPECT_FALSE(PlanFromJson(text, &other).ok());
}

TEST(PlanJsonRules, ReportsEveryProblem) {
  std::vector<std::string> p = ProblemsAfter([](json& j) {
    j["format"] = "x";
    j["devices"]["count"] = 7;
    j["stages"][2]["index"] = 9;
    j["stages"][3]["recompute"] = "some";
    j["predicted"]["bubble_fraction"] = 2;
  });
  EXPECT_EQ(p.size(), 5u) << Joined(p);
  for (const char* path : {"format", "pipeline_parallel", "stages[2].index", "stages[3].recompute",
                           "predicted.bubble_fraction"}) {
    EXPECT_TRUE(HasProblem(p, path)) << path << "\n" << Joined(p);
  }
}

TEST(PlanJsonRules, PlanFromJsonListsTheProblemsOnePerLine) {
  json j = json::parse(PlanToJson(MakePlan()));
  j["data_parallel"] = 3;
  j["stages"][0]["extra"] = 1;
  const std::string text = j.dump();
  absl::StatusOr<Plan> plan = PlanFromJson(text);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(plan.status().message()), Joined(ValidatePlanJson(text)));
  EXPECT_EQ(ValidatePlanJson(text).size(), 2u);
}

TEST(PlanJsonRules, InMemoryScheduleRanks) {
  Plan p = MakePlan();
  p.schedule.ranks = 3;
  EXPECT_TRUE(HasProblem(ValidatePlan(p), "schedule.ranks", "pipeline_parallel"));
  Plan custom = MakePlan();
  custom.schedule.kind = ScheduleKind::kCustom;
  EXPECT_TRUE(HasProblem(ValidatePlan(custom), "schedule.kind", "custom"));
}

// --- pipewright.model/v1 ---------------------------------------------------------------------

std::vector<std::string> ModelProblems(const std::function<void(json&)>& mutate) {
  json j = json::parse(ModelCostsToJson(MakeModel()));
  mutate(j);
  absl::StatusOr<ModelCosts> m = ModelCostsFromJson(j.dump());
  if (m.ok()) return {};
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  return absl::StrSplit(std::string(m.status().message()), '\n');
}

#define EXPECT_MODEL_PROBLEM(mutate, path, text)                             \
  do {                                                                       \
    std::vector<std::string> pw_problems = ModelProblems(mutate);            \
    EXPECT_TRUE(HasProblem(pw_problems, path, text)) << Joined(pw_problems); \
  } while (0)

TEST(ModelJsonRules, Document) {
  EXPECT_FALSE(ModelCostsFromJson("{").ok());
  EXPECT_TRUE(
      absl::StartsWith(ModelCostsFromJson("{").status().message(), "model: not valid JSON"));
  EXPECT_TRUE(absl::StartsWith(ModelCostsFromJson("[]").status().message(), "model: must be"));
  EXPECT_MODEL_PROBLEM([](json& j) { j["format"] = kPlanFormat; }, "format", kModelFormat);
  EXPECT_MODEL_PROBLEM([](json& j) { j["colour"] = "red"; }, "colour", "unknown key");
  EXPECT_MODEL_PROBLEM([](json& j) { j.erase("seq_len"); }, "seq_len", "missing");
  EXPECT_MODEL_PROBLEM([](json& j) { j["name"] = ""; }, "name", "empty");
  EXPECT_MODEL_PROBLEM([](json& j) { j["fingerprint"] = "abc"; }, "fingerprint", "sha256:");
}

TEST(ModelJsonRules, Sizes) {
  EXPECT_MODEL_PROBLEM([](json& j) { j["micro_batch_size"] = 0; }, "micro_batch_size", ">= 1");
  EXPECT_MODEL_PROBLEM([](json& j) { j["seq_len"] = 0; }, "seq_len", ">= 1");
  EXPECT_MODEL_PROBLEM([](json& j) { j["seq_len"] = 32.0; }, "seq_len", "integer");
  EXPECT_MODEL_PROBLEM([](json& j) { j["input_bytes"] = -1; }, "input_bytes", ">= 0");
}

TEST(ModelJsonRules, Layers) {
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"] = json::array(); }, "layers", "at least one");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["params"] = -5; }, "layers[3].params", ">= 0");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["forward_flops"] = "many"; },
                       "layers[3].forward_flops", "number");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["backward_time_s"] = -1.0; },
                       "layers[3].backward_time_s", ">= 0");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["activation_bytes"] = 1.5; },
                       "layers[3].activation_bytes", "integer");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["selective_saving_bytes"] = 1 << 20; },
                       "layers[3].selective_saving_bytes", "<=");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["largest_group_params"] = 1 << 20; },
                       "layers[3].largest_group_params", "<=");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["selective_recompute_flops"] = -1.0; },
                       "layers[3].selective_recompute_flops", ">= 0");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3].erase("kind"); }, "layers[3].kind", "missing");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["flops"] = 1; }, "layers[3].flops",
                       "unknown key");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3] = 1; }, "layers[3]", "object");
}

TEST(ModelJsonRules, NonFinite) {
  // JSON text cannot hold infinity: an overflowing literal is a parse error.
  std::string text = ModelCostsToJson(MakeModel());
  text.replace(text.find("\"forward_flops\": "), std::string("\"forward_flops\": ").size(),
               "\"forward_flops\": -1e999, \"x_\": ");
  absl::StatusOr<ModelCosts> m = ModelCostsFromJson(text);
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(absl::StartsWith(m.status().message(), "model: not valid JSON")) << m.status();
  // Written from memory, infinity becomes null, which reading refuses.
  ModelCosts inf = MakeModel();
  inf.layers[1].forward_flops = std::numeric_limits<double>::infinity();
  m = ModelCostsFromJson(ModelCostsToJson(inf));
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(absl::StrContains(m.status().message(), "layers[1].forward_flops: must be a number"))
      << m.status();
}

TEST(ModelJsonRules, UniqueNames) {
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][4]["name"] = "l1"; }, "layers[4].name",
                       "duplicate layer name \"l1\" (also layers[1])");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][4]["name"] = ""; }, "layers[4].name", "empty");
}

TEST(ModelJsonRules, TiedToNamesAnEarlierLayer) {
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][9]["tied_to"] = "nope"; }, "layers[9].tied_to",
                       "no layer is named");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["tied_to"] = "l5"; }, "layers[3].tied_to",
                       "later layer");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["tied_to"] = "l3"; }, "layers[3].tied_to",
                       "itself");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["tied_to"] = ""; }, "layers[3].tied_to", "");
  EXPECT_MODEL_PROBLEM([](json& j) { j["layers"][3]["tied_to"] = 0; }, "layers[3].tied_to",
                       "string");
  EXPECT_TRUE(ModelProblems([](json& j) { j["layers"][3]["tied_to"] = "l1"; }).empty());
}

// --- hostile documents: nesting, size and count limits (plan.h, Note [Hostile documents]) ----

// `doc` with the value at JSON pointer `where` replaced by `depth` nested arrays.
std::string WithDeepValue(json doc, const std::string& where, int depth) {
  doc[json::json_pointer(where)] = "@DEEP@";
  std::string text = doc.dump();
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  text.replace(text.find("\"@DEEP@\""), std::string("\"@DEEP@\"").size(), deep);
  return text;
}

// The one problem a too-deep document gets: "<doc>: JSON nested deeper than 64 levels (at byte
// N)", N the offset of the bracket that went too deep, inside the replaced value.
void ExpectNestingProblem(const std::vector<std::string>& problems, const std::string& doc,
                          const std::string& text, const std::string& where) {
  ASSERT_EQ(problems.size(), 1u) << where << "\n" << Joined(problems);
  const std::string prefix = doc + ": JSON nested deeper than 64 levels (at byte ";
  ASSERT_TRUE(absl::StartsWith(problems[0], prefix)) << where << ": " << problems[0];
  const size_t byte = std::stoul(problems[0].substr(prefix.size()));
  const size_t deep = text.find(std::string(1000, '['));
  ASSERT_NE(deep, std::string::npos);
  EXPECT_GE(byte, deep) << where << ": the offset is not inside the deep value";
  EXPECT_LT(byte, deep + 64) << where << ": the offset is not where the limit was crossed";
}

TEST(PlanJsonLimits, DeepNestingAnywhereIsOneNamedProblem) {
  const json doc = json::parse(PlanToJson(MakePlan()));
  for (const std::string where :
       {"/format", "/model", "/devices", "/pipeline_parallel", "/data_parallel", "/schedule",
        "/stages", "/predicted", "/model/name", "/schedule/kind", "/stages/2", "/stages/1/layers",
        "/stages/3/predicted/memory_bytes/total", "/extra"}) {
    const std::string text = WithDeepValue(doc, where, 100000);
    ExpectNestingProblem(ValidatePlanJson(text), "plan", text, where);
    absl::StatusOr<Plan> plan = PlanFromJson(text);
    ASSERT_FALSE(plan.ok());
    EXPECT_TRUE(absl::StartsWith(plan.status().message(), "plan: JSON nested deeper")) << where;
  }
  // Objects nest as deep: {"a":{"a":...}}.
  std::string objects;
  for (int i = 0; i < 100000; ++i) objects += "{\"a\":";
  objects += "0" + std::string(100000, '}');
  std::vector<std::string> p = ValidatePlanJson(objects);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(p[0], "plan: JSON nested deeper than 64 levels (at byte 320)"))
      << p[0];
}

TEST(PlanJsonLimits, NestingUpToTheLimitIsReadAndDescribedBriefly) {
  // 62 arrays as the value of devices.count: 64 levels, allowed; the rule's message shows the
  // value as a kind, not as 124 brackets.
  const json doc = json::parse(PlanToJson(MakePlan()));
  const std::string text = WithDeepValue(doc, "/devices/count", 62);
  std::vector<std::string> p = ValidatePlanJson(text);
  ASSERT_EQ(p.size(), 1u) << Joined(p);
  EXPECT_EQ(p[0], "devices.count: must be an integer >= 1, got an array of 1 elements");
  const std::string model_text =
      WithDeepValue(json::parse(ModelCostsToJson(MakeModel())), "/layers/3/params", 61);
  absl::StatusOr<ModelCosts> m = ModelCostsFromJson(model_text);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().message(),
            "layers[3].params: must be an integer >= 0, got an array of 1 elements");
}

TEST(PlanJsonLimits, DeepLayerGraphIsOneNamedProblem) {
  const json doc = json::parse(ModelCostsToJson(MakeModel()));
  for (const std::string where : {"/layers", "/layers/4", "/layers/4/name", "/name"}) {
    const std::string text = WithDeepValue(doc, where, 100000);
    absl::StatusOr<ModelCosts> m = ModelCostsFromJson(text);
    ASSERT_FALSE(m.ok()) << where;
    ExpectNestingProblem({std::string(m.status().message())}, "model", text, where);
  }
}

// A plan whose "stages" holds `n` copies of `stage` (compact JSON).
std::string PlanWithStages(int64_t n, const std::string& stage) {
  json doc = json::parse(PlanToJson(MakePlan()));
  doc["stages"] = "@STAGES@";
  std::string list;
  list.reserve(static_cast<size_t>(n) * (stage.size() + 1) + 2);
  list += '[';
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) list += ',';
    list += stage;
  }
  list += ']';
  std::string text = doc.dump();
  text.replace(text.find("\"@STAGES@\""), std::string("\"@STAGES@\"").size(), list);
  return text;
}

TEST(PlanJsonLimits, AMillionStagesAreRefusedAtTheStageLimit) {
  // Parsing stops at stage kMaxPlanStages + 1: one problem, whatever the other 934,463 hold.
  const std::string text = PlanWithStages(1000000, R"({"index":0,"layers":[0,1]})");
  std::vector<std::string> p = ValidatePlanJson(text);
  ASSERT_EQ(p.size(), 1u) << Joined(p);
  EXPECT_EQ(p[0], "stages: more than 65536 entries: a plan has at most 65536 stages");
  EXPECT_EQ(std::string(PlanFromJson(text).status().message()), p[0]);
}

TEST(PlanJsonLimits, StageLimitIsExact) {
  // kMaxPlanStages entries are read (each then has its problems); one more is refused.
  std::vector<std::string> at = ValidatePlanJson(PlanWithStages(pipewright::kMaxPlanStages, "{}"));
  EXPECT_FALSE(HasProblem(at, "stages", "at most")) << Joined(at).substr(0, 1000);
  EXPECT_TRUE(HasProblem(at, "stages[0].index", "missing")) << Joined(at).substr(0, 1000);
  EXPECT_TRUE(HasProblem(at, "plan", "more problems not listed")) << at.back();
  std::vector<std::string> over =
      ValidatePlanJson(PlanWithStages(pipewright::kMaxPlanStages + 1, "{}"));
  ASSERT_EQ(over.size(), 1u);
  EXPECT_TRUE(HasProblem(over, "stages", "at most 65536 stages")) << over[0];
}

TEST(PlanJsonLimits, ListsAtMostAThousandProblems) {
  // 65,536 empty stages have over 300,000 problems: the first 1000 are listed, then a count.
  std::vector<std::string> p = ValidatePlanJson(PlanWithStages(pipewright::kMaxPlanStages, "{}"));
  ASSERT_EQ(p.size(), static_cast<size_t>(pipewright::kMaxListedProblems) + 1);
  EXPECT_TRUE(absl::StartsWith(p.back(), "plan: ")) << p.back();
  EXPECT_TRUE(absl::EndsWith(p.back(), " more problems not listed (only the first 1000 are)"))
      << p.back();
  const int64_t more = std::stoll(p.back().substr(6));
  EXPECT_GT(more, 300000);
  absl::StatusOr<Plan> plan = PlanFromJson(PlanWithStages(pipewright::kMaxPlanStages, "{}"));
  EXPECT_EQ(std::string(plan.status().message()), Joined(p));
}

TEST(PlanJsonLimits, ManyValidStagesValidate) {
  // The plan reader is linear in the stages (the callback parser was quadratic: 10^5 stages
  // took 6 s); bench/plan_json_bench times it.
  const Plan plan = MakePlan(ScheduleKind::k1F1B, 10000, 1, 1, 20000, 1);
  const std::string text = PlanToJson(plan);
  std::vector<std::string> p = ValidatePlanJson(text);
  EXPECT_TRUE(p.empty()) << Joined(p);
  absl::StatusOr<Plan> parsed = PlanFromJson(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->stages.size(), 10000u);
  EXPECT_EQ(parsed->stages.back().end, 20000);
}

TEST(PlanJsonLimits, TooManyStagesByTheCountsIsRefusedBeforeTheSchedule) {
  // pipeline_parallel x chunks beyond the limit is named without generating a schedule of
  // 1,000,000 ranks.
  std::vector<std::string> p = ProblemsAfter([](json& j) {
    j["pipeline_parallel"] = 1000000;
    j["devices"]["count"] = 2000000;
    j["schedule"]["micro_batches"] = 1;
  });
  EXPECT_TRUE(HasProblem(p, "pipeline_parallel", "1000000 stages; a plan has at most 65536"))
      << Joined(p);
  EXPECT_FALSE(HasProblem(p, "schedule")) << Joined(p);
}

TEST(PlanJsonLimits, ManyKeysAreLinear) {
  // 100,000 unknown keys in one object (an ordered_json object inserts each by a linear search:
  // 26 s before): each is a problem, the first 1000 listed.
  // (Built as std::map-backed JSON: the test's ordered_json would be as slow.)
  nlohmann::json doc = nlohmann::json::parse(PlanToJson(MakePlan()));
  for (int i = 0; i < 100000; ++i) doc["devices"][absl::StrCat("k", i)] = 0;
  std::vector<std::string> p = ValidatePlanJson(doc.dump());
  ASSERT_EQ(p.size(), static_cast<size_t>(pipewright::kMaxListedProblems) + 1);
  EXPECT_TRUE(HasProblem(p, "devices.k0", "unknown key")) << p[0];
  EXPECT_TRUE(absl::StartsWith(p.back(), "plan: 99000 more problems")) << p.back();
}

TEST(PlanJsonLimits, ValueLimit) {
  // 4,194,305 numbers in a stage's prediction: parsing stops at the value limit.
  json doc = json::parse(PlanToJson(MakePlan()));
  doc["stages"][1]["predicted"]["forward_s"] = "@MANY@";
  std::string text = doc.dump();
  std::string many = "[0";
  for (int64_t i = 1; i <= pipewright::kMaxJsonValues; ++i) many += ",0";
  many += ']';
  text.replace(text.find("\"@MANY@\""), std::string("\"@MANY@\"").size(), many);
  std::vector<std::string> p = ValidatePlanJson(text);
  ASSERT_EQ(p.size(), 1u) << Joined(p);
  EXPECT_EQ(p[0], "plan: more than 4194304 JSON values; a plan has at most 4194304");
}

TEST(PlanJsonLimits, LayerLimit) {
  json doc = json::parse(ModelCostsToJson(MakeModel()));
  doc["layers"] = "@LAYERS@";
  std::string text = doc.dump();
  std::string layers = "[{}";
  for (int i = 1; i <= pipewright::kMaxModelLayers; ++i) layers += ",{}";
  layers += ']';
  text.replace(text.find("\"@LAYERS@\""), std::string("\"@LAYERS@\"").size(), layers);
  absl::StatusOr<ModelCosts> m = ModelCostsFromJson(text);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().message(),
            "layers: more than 262144 entries: a layer graph has at most 262144 layers");
}

TEST(PlanJsonLimits, DuplicateKeysAreNamedAtTheirPath) {
  std::string text = PlanToJson(MakePlan());
  const std::string total = "\"total\": ";
  // The second stage's memory total, given twice.
  size_t at = text.find(total);
  at = text.find(total, at + 1);
  text.insert(at, "\"total\": 1,\n");
  std::vector<std::string> p = ValidatePlanJson(text);
  EXPECT_TRUE(HasProblem(p, "stages[1].predicted.memory_bytes.total", "duplicate key"))
      << Joined(p);
}

TEST(PlanJsonLimits, MessagesStayShortWhateverTheValues) {
  // Long strings and keys are quoted in part, control characters escaped: one short line each.
  const std::string huge(1 << 20, 'x');
  const std::string line_break = "a\nb";
  std::vector<std::string> p = ProblemsAfter([&](json& j) {
    j["format"] = huge;
    j["schedule"]["kind"] = huge;
    j["stages"][0]["recompute"] = line_break;
    j["model"]["fingerprint"] = huge;
    j[huge] = 1;
    j["predicted"][line_break] = 1;
    j["devices"]["count"] = json::array({huge, huge});
  });
  EXPECT_TRUE(HasProblem(p, "schedule.kind", "unknown schedule \"xxxx")) << Joined(p);
  EXPECT_TRUE(HasProblem(p, "stages[0].recompute", "got \"a\\nb\"")) << Joined(p);
  EXPECT_TRUE(HasProblem(p, "predicted.\"a\\nb\"", "unknown key")) << Joined(p);
  EXPECT_TRUE(HasProblem(p, "\"" + std::string(64, 'x') + "\"... (1048576 bytes)", "unknown key"))
      << Joined(p);
  EXPECT_TRUE(HasProblem(p, "devices.count", "got an array of 2 elements")) << Joined(p);
  EXPECT_GE(p.size(), 6u);
  for (const std::string& line : p) {
    EXPECT_LT(line.size(), 300u) << line.substr(0, 300);
    EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  }
}

// --- fuzzing ---------------------------------------------------------------------------------

TEST(PlanJsonFuzz, EveryTruncationIsRejected) {
  for (const Plan& plan : {MakePlan(), MakePlan(ScheduleKind::kZbV, 2, 1, 2, 10, 4)}) {
    const std::string text = PlanToJson(plan);
    for (size_t n = 0; n < text.size(); ++n) {
      const std::string cut = text.substr(0, n);
      ASSERT_FALSE(ValidatePlanJson(cut).empty()) << "prefix of " << n << " bytes accepted";
      ASSERT_FALSE(PlanFromJson(cut).ok()) << n;
    }
  }
  const std::string model = ModelCostsToJson(MakeModel());
  for (size_t n = 0; n < model.size(); ++n) {
    ASSERT_FALSE(ModelCostsFromJson(model.substr(0, n)).ok()) << n;
  }
}

// Coarse JSON type classes: a replacement from another class must always be rejected (numbers
// are one class because float fields accept integers).
int TypeClass(const json& v) {
  if (v.is_null()) return 0;
  if (v.is_boolean()) return 1;
  if (v.is_number()) return 2;
  if (v.is_string()) return 3;
  if (v.is_array()) return 4;
  return 5;
}

json RandomValue(std::mt19937& rng, int type_class) {
  std::uniform_int_distribution<int> coin(0, 1);
  switch (type_class) {
    case 0:
      return nullptr;
    case 1:
      return coin(rng) == 1;
    case 2:
      return coin(rng) ? json(std::uniform_int_distribution<int>(-5, 50)(rng))
                       : json(std::uniform_real_distribution<double>(-2, 2)(rng));
    case 3:
      return coin(rng) ? "1f1b" : "";
    case 4:
      return coin(rng) ? json::array() : json::array({0, 1});
    default:
      return coin(rng) ? json::object() : json{{"index", 0}};
  }
}

TEST(PlanJsonFuzz, RandomMutationsNeverCrashAndStructuralDamageIsRejected) {
  std::mt19937 rng(20240611);
  const std::vector<Plan> plans = {MakePlan(), MakePlan(ScheduleKind::kInterleaved, 2, 1, 2, 9, 4),
                                   MakePlan(ScheduleKind::kZbV, 2, 2, 2, 10, 4)};
  int rejected_needed = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    const Plan& plan = plans[iter % plans.size()];
    const ModelCosts model = MakeModel(plan.num_layers);
    const std::string text = PlanToJson(plan);
    json doc = json::parse(text);
    std::vector<std::string> pointers;
    const json flat = doc.flatten();  // named: items() does not extend a temporary's life
    for (const auto& [ptr, v] : flat.items()) {
      json::json_pointer p(ptr);
      while (!p.empty()) {
        pointers.push_back(p.to_string());
        p = p.parent_pointer();
      }
    }
    std::string mutated;
    bool must_reject = false;
    const int kind = iter % 5;
    if (kind == 0) {  // bytes: flip, insert or delete a few
      mutated = text;
      const int edits = 1 + static_cast<int>(rng() % 3);
      for (int e = 0; e < edits && !mutated.empty(); ++e) {
        const size_t at = rng() % mutated.size();
        switch (rng() % 3) {
          case 0:
            mutated[at] = static_cast<char>(mutated[at] ^ (1 << (rng() % 8)));
            break;
          case 1:
            mutated.insert(at, 1, static_cast<char>(rng() % 256));
            break;
          default:
            mutated.erase(at, 1);
        }
      }
    } else if (kind == 1) {  // replace a value with one of another type
      json::json_pointer p(pointers[rng() % pointers.size()]);
      const int old_class = TypeClass(doc[p]);
      int new_class = static_cast<int>(rng() % 5);
      if (new_class >= old_class) ++new_class;
      doc[p] = RandomValue(rng, new_class);
      mutated = doc.dump(static_cast<int>(rng() % 3) - 1);
      must_reject = true;
    } else if (kind == 2) {  // delete a member
      std::vector<std::string> members;
      for (const std::string& ptr : pointers) {
        if (doc[json::json_pointer(ptr).parent_pointer()].is_object()) members.push_back(ptr);
      }
      json::json_pointer p(members[rng() % members.size()]);
      doc[p.parent_pointer()].erase(p.back());
      mutated = doc.dump();
      must_reject = true;
    } else if (kind == 3) {  // duplicate or delete a stage
      json& stages = doc["stages"];
      const size_t i = rng() % stages.size();
      if (rng() % 2) {
        stages.insert(stages.begin() + static_cast<std::ptrdiff_t>(i), stages[i]);
      } else {
        stages.erase(i);
      }
      mutated = doc.dump(2);
      must_reject = true;
    } else {  // replace a value by one of the same class (may or may not stay valid)
      json::json_pointer p(pointers[rng() % pointers.size()]);
      doc[p] = RandomValue(rng, TypeClass(doc[p]));
      mutated = doc.dump();
    }
    const std::vector<std::string> problems = ValidatePlanJson(mutated, &model);
    const absl::StatusOr<Plan> parsed = PlanFromJson(mutated, &model);
    ASSERT_EQ(problems.empty(), parsed.ok()) << mutated;
    if (must_reject) {
      ++rejected_needed;
      ASSERT_FALSE(problems.empty()) << "accepted after mutation " << kind << ":\n" << mutated;
    }
    for (const std::string& p : problems) ASSERT_NE(p.find(": "), std::string::npos) << p;
    if (parsed.ok()) {
      // Whatever survives must be internally valid too.
      ASSERT_TRUE(ValidatePlan(*parsed, &model).empty()) << Joined(ValidatePlan(*parsed, &model));
    }
    // And the model reader on the same bytes never crashes.
    (void)ModelCostsFromJson(mutated);
  }
  EXPECT_GT(rejected_needed, 1000);
}

TEST(PlanJsonFuzz, PathologicalInputs) {
  for (const std::string& text :
       {std::string(100000, '['), std::string(50000, '{'), std::string("{\"format\":\"\xff\xfe\"}"),
        std::string("\0\0\0", 3), std::string("{\"stages\": [") + std::string(10000, '1') + "]}",
        std::string("{\"a\":1,\"a\":2}")}) {
    EXPECT_FALSE(ValidatePlanJson(text).empty());
    EXPECT_FALSE(PlanFromJson(text).ok());
    EXPECT_FALSE(ModelCostsFromJson(text).ok());
  }
}

}  // namespace
