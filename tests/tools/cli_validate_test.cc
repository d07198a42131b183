// End-to-end tests of `pipewright validate`: summary line and exit 0 for a good plan, one
// "path: message" line per problem on stderr and exit 2 for a bad one, file errors, --model
// and --json.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"
#include "tests/tools/cli_util.h"

namespace {

using ::pipewright::LayerCost;
using ::pipewright::ModelCosts;
using ::pipewright::Plan;
using ::pipewright::PlanStage;
using ::pipewright::ScheduleKind;
using ::pipewright::cli_test::Result;
using ::pipewright::cli_test::RunCli;
using ::pipewright::cli_test::TempPath;

// gpt-tiny-like: 10 layers over pp = 4 stages, dp = 2, 1f1b, 8 micro-batches of 4.
Plan GoodPlan() {
  Plan p;
  p.model_name = "gpt-tiny";
  p.num_layers = 10;
  p.fingerprint = "sha256:feedbeef";
  p.devices = 8;
  p.device_memory_bytes = int64_t{80} << 30;
  p.pipeline_parallel = 4;
  p.data_parallel = 2;
  p.schedule = {ScheduleKind::k1F1B, 4, 8, 1};
  p.micro_batch_size = 4;
  const int bounds[] = {0, 3, 5, 8, 10};
  for (int i = 0; i < 4; ++i) {
    PlanStage s;
    s.index = i;
    s.rank = i;
    s.begin = bounds[i];
    s.end = bounds[i + 1];
    s.forward_s = 0.01;
    s.backward_s = 0.02;
    s.memory = {100, 100, 200, 50, 450};
    p.stages.push_back(s);
  }
  p.predicted = {.step_time_s = 0.3,
                 .bubble_fraction = 0.27,
                 .samples_per_s = 213.3,
                 .peak_memory_bytes = 450,
                 .bottleneck_stage = 0,
                 .lower_bound_step_time_s = 0.25,
                 .lower_bound_gap = 0.2};
  return p;
}

ModelCosts GoodModel() {
  ModelCosts m;
  m.name = "gpt-tiny";
  m.fingerprint = "sha256:feedbeef";
  m.micro_batch_size = 4;
  m.seq_len = 32;
  for (int i = 0; i < 10; ++i) {
    LayerCost l;
    l.name = "layer" + std::to_string(i);
    l.kind = "transformer_block";
    l.params = 10;
    l.forward_flops = 1e6;
    l.backward_flops = 2e6;
    m.layers.push_back(l);
  }
  return m;
}

std::string Write(const std::string& name, const std::string& text) {
  const std::string path = TempPath("validate_" + name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  return path;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST(CliValidate, GoodPlanIsValid) {
  const std::string plan = Write("good.json", pipewright::PlanToJson(GoodPlan()));
  Result r = RunCli("validate " + plan);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, plan +
                       ": valid: gpt-tiny, 10 layers, pp=4 dp=2 1f1b, 8 micro-batches x 4, 4 "
                       "stages\n");
  EXPECT_EQ(r.err, "");
}

TEST(CliValidate, MatchingModelIsValid) {
  const std::string plan = Write("good_m.json", pipewright::PlanToJson(GoodPlan()));
  const std::string model = Write("model.json", pipewright::ModelCostsToJson(GoodModel()));
  Result r = RunCli("validate " + plan + " --model " + model);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(": valid: "), std::string::npos) << r.out;
}

TEST(CliValidate, BrokenPlanListsEveryProblemOnStderr) {
  Plan bad = GoodPlan();
  bad.devices = 6;          // pp 4 x dp 2 = 8
  bad.stages[1].begin = 4;  // stages[0] ends at 3
  bad.stages[2].memory.total = 1;
  const std::string plan = Write("bad.json", pipewright::PlanToJson(bad));
  Result r = RunCli("validate " + plan);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  const std::vector<std::string> lines = Lines(r.err);
  ASSERT_EQ(lines.size(), 3u) << r.err;
  EXPECT_EQ(lines[0], "pipeline_parallel: 4 x data_parallel 2 = 8 ranks but devices.count is 6");
  EXPECT_EQ(lines[1],
            "stages[1].layers: starts at 4 but stages[0] ends at 3 (layers 3..3 would be "
            "dropped)");
  EXPECT_TRUE(absl::StartsWith(lines[2], "stages[2].predicted.memory_bytes.total: ")) << lines[2];
}

TEST(CliValidate, MissingFile) {
  Result r = RunCli("validate " + TempPath("validate_no_such_plan.json"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("cannot read plan"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
}

TEST(CliValidate, MalformedJson) {
  const std::string plan = Write("malformed.json", "{\"format\": \"pipewright.plan/v1\",");
  Result r = RunCli("validate " + plan);
  EXPECT_EQ(r.exit_code, 2);
  ASSERT_EQ(Lines(r.err).size(), 1u) << r.err;
  EXPECT_TRUE(absl::StartsWith(r.err, "plan: not valid JSON: ")) << r.err;
}

TEST(CliValidate, ModelMismatch) {
  const std::string plan = Write("mm_plan.json", pipewright::PlanToJson(GoodPlan()));
  ModelCosts other = GoodModel();
  other.fingerprint = "sha256:0ther";
  other.layers.pop_back();
  const std::string model = Write("mm_model.json", pipewright::ModelCostsToJson(other));
  Result r = RunCli("validate " + plan + " --model " + model);
  EXPECT_EQ(r.exit_code, 2);
  const std::vector<std::string> lines = Lines(r.err);
  ASSERT_EQ(lines.size(), 2u) << r.err;
  EXPECT_TRUE(absl::StartsWith(lines[0], "model.num_layers: 10 but the model has 9")) << r.err;
  EXPECT_TRUE(absl::StartsWith(lines[1], "model.fingerprint: ")) << r.err;
  EXPECT_NE(lines[1].find("sha256:feedbeef"), std::string::npos) << r.err;
  EXPECT_NE(lines[1].find("sha256:0ther"), std::string::npos) << r.err;
}

TEST(CliValidate, BadModelFileIsBadInput) {
  const std::string plan = Write("bm_plan.json", pipewright::PlanToJson(GoodPlan()));
  const std::string model = Write("bm_model.json", "{\"format\": \"pipewright.model/v1\"}");
  Result r = RunCli("validate " + plan + " --model " + model);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("layers: missing"), std::string::npos) << r.err;
  Result missing = RunCli("validate " + plan + " --model " + TempPath("validate_no_model.json"));
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("cannot read --model"), std::string::npos) << missing.err;
}

TEST(CliValidate, JsonOutput) {
  const std::string good = Write("json_good.json", pipewright::PlanToJson(GoodPlan()));
  Result r = RunCli("validate --json " + good);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["valid"], true);
  EXPECT_EQ(j["problems"], nlohmann::json::array());

  Plan broken = GoodPlan();
  broken.stages[3].end = 9;
  const std::string bad = Write("json_bad.json", pipewright::PlanToJson(broken));
  r = RunCli("validate " + bad + " --json");
  EXPECT_EQ(r.exit_code, 2);
  j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["valid"], false);
  EXPECT_EQ(r.err, "");  // the problems are in the JSON only
  ASSERT_EQ(j["problems"].size(), 1u) << r.out;
  EXPECT_EQ(j["problems"][0],
            "stages[3].layers: ends at 9 but model.num_layers is 10 (layers 9..9 would be "
            "dropped)");

  r = RunCli("validate --json " + TempPath("validate_json_missing.json"));
  EXPECT_EQ(r.exit_code, 2);
  j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["valid"], false);
}

TEST(CliValidate, NeedsAPlanArgument) {
  Result r = RunCli("validate");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_FALSE(r.err.empty());
}

}  // namespace
