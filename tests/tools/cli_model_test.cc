// End-to-end tests of `pipewright model`: the layer-graph file, the summary (human and JSON),
// --profile, and usage errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/tools/cli_util.h"

namespace {

using pipewright::cli_test::Result;
using pipewright::cli_test::RunCli;
using pipewright::cli_test::TempPath;

const std::string kGpt3Spec = "layers=96,hidden=12288,heads=96,seq=2048,vocab=51200";

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "no file " << path;
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());  // throws, failing the test, on bad JSON
}

// Parameters not tied to an earlier layer, summed from the file.
double UniqueParams(const nlohmann::json& model) {
  double n = 0;
  for (const auto& l : model["layers"]) {
    if (!l.contains("tied_to")) n += l["params"].get<double>();
  }
  return n;
}

// The done-when command.
TEST(CliModel, Gpt3SpecWritesTiedLayerGraph) {
  const std::string path = TempPath("model_gpt3.json");
  std::remove(path.c_str());
  Result r = RunCli("model --gpt " + kGpt3Spec + " --micro-batch-size 1 -o " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json m = ReadJson(path);
  EXPECT_EQ(m["format"], "pipewright.model/v1");
  EXPECT_EQ(m["micro_batch_size"], 1);
  EXPECT_EQ(m["seq_len"], 2048);
  ASSERT_EQ(m["layers"].size(), 96u + 4u);
  EXPECT_NEAR(UniqueParams(m) / 1e9, 174.6, 0.05);
  int tied = 0;
  double forward = 0;
  for (const auto& l : m["layers"]) {
    forward += l["forward_flops"].get<double>();
    if (l.contains("tied_to")) {
      ++tied;
      EXPECT_EQ(l["name"], "lm_head");
      EXPECT_EQ(l["tied_to"], "embed");
    }
    EXPECT_FALSE(l.contains("forward_time_s")) << l["name"];
  }
  EXPECT_EQ(tied, 1);
  // 24·s·l·h²·(1 + s/6h + V/16lh) per sequence.
  const double s = 2048, l = 96, h = 12288, v = 51200;
  const double formula = 24 * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
  EXPECT_LT(std::abs(forward - formula) / formula, 0.02);
  // The human summary names the size and the formulas.
  EXPECT_NE(r.out.find("174.6"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tied"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("12lh^2 + 13lh + (V+s)h"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(path), std::string::npos) << r.out;
}

TEST(CliModel, JsonSummaryHasFormulasAndErrors) {
  const std::string path = TempPath("model_gpt3_summary.json");
  Result r = RunCli("model --gpt " + kGpt3Spec + " -o " + path + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  for (const char* key :
       {"name", "num_layers", "micro_batch_size", "seq_len", "params", "params_stored",
        "params_formula", "params_relative_error", "forward_flops_per_sequence",
        "forward_flops_per_micro_batch", "backward_flops_per_micro_batch", "forward_flops_formula",
        "forward_flops_relative_error", "gpt", "output"}) {
    EXPECT_TRUE(j.contains(key)) << key << " missing from " << r.out;
  }
  EXPECT_NEAR(j["params"].get<double>() / 1e9, 174.6, 0.05);
  EXPECT_LT(std::abs(j["params_relative_error"].get<double>()), 1e-4);
  EXPECT_GT(j["forward_flops_relative_error"].get<double>(), 0);  // our extra terms
  EXPECT_LT(j["forward_flops_relative_error"].get<double>(), 0.02);
  EXPECT_EQ(j["micro_batch_size"], 1);  // --gpt defaults to one sequence per micro-batch
  EXPECT_EQ(j["gpt"]["tied"], true);
  EXPECT_EQ(j["output"], path);
  EXPECT_EQ(j["params_stored"].get<double>() - j["params"].get<double>(), 51200.0 * 12288);

  // tied=0 counts the head's V·h once more; the preset is the same model, tied.
  Result untied = RunCli("model --gpt " + kGpt3Spec + ",tied=0 -o " + path + " --json");
  ASSERT_EQ(untied.exit_code, 0) << untied.err;
  const nlohmann::json u = nlohmann::json::parse(untied.out);
  EXPECT_EQ(u["gpt"]["tied"], false);
  EXPECT_EQ(u["params"].get<double>() - j["params"].get<double>(), 51200.0 * 12288);
  Result preset = RunCli("model --preset gpt3-175b -o " + path + " --json");
  ASSERT_EQ(preset.exit_code, 0) << preset.err;
  const nlohmann::json p = nlohmann::json::parse(preset.out);
  EXPECT_EQ(p["params"], j["params"]);
  EXPECT_EQ(p["forward_flops_per_sequence"], j["forward_flops_per_sequence"]);
}

TEST(CliModel, MicroBatchSizeScalesPerMicroBatchFlops) {
  const std::string path = TempPath("model_mbs.json");
  Result r = RunCli("model --preset megatron-1.7b --micro-batch-size 4 -o " + path + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["micro_batch_size"], 4);
  EXPECT_DOUBLE_EQ(j["forward_flops_per_micro_batch"].get<double>(),
                   4 * j["forward_flops_per_sequence"].get<double>());
  EXPECT_EQ(ReadJson(path)["micro_batch_size"], 4);
}

TEST(CliModel, StdoutIsTheLayerGraphWithoutOutputFile) {
  Result r = RunCli("model --preset gpt-tiny");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json m = nlohmann::json::parse(r.out);
  EXPECT_EQ(m["format"], "pipewright.model/v1");
  EXPECT_EQ(m["name"], "gpt-tiny");
  EXPECT_EQ(m["micro_batch_size"], 8);
  for (const auto& l : m["layers"]) EXPECT_FALSE(l.contains("tied_to")) << l["name"];
}

TEST(CliModel, ProfileGptTinyTimesEveryLayer) {
  const std::string path = TempPath("model_tiny_profile.json");
  std::remove(path.c_str());
  Result r = RunCli("model --preset gpt-tiny --profile --reps 2 -o " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json m = ReadJson(path);
  ASSERT_EQ(m["layers"].size(), 8u);
  for (const auto& l : m["layers"]) {
    ASSERT_TRUE(l.contains("forward_time_s")) << l["name"];
    ASSERT_TRUE(l.contains("backward_time_s")) << l["name"];
    EXPECT_GT(l["forward_time_s"].get<double>(), 0) << l["name"];
    EXPECT_GT(l["backward_time_s"].get<double>(), 0) << l["name"];
    // The human summary lists every layer's measured times.
    EXPECT_NE(r.out.find(l["name"].get<std::string>()), std::string::npos) << r.out;
  }
  EXPECT_NE(r.out.find("forward ms"), std::string::npos) << r.out;

  Result j = RunCli("model --preset gpt-tiny --profile --reps 1 -o " + path + " --json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const nlohmann::json s = nlohmann::json::parse(j.out);
  ASSERT_TRUE(s.contains("profile")) << j.out;
  EXPECT_EQ(s["profile"].size(), 8u);
}

TEST(CliModel, UsageErrorsExitTwo) {
  const std::string out = " -o " + TempPath("model_bad.json");
  for (const std::string& args : {
           std::string("model"),                                                 // neither flag
           "model --preset gpt-tiny --gpt " + kGpt3Spec,                         // both flags
           std::string("model --gpt layers=96,hidden=12288"),                    // missing keys
           std::string("model --gpt layers=2,hidden=64,heads=5,seq=8,vocab=9"),  // h % a
           std::string("model --gpt layers=x,hidden=64,heads=4,seq=8,vocab=9"),
           "model --gpt " + kGpt3Spec + ",depth=3",
           "model --gpt " + kGpt3Spec + ",tied=2",
           std::string("model --preset gpt-huge"),
           std::string("model --preset gpt-tiny --micro-batch-size -1"),
           std::string("model --preset gpt-tiny --reps 3"),  // --reps without --profile
           std::string("model --preset gpt-tiny --profile --reps 0"),
       }) {
    Result r = RunCli(args + out);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find("pipewright: "), std::string::npos) << args << "\n" << r.err;
  }
  Result both = RunCli("model --preset gpt-tiny --gpt " + kGpt3Spec);
  EXPECT_NE(both.err.find("exactly one of --preset"), std::string::npos) << both.err;
  Result bad = RunCli("model --gpt layers=96,hidden=12288,heads=96,seq=2048");
  EXPECT_NE(bad.err.find("vocab"), std::string::npos) << bad.err;
}

TEST(CliModel, ProfileOfLargeModelIsRefused) {
  const std::string path = TempPath("model_big_profile.json");
  std::remove(path.c_str());
  Result r = RunCli("model --preset gpt3-175b --profile -o " + path);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("4 GiB"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("bytes"), std::string::npos) << r.err;
  EXPECT_FALSE(std::ifstream(path).good()) << "nothing is written for a refused profile";
}

}  // namespace
