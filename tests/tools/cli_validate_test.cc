// End-to-end tests of `pipewright validate`: summary line and exit 0 for a good plan, one
// "path: message" line per problem on stderr and exit 2 for a bad one, file errors, --model
// and --json.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
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
using ::pipewright::cli_test::Bin;
using ::pipewright::cli_test::Result;
using ::pipewright::cli_test::RunCli;
using ::pipewright::cli_test::RunCliWith;
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

// "zero": 2 (ZeRO-2) is valid with dp >= 2 and shown in the summary; 3 is refused at the field.
TEST(CliValidate, ZeroTwoIsValidAndThreeIsNot) {
  Plan z2 = GoodPlan();
  z2.zero = 2;
  const std::string plan = Write("zero2.json", pipewright::PlanToJson(z2));
  Result r = RunCli("validate " + plan);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, plan +
                       ": valid: gpt-tiny, 10 layers, pp=4 dp=2 zero=2 1f1b, 8 micro-batches x "
                       "4, 4 stages\n");
  z2.zero = 3;
  const std::string bad = Write("zero3.json", pipewright::PlanToJson(z2));
  Result b = RunCli("validate " + bad);
  EXPECT_EQ(b.exit_code, 2);
  EXPECT_EQ(b.err, "zero: must be <= 2, got 3\n");
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
  EXPECT_NE(r.err.find("cannot open plan"), std::string::npos) << r.err;
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
  EXPECT_NE(missing.err.find("cannot open --model"), std::string::npos) << missing.err;
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

// --- hostile input (issue 34): never a crash, never a hang, always a named reason -------------

// The CLI under the shell's `timeout 60`: a command that blocks shows as exit 124, never as a
// test that hangs.
Result RunBounded(const std::string& args) { return RunCliWith("timeout 60 " + Bin(), args); }

// Exit 2 (not 124: a hang; not 139: a crash) with `text` on stderr.
#define EXPECT_REFUSED(result, text)                                                \
  do {                                                                              \
    const Result& pw_r = (result);                                                  \
    EXPECT_EQ(pw_r.exit_code, 2) << pw_r.err;                                       \
    EXPECT_NE(pw_r.err.find(text), std::string::npos) << "want: " << (text) << "\n" \
                                                      << pw_r.err.substr(0, 2000);  \
  } while (0)

std::string Fifo(const std::string& name) {
  const std::string path = TempPath("validate_" + name);
  std::filesystem::remove(path);
  EXPECT_EQ(mkfifo(path.c_str(), 0600), 0) << path;
  return path;
}

std::string LinkTo(const std::string& name, const std::string& target) {
  const std::string path = TempPath("validate_" + name);
  std::filesystem::remove(path);
  std::filesystem::create_symlink(target, path);
  return path;
}

// A 1 GiB sparse file (`truncate -s 1G`): nothing on disk, far over every limit.
std::string Sparse(const std::string& name) {
  const std::string path = Write(name, "");
  std::filesystem::resize_file(path, int64_t{1} << 30);
  return path;
}

// `text` with the value of `key` (a top-level member, or "stages[1].<member>") replaced by
// 100,000 nested arrays.
std::string DeepPlan(const std::string& where) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(pipewright::PlanToJson(GoodPlan()));
  if (where.rfind("stages[1].", 0) == 0) {
    j["stages"][1][where.substr(10)] = "@DEEP@";
  } else {
    j[where] = "@DEEP@";
  }
  std::string text = j.dump();
  text.replace(text.find("\"@DEEP@\""), 8, std::string(100000, '[') + std::string(100000, ']'));
  return text;
}

