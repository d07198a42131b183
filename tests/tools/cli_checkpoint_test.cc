// Long runs that survive (issue 16): periodic checkpoints into a checkpoint directory, resume
// from its newest verified checkpoint, preemption by signal, and runs killed at random moments.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/tools/cli_util.h"

namespace {

namespace fs = std::filesystem;
using namespace pipewright::cli_test;

// A fresh directory of its own per test, removed when the test passes.
class CliCheckpoint : public CliDirTest {
 protected:
  CliCheckpoint() : CliDirTest("ckpt_") {}
};

std::string Latest(const std::string& dir) {
  std::string line;
  std::getline(std::ifstream(dir + "/latest"), line);
  return line;
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

// The step a `--resume auto` run on DIR starts at: the one `latest` names; with no pointer yet
// (a kill before the first pointer write), the newest complete step: a step directory, or what
// a kill left of a save (step-NNNNNN.tmp-PID, .old-PID), which the run's recovery renames into
// place when its files are complete, that is, once manifest.json.sha256 (written last, synced)
// holds its whole line. 0 when there is none.
int ResumeStep(const std::string& dir) {
  if (fs::exists(dir + "/latest")) return std::stoi(Latest(dir).substr(5));
  int step = 0;
  if (!fs::is_directory(dir)) return step;
  for (const std::string& e : Entries(dir)) {
    if (e.size() < 11 || e.rfind("step-", 0) != 0 || e.find_first_not_of("0123456789", 5) < 11) {
      continue;
    }
    const std::string rest = e.substr(11);
    const bool complete =
        rest.empty() ||
        ((rest.rfind(".tmp-", 0) == 0 || rest.rfind(".old-", 0) == 0) &&
         ReadAll(dir + "/" + e + "/manifest.json.sha256").size() == 64 + 2 + 13 + 1);
    if (complete) step = std::max(step, std::stoi(e.substr(5, 6)));
  }
  return step;
}

const std::string kTrain = "train --preset gpt-tiny --micro-batches 2 --seed 5 --json ";

TEST_F(CliCheckpoint, SaveEveryKeepsTheNewestAndResumeAutoContinues) {
  const std::string dir = Path("run");
  Result r = RunCli(kTrain + "--steps 7 --save-every 2 --keep 2 --save " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Saved after steps 2, 4, 6 and at the end (7); the newest two are kept. .lock: the writer's
  // lock file (Note [Checkpoint lock]).
  EXPECT_EQ(Entries(dir),
            (std::vector<std::string>{".lock", "latest", "step-000006", "step-000007"}));
  EXPECT_EQ(Latest(dir), "step-000007");
  for (const char* f :
       {"manifest.json", "manifest.json.sha256", "model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(fs::exists(dir + "/step-000007/" + f)) << f;
  }
  Result more = RunCli(kTrain + "--steps 9 --save " + dir + " --resume auto");
  ASSERT_EQ(more.exit_code, 0) << more.err;
  auto steps = StepLosses(more.out);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].first, 7);
  EXPECT_EQ(Latest(dir), "step-000009");

  Result fresh = RunCli(kTrain + "--steps 1 --save " + Path("empty") + " --resume auto");
  ASSERT_EQ(fresh.exit_code, 0) << fresh.err;
  EXPECT_NE(fresh.err.find("starting at step 0"), std::string::npos) << fresh.err;
}

TEST_F(CliCheckpoint, AResumeWithoutAModelFlagTakesTheModelFromTheManifest) {
  // Was (issue 36): "model.fingerprint does not match this model (gpt-tiny)".
  const std::string tied = Path("tied"), small = Path("small");
  const std::string common = "train --micro-batches 2 --seed 5 --json ";
  ASSERT_EQ(
      RunCli(common + "--preset gpt-tiny --tied 1 --micro-batch-size 2 --steps 2 --save " + tied)
          .exit_code,
      0);
  Result r = RunCli(common + "--steps 3 --resume " + tied);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("model gpt-tiny (tied head) from the checkpoint's manifest"),
            std::string::npos)
      << r.err;
  // The same losses as the run that names its model.
  Result named =
      RunCli(common + "--preset gpt-tiny --tied 1 --micro-batch-size 2 --steps 3 --resume " + tied);
  ASSERT_EQ(named.exit_code, 0) << named.err;
  ASSERT_EQ(StepLosses(r.out).size(), 1u) << r.out;
  EXPECT_EQ(StepLosses(r.out), StepLosses(named.out));
  // Another preset, untied: no "(tied head)"; a model flag given wins (and then must match).
  ASSERT_EQ(RunCli(common + "--preset mlp --steps 1 --save " + small).exit_code, 0);
  r = RunCli(common + "--steps 2 --resume " + small);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("model mlp from the checkpoint's manifest"), std::string::npos) << r.err;
  r = RunCli(common + "--preset gpt-tiny --steps 2 --resume " + small);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("does not match this model (gpt-tiny)"), std::string::npos) << r.err;
}

