// `pipewright train --precision`, `--loss-scale` and `--device cuda` from the command line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "pipewright/device.h"
#include "tests/tools/cli_util.h"

namespace {

using namespace pipewright::cli_test;

const nlohmann::json* SummaryOf(const std::vector<nlohmann::json>& lines) {
  for (const auto& l : lines) {
    if (l.contains("summary")) return &l["summary"];
  }
  return nullptr;
}

TEST(CliPrecision, Bf16AndFp16TrainAndReportTheirPrecision) {
  const std::string base =
      "train --preset gpt-tiny --steps 3 --seed 7 --micro-batch-size 2 --json ";
  Result ref = RunCli(base + "--pp 2");
  ASSERT_EQ(ref.exit_code, 0) << ref.err;
  std::vector<double> fp32 = Losses(ref);
  for (const char* p : {"bf16", "fp16"}) {
    Result r = RunCli(base + "--pp 2 --precision " + p);
    ASSERT_EQ(r.exit_code, 0) << p << ": " << r.err;
    std::vector<nlohmann::json> lines = JsonLines(r.out);
    const nlohmann::json* s = SummaryOf(lines);
    ASSERT_NE(s, nullptr);
    EXPECT_EQ((*s)["precision"], p);
    std::vector<double> l = Losses(r);
    ASSERT_EQ(l.size(), fp32.size());
    for (size_t i = 0; i < l.size(); ++i) EXPECT_NEAR(l[i], fp32[i], 0.01 * fp32[i]) << p;
    EXPECT_NE(l, fp32) << p << " ran in fp32";
    if (std::string(p) == "fp16") {
      EXPECT_EQ(lines[0]["loss_scale"], 65536.0);
      EXPECT_EQ((*s)["skipped_steps"], 0);
    }
  }
}

TEST(CliPrecision, Fp16OverflowIsSkippedAndReported) {
  Result r = RunCli(
      "train --preset gpt-tiny --steps 4 --seed 7 --micro-batch-size 2 --json --precision fp16 "
      "--loss-scale 16777216 --loss-scale-window 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_GE(lines.size(), 5u);
  EXPECT_EQ(lines[0]["skipped"], true);
  EXPECT_EQ(lines[1]["loss_scale"], 8388608.0);
  const nlohmann::json* s = SummaryOf(lines);
  ASSERT_NE(s, nullptr);
  EXPECT_GE((*s)["skipped_steps"].get<int>(), 1);
}

TEST(CliPrecision, BadPrecisionFlagsAreUsageErrors) {
  for (const char* args : {"train --precision fp16 --loss-scale 0", "train --loss-scale nan",
                           "train --precision fp16 --loss-scale-window 0", "train --comm mpi"}) {
    Result r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_FALSE(r.err.empty()) << args;
  }
}

TEST(CliDevice, CudaWithoutAGpuIsAClearError) {
  if (pipewright::CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  Result r = RunCli("train --preset gpt-tiny --steps 1 --device cuda");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("no CUDA GPU"), std::string::npos) << r.err;
  r = RunCli("train --preset gpt-tiny --steps 1 --device cuda:3 --pp 2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("CUDA"), std::string::npos) << r.err;
}

}  // namespace
