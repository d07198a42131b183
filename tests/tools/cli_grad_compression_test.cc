// `pipewright train --grad-compression` from the command line.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/tools/cli_util.h"

namespace {

using namespace pipewright::cli_test;

TEST(CliGradCompression, Bf16HalvesTheGradientBytesAndReportsThem) {
  const std::string base =
      "train --preset gpt-tiny --steps 3 --seed 7 --micro-batch-size 2 --pp 2 --dp 2 --json ";
  Result ref = RunCli(base);
  ASSERT_EQ(ref.exit_code, 0) << ref.err;
  Result r = RunCli(base + "--grad-compression bf16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json summary = Summary(r);
  ASSERT_FALSE(summary.is_null()) << r.out;
  const nlohmann::json* s = &summary;
  EXPECT_EQ((*s)["grad_compression"], "bf16");
  EXPECT_DOUBLE_EQ((*s)["grad_compression_ratio"].get<double>(), 2.0);
  EXPECT_GT((*s)["grad_bytes_sent_per_rank_step"].get<double>(), 0.0);
  for (const auto& rank : (*s)["ranks"]) {
    EXPECT_EQ(rank["grad_bytes_uncompressed"].get<int64_t>(),
              2 * rank["grad_bytes_sent"].get<int64_t>());
  }
  std::vector<double> want = Losses(ref), got = Losses(r);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.01 * want[i]);

  Result text = RunCli(
      "train --preset gpt-tiny --steps 1 --micro-batch-size 2 --dp 2 --grad-compression bf16");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("bf16, 0."), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("ratio 2.00x"), std::string::npos) << text.out;
}

// PowerSGD: every matrix sent as rank-R factors; the summary names it and its ratio, the loss
// falls, and a malformed rank is a usage error.
TEST(CliGradCompression, PowerSgdSendsFactorsAndReportsThem) {
  Result r = RunCli(
      "train --preset gpt-tiny --steps 4 --seed 7 --micro-batch-size 2 --pp 2 --dp 2 --json "
      "--grad-compression powersgd:2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json summary = Summary(r);
  ASSERT_FALSE(summary.is_null()) << r.out;
  const nlohmann::json* s = &summary;
  EXPECT_EQ((*s)["grad_compression"], "powersgd:2");
  EXPECT_GT((*s)["grad_compression_ratio"].get<double>(), 4.0);
  std::vector<double> losses = Losses(r);
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_LT(losses.back(), losses.front());
  for (const char* bad : {"powersgd:0", "powersgd:two", "powersgd"}) {
    Result b = RunCli(std::string("train --preset gpt-tiny --steps 1 --micro-batch-size 2 --dp 2 "
                                  "--grad-compression ") +
                      bad);
    EXPECT_EQ(b.exit_code, 2) << bad;
    EXPECT_NE(b.err.find("powersgd"), std::string::npos) << b.err;
  }
}

TEST(CliGradCompression, BadCombinationsAreUsageErrors) {
  const std::string base = "train --preset gpt-tiny --steps 1 --micro-batch-size 2 ";
  Result one = RunCli(base + "--grad-compression bf16");
  EXPECT_EQ(one.exit_code, 2);
  EXPECT_NE(one.err.find("--dp >= 2"), std::string::npos) << one.err;
  Result name = RunCli(base + "--dp 2 --grad-compression fp8");
  EXPECT_EQ(name.exit_code, 2);
  EXPECT_NE(name.err.find("unknown --grad-compression 'fp8'"), std::string::npos) << name.err;
  Result fp16 = RunCli(base + "--dp 2 --grad-compression bf16 --precision fp16");
  EXPECT_EQ(fp16.exit_code, 2);
  EXPECT_NE(fp16.err.find("fp16"), std::string::npos) << fp16.err;
}

// A compressed run checkpoints its error-feedback state and resumes it; a resume under another
// compression is refused with the reason.
TEST(CliGradCompression, SaveAndResumeCarryTheState) {
  const std::string dir = TempPath("gc_save_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const std::string base =
      "train --preset gpt-tiny --micro-batch-size 2 --dp 2 --seed 7 --grad-compression "
      "powersgd:2 ";
  Result save = RunCli(base + "--steps 2 --save " + dir);
  ASSERT_EQ(save.exit_code, 0) << save.err;
  Result resume = RunCli(base + "--steps 4 --resume " + dir);
  EXPECT_EQ(resume.exit_code, 0) << resume.err;
  Result other = RunCli(
      "train --preset gpt-tiny --micro-batch-size 2 --dp 2 --seed 7 --grad-compression bf16 "
      "--steps 4 --resume " +
      dir);
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.err.find("powersgd:2"), std::string::npos) << other.err;
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

}  // namespace
