// Runs too big for the machine are refused before they allocate (issue 34; docs/memory.md,
// "Checked at start"): a huge --micro-batch-size, a plan's huge micro_batch_size and a checkpoint
// whose manifest describes a huge model each exit 2 with an error naming what the run would need.
// To show that nothing big was allocated first, each runs under `ulimit -v` of 3 GB, which a
// normal run fits and an allocation of what was asked for would exceed at once (skipped in a
// sanitizer build, whose shadow memory needs a larger address space).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/match.h"
#include "pipewright/model.h"
#include "tests/tools/cli_util.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PW_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define PW_SANITIZED 1
#endif
#endif

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace pipewright::cli_test;

#ifdef PW_SANITIZED
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// The binary under `ulimit -v` of 3 GB (its address space: what it may allocate in all).
Result RunLimited(const std::string& args) {
  if (kSanitized) return RunCli(args);
  return RunCliWith("bash -c 'ulimit -v 3000000; exec \"$0\" \"$@\"' " + Bin(), args);
}

// The error names the need and what this machine has, on one line after "pipewright: ".
void ExpectRefused(const Result& r, const std::string& needs, const std::string& what) {
  EXPECT_EQ(r.exit_code, 2) << what << ": " << r.err;
  EXPECT_TRUE(absl::StartsWith(r.err, "pipewright: " + needs)) << what << ": " << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "; this machine has ")) << what << ": " << r.err;
  EXPECT_FALSE(absl::StrContains(r.err, "PW_CHECK")) << what << ": " << r.err;
}

const std::string kTrain = "train --preset gpt-tiny --micro-batches 2 --steps 1 ";

// Was: 2147483647 aborted in a PW_CHECK of the loader's batch allocation (tensor.cc), 1000000
// was killed by the OOM killer at 23 GB. The first is now past the flag's range (2^24); the
// second is within it and refused by the memory prediction.
TEST(CliMemory, HugeMicroBatchSizeIsRefusedBeforeAllocating) {
  const Result ok = RunLimited(kTrain + "--micro-batch-size 2");
  ASSERT_EQ(ok.exit_code, 0) << "a normal run fits the limit: " << ok.err;
  const Result past = RunLimited(kTrain + "--micro-batch-size 2147483647");
  EXPECT_EQ(past.exit_code, 2) << past.err;
  EXPECT_TRUE(absl::StartsWith(past.err,
                               "pipewright: --micro-batch-size 2147483647: must be an "
                               "integer in [0, 16777216]"))
      << past.err;
  for (const std::string b : {"16777216", "1000000"}) {
    const Result r = RunLimited(kTrain + "--micro-batch-size " + b);
    ExpectRefused(r, "the run needs ", b);
    EXPECT_TRUE(absl::StrContains(r.err, "activations ")) << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, " for 1 micro-batch of " + b + " sequences")) << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, "would fit: --micro-batch-size ")) << r.err;
  }
}

TEST(CliMemory, PlanWithAHugeMicroBatchSizeIsRefused) {
  const std::string plan = TempPath("memory_plan.json"), big = TempPath("memory_plan_big.json");
  const Result p = RunCli("plan --preset gpt-tiny --devices 2 --device-memory 1GiB -o " + plan);
  ASSERT_EQ(p.exit_code, 0) << p.err;
  json j = json::parse(ReadAll(plan));
  j["schedule"]["micro_batch_size"] = 1000000;  // the predictions stay the old plan's
  std::ofstream(big) << j.dump(2);
  const Result r = RunLimited("train --steps 1 --plan " + big);
  ExpectRefused(r, "the run needs ", "plan");
  EXPECT_TRUE(absl::StrContains(r.err, " of 1000000 sequences")) << r.err;
}

// A checkpoint directory whose manifest says model.gpt is `gpt` (and fingerprints that model),
// written as a step-1 checkpoint of gpt-tiny with the manifest's digest remade.
std::string EditedCheckpoint(const std::string& name, const pipewright::GptConfig& gpt,
                             int64_t micro_batch_size) {
  const std::string dir = TempPath(name);
  fs::remove_all(dir);
  const Result t = RunCli("train --preset gpt-tiny --steps 1 --save " + dir);
  EXPECT_EQ(t.exit_code, 0) << t.err;
  const std::string step = dir + "/step-000001";
  json m = json::parse(ReadAll(step + "/manifest.json"));
  m["model"]["gpt"] = {{"layers", gpt.layers}, {"hidden", gpt.hidden}, {"heads", gpt.heads},
                       {"seq", gpt.seq},       {"vocab", gpt.vocab},   {"tied", gpt.tied}};
  m["model"]["micro_batch_size"] = micro_batch_size;
  absl::StatusOr<pipewright::LayerGraph> g = pipewright::GptModel("gpt-tiny", gpt, 1);
  EXPECT_TRUE(g.ok()) << g.status();
  if (g.ok()) m["model"]["fingerprint"] = g->Fingerprint();
  std::ofstream(step + "/manifest.json") << m.dump(1);
  EXPECT_EQ(
      std::system(("cd " + step + " && sha256sum manifest.json > manifest.json.sha256").c_str()),
      0);
  return dir;
}

// Was: eval rebuilt the model from model.gpt and instantiated it, and std::bad_alloc aborted.
TEST(CliMemory, EvalOfATooBigModelIsRefusedBeforeAllocating) {
  const Result ok = RunLimited("eval --batches 2 --checkpoint " +
                               EditedCheckpoint("memory_ck_same", {4, 64, 4, 32, 256, false}, 8));
  ASSERT_EQ(ok.exit_code, 0) << "the unchanged model evaluates under the limit: " << ok.err;
  // Megatron's 1T shape (128 layers, hidden 25600) on bytes: 4 TB of weights.
  const std::string dir = EditedCheckpoint("memory_ck_big", {128, 25600, 160, 32, 256, false}, 8);
  const Result r = RunLimited("eval --checkpoint " + dir);
  ExpectRefused(r, "evaluating gpt-tiny needs ", "eval");
  EXPECT_TRUE(absl::StrContains(r.err, "(weights 3.7 TiB, gradients 3.7 TiB, activations "))
      << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "the model alone does not fit")) << r.err;
  // A micro-batch size out of range (its byte counts would overflow 64 bits) is refused before
  // the graph is built (CheckGptConfig).
  const Result overflow = RunLimited(
      "eval --checkpoint " +
      EditedCheckpoint("memory_ck_overflow", {4, 64, 4, 32, 256, false}, int64_t{1} << 60));
  EXPECT_EQ(overflow.exit_code, 2) << overflow.err;
  EXPECT_TRUE(
      absl::StrContains(overflow.err, "micro_batch_size=1152921504606846976 is out of range"))
      << overflow.err;
}

}  // namespace