TEST(CliValidateInput, DeepNestingIsANamedErrorNotACrash) {
  for (const std::string where :
       {"format", "model", "devices", "pipeline_parallel", "schedule", "stages", "predicted",
        "stages[1].layers", "stages[1].predicted"}) {
    const std::string plan = Write("deep.json", DeepPlan(where));
    Result r = RunBounded("validate " + plan);
    EXPECT_REFUSED(r,
                   "pipewright: plan '" + plan + "': JSON nested deeper than 64 levels (at byte ");
    EXPECT_EQ(Lines(r.err).size(), 1u) << where << "\n" << r.err.substr(0, 2000);
    Result json = RunBounded("validate --json " + plan);
    EXPECT_EQ(json.exit_code, 2) << where;
    EXPECT_NE(json.out.find("JSON nested deeper than 64 levels"), std::string::npos) << where;
  }
  // The model given beside it, and train's --plan.
  const std::string plan = Write("deep_ok_plan.json", pipewright::PlanToJson(GoodPlan()));
  const std::string model =
      Write("deep_model.json", "{\"layers\": " + std::string(100000, '[') + "]}");
  EXPECT_REFUSED(RunBounded("validate " + plan + " --model " + model),
                 "--model '" + model + "': JSON nested deeper than 64 levels (at byte 74)");
  const std::string deep = Write("deep_train.json", DeepPlan("stages"));
  EXPECT_REFUSED(RunBounded("train --plan " + deep + " --steps 1"),
                 "--plan '" + deep + "': JSON nested deeper than 64 levels");
  EXPECT_REFUSED(RunBounded("plan --model " + model + " --devices 2"),
                 "--model '" + model + "': JSON nested deeper than 64 levels");
}

TEST(CliValidateInput, FifoDeviceAndLinkAreRefusedAtOnce) {
  const std::string fifo = Fifo("fifo.json");
  const std::string zero_link = LinkTo("zero_link.json", "/dev/zero");
  const std::string plan = Write("dev_ok_plan.json", pipewright::PlanToJson(GoodPlan()));
  EXPECT_REFUSED(RunBounded("validate " + fifo),
                 "plan '" + fifo + "' is a FIFO, not a regular file");
  EXPECT_REFUSED(RunBounded("validate /dev/zero"), "plan '/dev/zero' is a character device");
  EXPECT_REFUSED(RunBounded("validate " + zero_link),
                 "plan '" + zero_link + "' is a character device");
  EXPECT_REFUSED(RunBounded("validate " + plan + " --model " + fifo),
                 "--model '" + fifo + "' is a FIFO");
  EXPECT_REFUSED(RunBounded("validate " + plan + " --model /dev/zero"),
                 "--model '/dev/zero' is a character device");
  EXPECT_REFUSED(RunBounded("validate " + ::testing::TempDir()), "is a directory");
}

TEST(CliValidateInput, OversizedFileIsRefusedNamingTheLimit) {
  const std::string big = Sparse("big.json");
  const std::string plan = Write("big_ok_plan.json", pipewright::PlanToJson(GoodPlan()));
  EXPECT_REFUSED(RunBounded("validate " + big),
                 "plan '" + big + "' is 1073741824 bytes; a plan is at most 67108864");
  EXPECT_REFUSED(RunBounded("validate " + plan + " --model " + big),
                 "--model '" + big + "' is 1073741824 bytes; a --model is at most 67108864");
}

TEST(CliValidateInput, AMillionStagesGetANamedAnswer) {
  // 1,000,000 stages (16 MB): the reader stops at stage 65,537 (the old reader, quadratic in the
  // stages, gave no answer in 90 s).
  std::string text = pipewright::PlanToJson(GoodPlan());
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text);
  j["stages"] = "@STAGES@";
  text = j.dump();
  std::string stages = "[";
  for (int i = 0; i < 1000000; ++i) stages += i == 0 ? "{\"layers\":[0,1]}" : ",{\"layers\":[0,1]}";
  stages += "]";
  text.replace(text.find("\"@STAGES@\""), 10, stages);
  const std::string plan = Write("million.json", text);
  Result r = RunBounded("validate " + plan);
  EXPECT_REFUSED(r, "stages: more than 65536 entries: a plan has at most 65536 stages");
  EXPECT_EQ(Lines(r.err).size(), 1u) << r.err.substr(0, 2000);
  EXPECT_REFUSED(RunBounded("train --plan " + plan + " --steps 1"),
                 "stages: more than 65536 entries: a plan has at most 65536 stages");
}

}  // namespace
