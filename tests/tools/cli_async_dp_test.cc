// `pipewright train --dp-mode async` from the command line: the per-replica summary, the
// straggler flag, resume of an async checkpoint, and usage errors for what does not combine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/tools/cli_util.h"

namespace {

using namespace pipewright::cli_test;

const std::string kBase =
    "train --preset gpt-tiny --micro-batch-size 2 --micro-batches 2 --seed 7 --threads-per-rank 1 ";

TEST(CliAsyncDp, ReportsEachReplicaAndKeepsTheBound) {
  Result r = RunCli(kBase +
                    "--steps 10 --pp 2 --dp 2 --dp-mode async --staleness 2 --slow-replica 1:3 "
                    "--json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json s = Summary(r);
  ASSERT_FALSE(s.is_null()) << r.out;
  EXPECT_EQ(s["dp_mode"], "async");
  EXPECT_EQ(s["staleness"], 2);
  ASSERT_EQ(s["async_replicas"].size(), 2u);
  int64_t steps = 0;
  for (const auto& rep : s["async_replicas"]) {
    EXPECT_LE(rep["max_staleness"].get<int64_t>(), 2);
    EXPECT_GE(rep["wait_s"].get<double>(), 0.0);
    steps += rep["steps"].get<int64_t>();
  }
  EXPECT_EQ(steps, 20);  // 10 engine steps x 2 replicas
  // Replica 0 is not slowed: it takes at least half of the steps.
  EXPECT_GE(s["async_replicas"][0]["steps"].get<int64_t>(), 10);
  std::vector<double> losses = Losses(r);
  ASSERT_EQ(losses.size(), 10u);
  EXPECT_LT(losses.back(), losses.front());

  Result text = RunCli(kBase + "--steps 3 --dp 2 --dp-mode async");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("async DP (staleness bound 1)"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("replica 1:"), std::string::npos) << text.out;
}

TEST(CliAsyncDp, AnAsyncCheckpointResumes) {
  const std::string dir = TempPath("async_save_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const std::string base = kBase + "--dp 2 --dp-mode async --json ";
  Result save = RunCli(base + "--steps 3 --save " + dir);
  ASSERT_EQ(save.exit_code, 0) << save.err;
  Result resume = RunCli(base + "--steps 5 --resume " + dir);
  ASSERT_EQ(resume.exit_code, 0) << resume.err;
  const nlohmann::json s = Summary(resume);
  ASSERT_FALSE(s.is_null()) << resume.out;
  EXPECT_EQ(s["steps"], 2);
  EXPECT_EQ(s["final_step"], 5);
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

TEST(CliAsyncDp, BadCombinationsAreUsageErrors) {
  const std::string base = "train --preset gpt-tiny --steps 1 --micro-batch-size 2 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--dp 2 --dp-mode async --staleness -1", "--staleness -1"},
      {"--dp-mode async", "--dp >= 2"},
      {"--dp 2 --staleness 2", "--staleness needs --dp-mode async"},
      {"--dp 2 --dp-mode eventually", "unknown --dp-mode 'eventually'"},
      {"--dp 2 --dp-mode async --grad-compression bf16", "--grad-compression"},
      {"--dp 2 --dp-mode async --precision fp16", "fp16"},
      {"--dp 2 --dp-mode async --save /tmp/x --save-every 1", "--save-every"},
      {"--dp 2 --slow-replica 1", "REPLICA:FACTOR"},
      {"--dp 2 --slow-replica 1:0.5", "REPLICA:FACTOR"},
      {"--dp 2 --slow-replica 2:2", "only 2 replicas"},
  };
  for (const auto& [flags, want] : cases) {
    Result r = RunCli(base + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << ": " << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << flags << ": " << r.err;
  }
}

}  // namespace