TEST_F(CliCheckpoint, FlagsThatNeedSaveAreUsageErrors) {
  for (const char* flags : {"--save-every 2", "--keep 3", "--resume auto"}) {
    Result r = RunCli(kTrain + "--steps 1 " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags;
    EXPECT_NE(r.err.find("needs --save"), std::string::npos) << r.err;
  }
  Result r = RunCli(kTrain + "--steps 1 --save-every -1 --save " + Path("x"));
  EXPECT_EQ(r.exit_code, 2);
}

// A flipped byte in the newest checkpoint: named on stderr, and the previous one resumed.
TEST_F(CliCheckpoint, DamagedNewestCheckpointFallsBackWithAWarning) {
  const std::string dir = Path("run");
  ASSERT_EQ(RunCli(kTrain + "--steps 4 --save-every 2 --save " + dir).exit_code, 0);
  const std::string file = dir + "/step-000004/optimizer.safetensors";
  std::string bytes = ReadAll(file);
  bytes[bytes.size() / 2] ^= 0x10;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  Result r = RunCli(kTrain + "--steps 6 --resume " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find(file + ": SHA-256 mismatch"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("resuming from " + dir + "/step-000002"), std::string::npos) << r.err;
  auto steps = StepLosses(r.out);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps[0].first, 2);
}

// SIGTERM: the step in flight finishes, a checkpoint of it is saved, the run exits 0; resuming
// it gives the uninterrupted run's losses bit for bit. A second signal exits at once.
TEST_F(CliCheckpoint, SigtermSavesExitsZeroAndResumesBitIdentically) {
  const std::string common = kTrain + "--steps 60 ";
  Result full = RunCli(common);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  auto want = StepLosses(full.out);
  ASSERT_EQ(want.size(), 60u);

  const std::string dir = Path("run"), out = Path("out.txt"), err = Path("err.txt");
  pid_t pid = Spawn(common + "--save " + dir, out, err);
  ASSERT_TRUE(WaitForSteps(out, 5, std::chrono::seconds(60))) << ReadAll(err);
  kill(pid, SIGTERM);
  EXPECT_EQ(Reap(pid), 0) << ReadAll(err);
  auto first = StepLosses(ReadAll(out));
  ASSERT_GE(first.size(), 5u);
  ASSERT_LT(first.size(), 60u) << "the run ended before the signal";
  const std::string stopped = ReadAll(err);
  EXPECT_NE(stopped.find("stopped by request after step " + std::to_string(first.size())),
            std::string::npos)
      << stopped;
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06zu", first.size());
  EXPECT_EQ(Latest(dir), name);

  Result rest = RunCli(common + "--resume " + dir);
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  auto second = StepLosses(rest.out);
  first.insert(first.end(), second.begin(), second.end());
  EXPECT_EQ(first, want);

  // Two signals while a (slowed) step runs: the second ends the process at once.
  pid = Spawn(common + "--data-delay-us 300000 --save " + Path("run2"), out, err);
  ASSERT_TRUE(WaitForSteps(out, 1, std::chrono::seconds(60))) << ReadAll(err);
  kill(pid, SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(pid, SIGTERM);
  EXPECT_EQ(Reap(pid), 128 + SIGTERM) << ReadAll(err);
}

// Issue 16's crash test: a run saving every step is killed with SIGKILL at random moments, at
// least 30 times (half of them after the restarted run's first step), and restarted each time
// with --resume auto. Every restart must resume from the checkpoint `latest` named when it
// started and reproduce the uninterrupted run's losses bit for bit; at the end no debris of the
// interrupted saves is left.
TEST_F(CliCheckpoint, KilledAtRandomMomentsEveryResumeContinuesBitIdentically) {
  constexpr int kSteps = 400, kKills = 32;
  const std::string common = kTrain + "--steps " + std::to_string(kSteps) + " ";
  Result full = RunCli(common);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  auto want = StepLosses(full.out);
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));

  const std::string dir = Path("run"), out = Path("out.txt"), err = Path("err.txt");
  const std::string args = common + "--save-every 1 --keep 3 --resume auto --save " + dir;
  std::mt19937 rng(16);
  std::uniform_int_distribution<int> delay_ms(30, 600);
  int kills = 0, resumed_runs = 0;
  bool finished = false;
  for (int attempt = 0; attempt < 4 * kKills && !finished; ++attempt) {
    const int start = ResumeStep(dir);
    pid_t pid = Spawn(args, out, err);
    if (kills < kKills) {
      // Every other kill waits for the run's first step first, so that however slow the
      // machine, at least half the kills land after a resume, in steps, saves and prunes.
      if (kills % 2 == 1) WaitForSteps(out, 1, std::chrono::seconds(60), pid);
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
      kill(pid, SIGKILL);
    }
    const int code = Reap(pid);
    auto got = StepLosses(ReadAll(out));
    if (code == 128 + SIGKILL) {
      ++kills;
    } else {
      ASSERT_EQ(code, 0) << ReadAll(err);
      finished = true;
    }
    if (!got.empty()) {
      ++resumed_runs;
      EXPECT_EQ(got.front().first, start)
          << "run " << attempt << " did not resume from step " << start;
    }
    for (const auto& [step, loss] : got) {
      ASSERT_LT(step, kSteps);
      EXPECT_EQ(loss, want[step].second) << "run " << attempt << ", step " << step;
    }
    if (HasFailure()) return;
  }
  ASSERT_TRUE(finished);
  EXPECT_GE(kills, kKills);
  EXPECT_GE(resumed_runs, kKills / 2) << "most runs were killed before their first step";
  EXPECT_EQ(Latest(dir), "step-000400");
  // --keep 3, nothing left by the interrupted saves (removed at each start, none since).
  EXPECT_EQ(Entries(dir), (std::vector<std::string>{".lock", "latest", "step-000398", "step-000399",
                                                    "step-000400"}));
  for (const std::string& e : Entries(root_)) {
    EXPECT_EQ(e.find(".tmp-"), std::string::npos) << e;
    EXPECT_EQ(e.find(".old-"), std::string::npos) << e;
  }
}

