// End-to-end: `pipewright plan` writes a plan that `validate` accepts and `train --plan` runs
// unchanged, with the predicted and measured per-stage numbers side by side.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/tools/cli_util.h"

namespace {

using namespace pipewright::cli_test;
using json = nlohmann::json;

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in, nullptr, false);
}

TEST(CliPlan, SearchesAndPrintsTheFiveBest) {
  Result r = RunCli("plan --preset gpt-tiny --devices 4 --device-memory 1GiB --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  ASSERT_EQ(j["best"].size(), 5u);
  EXPECT_GT(j["candidates"].get<int>(), 20);
  double last = 0;
  for (const json& row : j["best"]) {
    EXPECT_EQ(row["pipeline_parallel"].get<int>() * row["data_parallel"].get<int>(), 4);
    EXPECT_GE(row["step_time_s"].get<double>(), last);
    last = row["step_time_s"].get<double>();
    EXPECT_LE(row["lower_bound_step_time_s"].get<double>(), row["step_time_s"].get<double>());
  }
  EXPECT_EQ(j["plan"]["format"], "pipewright.plan/v1");
}

TEST(CliPlan, WrittenPlanValidatesAndTrainsLikeTheFlags) {
  const std::string plan = TempPath("plan_tiny_" + std::to_string(getpid()) + ".json");
  Result p = RunCli(
      "plan --preset gpt-tiny --devices 2 --pp 2 --schedule 1f1b "
      "--micro-batch-size 2 --micro-batches 4 --device-memory 1GiB -o " +
      plan);
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(p.out.find("plan written to"), std::string::npos) << p.out;
  json pj = ReadJson(plan);
  ASSERT_TRUE(pj.is_object());
  ASSERT_EQ(pj["stages"].size(), 2u);

  Result v = RunCli("validate " + plan);
  EXPECT_EQ(v.exit_code, 0) << v.err;

  Result t = RunCli("train --plan " + plan + " --steps 2 --seed 7 --json");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  std::vector<json> lines = JsonLines(t.out);
  ASSERT_FALSE(lines.empty());
  const json& s = lines.back()["summary"];
  EXPECT_EQ(s["pipeline_parallel"], 2);
  EXPECT_EQ(s["global_batch"], 8);
  ASSERT_TRUE(s.contains("plan")) << s.dump();
  ASSERT_EQ(s["plan"]["stages"].size(), 2u);
  for (const json& row : s["plan"]["stages"]) {
    EXPECT_GT(row["measured_forward_s"].get<double>(), 0);
    EXPECT_GT(row["predicted_forward_s"].get<double>(), 0);
    EXPECT_GT(row["measured_rank_peak_memory_bytes"].get<int64_t>(), 0);
    EXPECT_GT(row["predicted_rank_memory_bytes"].get<int64_t>(), 0);
  }
  // The plan's split, run through the flags, gives bit-identical losses.
  const int cut = pj["stages"][0]["layers"][1].get<int>();
  EXPECT_EQ(s["stage_boundaries"][1].get<int>(), cut);
  Result f = RunCli(
      "train --preset gpt-tiny --pp 2 --schedule 1f1b --micro-batch-size 2 "
      "--micro-batches 4 --steps 2 --seed 7 --json");
  ASSERT_EQ(f.exit_code, 0) << f.err;
  EXPECT_EQ(Losses(t), Losses(f));

  // Human output shows the side-by-side table.
  Result h = RunCli("train --plan " + plan + " --steps 1");
  ASSERT_EQ(h.exit_code, 0) << h.err;
  EXPECT_NE(h.out.find("plan vs run"), std::string::npos) << h.out;

  // Layout flags cannot override a plan.
  Result c = RunCli("train --plan " + plan + " --pp 4 --steps 1");
  EXPECT_EQ(c.exit_code, 2);
  EXPECT_NE(c.err.find("--pp conflicts with --plan"), std::string::npos) << c.err;
  // A plan for another model is refused before anything runs.
  Result m = RunCli("train --plan " + plan + " --preset gpt-small --steps 1");
  EXPECT_EQ(m.exit_code, 2);
  EXPECT_NE(m.err.find("model"), std::string::npos) << m.err;
  std::remove(plan.c_str());
}

TEST(CliPlan, ModelThatCannotFitIsExplained) {
  Result r = RunCli("plan --preset gpt-small --devices 2 --device-memory 4MiB");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("short"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("stage"), std::string::npos) << r.err;
}

TEST(CliPlan, BadArgumentsExit2) {
  for (const char* args :
       {"plan --preset gpt-tiny --devices 2 --device-memory 80XB", "plan --devices 2",
        "plan --preset gpt-tiny", "plan --preset gpt-tiny --devices 4 --pp 3",
        "plan --preset gpt-tiny --devices 2 --model /no/such.json",
        "plan --model /no/such.json --devices 2",
        "plan --preset gpt-tiny --devices 2 --schedule nope",
        "train --plan /no/such/plan.json --steps 1"}) {
    Result r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_FALSE(r.err.empty()) << args;
  }
}

}  // namespace