// ---- flight recorder ----

// SIGUSR2: every rank writes its last actions and says where it is; the run goes on.
TEST_F(CliCheckpoint, Sigusr2WritesEveryRanksFlightRecordAndTheRunGoesOn) {
  const std::string out = Path("out.txt"), err = Path("err.txt"), dir = Path("flight");
  pid_t pid =
      Spawn(kTrain + "--pp 2 --steps 8 --data-delay-us 20000 --flight-dir " + dir, out, err);
  ASSERT_TRUE(WaitForSteps(out, 2, std::chrono::seconds(60), pid)) << ReadAll(err);
  kill(pid, SIGUSR2);
  EXPECT_EQ(Reap(pid), 0) << ReadAll(err);
  EXPECT_EQ(StepLosses(ReadAll(out)).size(), 8u);
  const std::string text = ReadAll(err);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string file = dir + "/flight-rank-" + std::to_string(rank) + ".json";
    EXPECT_NE(text.find("flight: rank " + std::to_string(rank) + " (pipeline rank"),
              std::string::npos)
        << text;
    auto j = nlohmann::json::parse(std::ifstream(file), nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << file;
    EXPECT_EQ(j["rank"], rank);
    ASSERT_FALSE(j["entries"].empty());
    EXPECT_GE(j["entries"].back()["step"].get<int>(), 1);
  }
}

// A failed run (here an injected failure on rank 1 in step 1): every rank's record is written,
// and rank 0's shows the receive from rank 1 it was waiting on.
TEST_F(CliCheckpoint, AFailedRunWritesEveryRanksFlightRecord) {
  const std::string dir = Path("flight");
  Result r = RunCli(kTrain + "--pp 2 --steps 3 --inject-failure 1:1 --flight-dir " + dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("injected failure"), std::string::npos) << r.err;
  auto j = nlohmann::json::parse(std::ifstream(dir + "/flight-rank-0.json"), nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  const auto& last = j["entries"].back();
  EXPECT_EQ(last["step"], 1);
  EXPECT_TRUE(last["end_s"].is_null()) << last.dump();
  EXPECT_EQ(last["peer"], 1) << last.dump();
  EXPECT_NE(last["waiting_on"].get<std::string>().find("from rank 1"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir + "/flight-rank-1.json"));
  // The receive is waited for by the backward that needs it (Note [Receives posted ahead]).
  EXPECT_NE(r.err.find("flight: rank 0 (pipeline rank 0, replica 0): step 1, in B0@s0"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("waiting on RECV_B0@s0 from rank 1"), std::string::npos) << r.err;
}

}  // namespace
