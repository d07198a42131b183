// `pipewright train` under mpirun (one process per rank) against the in-process run: the same
// losses bit for bit, a world size that does not match the layout rejected on every rank, and
// a rank that fails mid-step ending the whole job with its error instead of a hang.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/tools/cli_util.h"

namespace {

using namespace pipewright::cli_test;

// mpirun with the settings that work on one machine without a network, as root, with more
// processes than cores (Open MPI; tests/tools/CMakeLists.txt passes the launcher).
const std::string kMpiEnv =
    "env OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_pml=ob1 "
    "OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_ALLOW_RUN_AS_ROOT=1 "
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";

// The command line that starts `program` (default: the binary) in `np` processes.
std::string MpiLauncher(int np, const std::string& program = Bin()) {
  return kMpiEnv + PIPEWRIGHT_MPIEXEC + " " + PIPEWRIGHT_MPIEXEC_FLAGS + " -np " +
         std::to_string(np) + " " + program;
}

Result RunMpi(int np, const std::string& args) { return RunCliWith(MpiLauncher(np), args); }

const std::string kBase =
    "train --preset gpt-tiny --micro-batch-size 2 --steps 4 --seed 7 --json --timeout 30 ";

TEST(CliMpi, FourProcessesPp2Dp2MatchTheInProcessRunBitForBit) {
  const std::string layout = "--pp 2 --dp 2 --schedule 1f1b --micro-batches 4";
  Result local = RunCli(kBase + layout);
  ASSERT_EQ(local.exit_code, 0) << local.err;
  Result mpi = RunMpi(4, kBase + layout);
  ASSERT_EQ(mpi.exit_code, 0) << mpi.err;
  std::vector<double> want = Losses(local);
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ(Losses(mpi), want);
  // Only rank 0 prints: four step lines and one summary, not four of each.
  EXPECT_EQ(JsonLines(mpi.out).size(), 5u) << mpi.out;
}

// The Llama family across processes (docs/models.md): the in-process run's losses bit for bit.
TEST(CliMpi, LlamaFourProcessesPp2Dp2MatchTheInProcessRun) {
  const std::string args =
      "train --preset llama-tiny --micro-batch-size 2 --steps 3 --seed 7 --json --timeout 30 "
      "--pp 2 --dp 2 --micro-batches 4";
  Result local = RunCli(args);
  ASSERT_EQ(local.exit_code, 0) << local.err;
  Result mpi = RunMpi(4, args);
  ASSERT_EQ(mpi.exit_code, 0) << mpi.err;
  ASSERT_EQ(Losses(local).size(), 3u);
  EXPECT_EQ(Losses(mpi), Losses(local));
}

// Gradient compression over MPI: bf16 (all-gather of the bf16 buckets, fp32 sum in replica
// order on every receiver) and PowerSGD (all-gathered factors summed in replica order) give the
// in-process run's losses bit for bit, with the same byte counts.
TEST(CliMpi, GradCompressionMatchesTheInProcessRun) {
  for (const char* c : {"bf16", "powersgd:2"}) {
    const std::string layout =
        std::string("--pp 2 --dp 2 --schedule 1f1b --micro-batches 4 --grad-compression ") + c;
    Result local = RunCli(kBase + layout);
    ASSERT_EQ(local.exit_code, 0) << local.err;
    Result mpi = RunMpi(4, kBase + layout);
    ASSERT_EQ(mpi.exit_code, 0) << c << ": " << mpi.err;
    ASSERT_EQ(Losses(local).size(), 4u);
    EXPECT_EQ(Losses(mpi), Losses(local)) << c;
    std::vector<nlohmann::json> lines = JsonLines(mpi.out), local_lines = JsonLines(local.out);
    ASSERT_FALSE(lines.empty());
    ASSERT_TRUE(lines.back().contains("summary")) << mpi.out;
    const double ratio = lines.back()["summary"]["grad_compression_ratio"].get<double>();
    EXPECT_EQ(ratio, local_lines.back()["summary"]["grad_compression_ratio"].get<double>()) << c;
    if (std::string(c) == "bf16") {
      EXPECT_EQ(ratio, 2.0) << mpi.out;
    }
  }
}

// Tensor parallelism under mpirun (docs/runtime.md, "Tensor parallelism"): tp 2 x pp 2 x dp 2 in
// eight processes gives the in-process run's losses bit for bit, with and without sequence
// parallelism; its checkpoint (whole tensors) resumes in one process at pp 1, bit-identically at
// tp 2 and within rounding at tp 1.
TEST(CliMpi, EightProcessesTp2Pp2Dp2MatchTheInProcessRunAndResumeAtAnyTp) {
  const std::string base =
      "train --preset gpt-tiny --micro-batch-size 2 --seed 7 --json --timeout 60 --steps 6 "
      "--micro-batches 4 ";
  for (const std::string extra : {"", "--sequence-parallel "}) {
    const std::string layout = extra + "--tp 2 --pp 2 --dp 2 ";
    Result local = RunCli(base + layout);
    ASSERT_EQ(local.exit_code, 0) << local.err;
    const std::vector<double> want = Losses(local);
    ASSERT_EQ(want.size(), 6u);
    Result mpi = RunMpi(8, base + layout);
    ASSERT_EQ(mpi.exit_code, 0) << extra << mpi.err;
    EXPECT_EQ(Losses(mpi), want) << extra;
    const std::string dir = TempPath("mpi_tp_" + std::to_string(getpid()));
    std::filesystem::remove_all(dir);
    Result first = RunMpi(8, base + layout + "--stop-after 3 --save " + dir);
    ASSERT_EQ(first.exit_code, 0) << extra << first.err;
    Result same_tp = RunCli(base + extra + "--tp 2 --dp 2 --resume " + dir);
    ASSERT_EQ(same_tp.exit_code, 0) << same_tp.err;
    std::vector<double> got = Losses(first), tail = Losses(same_tp);
    got.insert(got.end(), tail.begin(), tail.end());
    EXPECT_EQ(got, want) << extra << "mpirun tp 2 -> one process tp 2 pp 1";
    Result one = RunCli(base + "--dp 2 --resume " + dir);
    ASSERT_EQ(one.exit_code, 0) << one.err;
    const std::vector<double> rest = Losses(one);
    ASSERT_EQ(rest.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(rest[i], want[3 + i], 1e-5 * want[3 + i]) << i;
    if (!HasFailure()) std::filesystem::remove_all(dir);
  }
}

// A launcher's processes write one checkpoint together (Note [Collective checkpoints]): each its
// own stage's files, the root the manifest. It resumes in one process under another pipeline
// depth, and a one-process checkpoint resumes under mpirun, bit-identically; with PowerSGD the
// per-replica state travels too.
TEST(CliMpi, MultiProcessCheckpointsResumeUnderAnyLayout) {
  const std::string base =
      "train --preset gpt-tiny --micro-batch-size 2 --seed 7 --json --timeout 30 --steps 8 "
      "--micro-batches 4 ";
  const std::string dir = TempPath("mpi_ckpt_" + std::to_string(getpid()));
  // --zero 1 and 2: the shards of the optimizer state are gathered to replica 0, which writes
  // the whole state (optimizer-p<P>.safetensors) as under --zero 0.
  for (const std::string extra : {"", "--grad-compression powersgd:2 ", "--zero 1 ", "--zero 2 "}) {
    Result full = RunCli(base + extra + "--pp 2 --dp 2");
    ASSERT_EQ(full.exit_code, 0) << full.err;
    const std::vector<double> want = Losses(full);
    ASSERT_EQ(want.size(), 8u);
    // pp = 4 x dp = 2 in eight processes, then pp = 2 x dp = 2 in one.
    std::filesystem::remove_all(dir);
    Result first = RunMpi(8, base + extra + "--pp 4 --dp 2 --stop-after 4 --save " + dir);
    ASSERT_EQ(first.exit_code, 0) << extra << first.err;
    EXPECT_TRUE(std::filesystem::exists(dir + "/step-000004/model-p3.safetensors"));
    EXPECT_TRUE(std::filesystem::exists(dir + "/step-000004/optimizer-p3.safetensors"));
    EXPECT_FALSE(std::filesystem::exists(dir + "/step-000004/optimizer-p3-r1.safetensors"));
    Result rest = RunCli(base + extra + "--pp 2 --dp 2 --resume " + dir);
    ASSERT_EQ(rest.exit_code, 0) << rest.err;
    std::vector<double> got = Losses(first), tail = Losses(rest);
    got.insert(got.end(), tail.begin(), tail.end());
    EXPECT_EQ(got, want) << extra << "mpirun pp=4 -> one process pp=2";
    // The reverse: one process pp = 1 x dp = 2, then four processes pp = 2 x dp = 2.
    std::filesystem::remove_all(dir);
    first = RunCli(base + extra + "--pp 1 --dp 2 --stop-after 4 --save " + dir);
    ASSERT_EQ(first.exit_code, 0) << first.err;
    rest = RunMpi(4, base + extra + "--pp 2 --dp 2 --resume " + dir);
    ASSERT_EQ(rest.exit_code, 0) << extra << rest.err;
    got = Losses(first);
    tail = Losses(rest);
    got.insert(got.end(), tail.begin(), tail.end());
    EXPECT_EQ(got, want) << extra << "one process pp=1 -> mpirun pp=2";
  }
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

// Preemption under mpirun (docs/runtime.md, Note [Preemption]): SIGUSR1 to mpirun reaches every
// process; the step agreement makes them stop after the same step, they save one checkpoint
// together and the job exits 0 with the summary; resuming it continues bit-identically. (mpirun
// ends the job itself on SIGTERM; Slurm's srun sends SIGTERM to each task.)
TEST(CliMpi, Sigusr1StopsEveryProcessAfterTheSameStepAndSaves) {
  const std::string tag = std::to_string(getpid());
  const std::string out = TempPath("mpi_stop_out_" + tag), err = TempPath("mpi_stop_err_" + tag);
  const std::string dir = TempPath("mpi_stop_ckpt_" + tag);
  std::filesystem::remove_all(dir);
  const std::string launcher = MpiLauncher(4);
  const std::string train =
      "train --preset gpt-tiny --micro-batch-size 2 --seed 7 --json --timeout 30 --pp 2 --dp 2 "
      "--micro-batches 4 --steps 100000 ";
  pid_t pid = SpawnWith(launcher, train + "--save " + dir, out, err);
  if (!WaitForSteps(out, 3, std::chrono::seconds(120), pid)) {
    kill(pid, SIGKILL);
    Reap(pid);
    FAIL() << ReadAll(err);
  }
  kill(pid, SIGUSR1);
  EXPECT_EQ(Reap(pid), 0) << ReadAll(err);
  const std::string text = ReadAll(out);
  const size_t steps = StepLosses(text).size();
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06zu", steps);
  EXPECT_NE(ReadAll(err).find("stopped by request after step " + std::to_string(steps) +
                              ", checkpoint " + dir + "/" + name),
            std::string::npos)
      << ReadAll(err);
  EXPECT_NE(text.find("\"summary\""), std::string::npos) << "every process gathered reports";
  // Resumed in one process for three more steps: the uninterrupted run's losses.
  Result want = RunCli(train + "--stop-after " + std::to_string(steps + 3));
  ASSERT_EQ(want.exit_code, 0) << want.err;
  Result rest = RunCli(train + "--stop-after 3 --resume " + dir);
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  std::vector<double> got = Losses(JsonLines(text)), tail = Losses(rest);
  got.insert(got.end(), tail.begin(), tail.end());
  EXPECT_EQ(got, Losses(want));
  if (!HasFailure()) {
    for (const std::string& p : {out, err, dir}) std::filesystem::remove_all(p);
  }
}

// SIGTERM to mpirun: Open MPI forwards it to every process, which stop after the same step and
// save one complete checkpoint together, as with SIGUSR1; mpirun itself then exits non-zero
// (it counts a SIGTERM as an abnormal end of the job: docs/cluster.md, "Preemption").
TEST(CliMpi, SigtermToMpirunStillSavesACompleteCheckpoint) {
  const std::string tag = std::to_string(getpid());
  const std::string out = TempPath("mpi_term_out_" + tag), err = TempPath("mpi_term_err_" + tag);
  const std::string dir = TempPath("mpi_term_ckpt_" + tag);
  std::filesystem::remove_all(dir);
  const std::string launcher = MpiLauncher(2);
  const std::string train =
      "train --preset gpt-tiny --micro-batch-size 2 --seed 7 --json --timeout 30 --pp 2 "
      "--micro-batches 4 --steps 100000 ";
  pid_t pid = SpawnWith(launcher, train + "--save " + dir, out, err);
  if (!WaitForSteps(out, 2, std::chrono::seconds(120), pid)) {
    kill(pid, SIGKILL);
    Reap(pid);
    FAIL() << ReadAll(err);
  }
  kill(pid, SIGTERM);
  Reap(pid);
  // mpirun stops forwarding output once terminated: the checkpoint, not the log, says the step.
  const size_t printed = StepLosses(ReadAll(out)).size();
  std::string name;
  std::getline(std::ifstream(dir + "/latest"), name);
  ASSERT_EQ(name.rfind("step-", 0), 0u) << ReadAll(err);
  EXPECT_GE(std::stoul(name.substr(5)), printed);
  Result rest = RunCli(train + "--stop-after 1 --resume " + dir);
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  EXPECT_NE(rest.err.find("resumed from " + dir + "/" + name), std::string::npos) << rest.err;
  EXPECT_EQ(rest.err.find("warning"), std::string::npos) << rest.err;
  if (!HasFailure()) {
    for (const std::string& p : {out, err, dir}) std::filesystem::remove_all(p);
  }
}

// Asynchronous DP over MPI (Note [Async DP]): each process's service thread answers the other
// replicas' pulls and pushes while its own thread computes; the root reports every replica, the
// bound holds, the loss falls, and the checkpoint the processes wrote together resumes in one.
TEST(CliMpi, AsyncDataParallelismAcrossProcesses) {
  const std::string dir = TempPath("mpi_async_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const std::string base =
      "train --preset gpt-tiny --micro-batch-size 2 --seed 7 --json --timeout 30 --pp 2 --dp 2 "
      "--micro-batches 2 --dp-mode async --staleness 2 ";
  Result mpi = RunMpi(4, base + "--steps 8 --slow-replica 1:2 --save " + dir);
  ASSERT_EQ(mpi.exit_code, 0) << mpi.err;
  std::vector<nlohmann::json> lines = JsonLines(mpi.out);
  ASSERT_FALSE(lines.empty());
  ASSERT_TRUE(lines.back().contains("summary")) << mpi.out;
  const nlohmann::json& s = lines.back()["summary"];
  ASSERT_EQ(s["async_replicas"].size(), 2u) << mpi.out;
  int64_t steps = 0;
  for (const auto& rep : s["async_replicas"]) {
    EXPECT_LE(rep["max_staleness"].get<int64_t>(), 2);
    steps += rep["steps"].get<int64_t>();
  }
  EXPECT_EQ(steps, 16);
  std::vector<double> losses = Losses(mpi);
  ASSERT_EQ(losses.size(), 8u);
  EXPECT_LT(losses.back(), losses.front());
  Result rest = RunCli(base + "--steps 10 --resume " + dir);
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  EXPECT_EQ(Losses(rest).size(), 2u);
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

TEST(CliMpi, FourProcessPipelineAndTwoProcessZeroBubbleMatch) {
  for (auto [np, layout] : {std::pair{4, "--pp 4 --schedule 1f1b --micro-batches 8"},
                            std::pair{2, "--pp 2 --schedule zb-h1 --micro-batches 8"}}) {
    Result local = RunCli(kBase + layout);
    ASSERT_EQ(local.exit_code, 0) << local.err;
    Result mpi = RunMpi(np, kBase + layout);
    ASSERT_EQ(mpi.exit_code, 0) << layout << ": " << mpi.err;
    EXPECT_EQ(Losses(mpi), Losses(local)) << layout;
    // The summary describes every rank, gathered from every process.
    std::vector<nlohmann::json> lines = JsonLines(mpi.out);
    ASSERT_FALSE(lines.empty());
    ASSERT_TRUE(lines.back().contains("summary"));
    EXPECT_EQ(lines.back()["summary"]["ranks"].size(), static_cast<size_t>(np)) << layout;
  }
}

TEST(CliMpi, WrongWorldSizeIsAClearErrorOnEveryRank) {
  Result r = RunMpi(3, kBase + "--pp 2 --dp 2 --micro-batches 4");
  EXPECT_NE(r.exit_code, 0);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(r.err.find("rank " + std::to_string(rank) +
                         ": the layout needs pp x dp = 2 x 2 = 4 processes, but 3 were started"),
              std::string::npos)
        << r.err;
  }
}

TEST(CliMpi, ARankFailingMidStepEndsTheJobWithItsError) {
  Result r = RunMpi(4, kBase + "--pp 2 --dp 2 --micro-batches 4 --inject-failure 1:2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("rank 1 (pipeline rank 1, replica 0)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("injected failure"), std::string::npos) << r.err;
  // Said twice: by the failing process, and relayed once by the root (the other processes, which
  // fail with the same relayed error, say nothing: kRelayedAbortPayload).
  size_t said = 0;
  const std::string relayed = "pipewright: rank 1 aborted: ";
  for (size_t at = r.err.find(relayed); at != std::string::npos; at = r.err.find(relayed, at + 1)) {
    ++said;
  }
  EXPECT_EQ(said, 1u) << r.err;
  // The steps before the failure were reported by rank 0, the failed one was not.
  EXPECT_EQ(Losses(r).size(), 2u) << r.out;
  // Every rank learned of the failure and reached the end, so they finalised MPI normally: the
  // MPI_Abort for a silent peer (Note [Leaving after a failure]) was not needed.
  EXPECT_EQ(r.err.find("did not reach the end of the run"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("MPI_ABORT was invoked"), std::string::npos) << r.err;
}

// A process that dies (SIGKILL, no chance to say goodbye) must not leave the others waiting
// forever: the launcher or the receive timeouts end the job with an error.
TEST(CliMpi, AKilledRankEndsTheJob) {
  // Rank 1 kills itself one second in; `exec` keeps the shell's pid for the pipewright process.
  const std::string wrapper =
      "bash -c 'if [ \"${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}\" = 1 ]; then "
      "(sleep 1; kill -9 $$) & fi; exec \"$0\" \"$@\"' " +
      Bin();
  Result r = RunCliWith(MpiLauncher(4, wrapper),
                        "train --preset gpt-tiny --micro-batch-size 2 --steps 100000 --timeout 10 "
                        "--pp 2 --dp 2 --micro-batches 4 --json");
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_FALSE(r.err.empty());
}

// A checkpoint written by one process resumes under mpirun and continues like it does in one
// process.
TEST(CliMpi, ResumesAnInProcessCheckpoint) {
  const std::string dir = TempPath("mpi_resume_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const std::string layout = "--pp 2 --dp 2 --micro-batches 4 ";
  Result saved = RunCli(kBase + layout + "--stop-after 2 --save " + dir);
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  Result local = RunCli(kBase + layout + "--resume " + dir);
  ASSERT_EQ(local.exit_code, 0) << local.err;
  Result mpi = RunMpi(4, kBase + layout + "--resume " + dir);
  ASSERT_EQ(mpi.exit_code, 0) << mpi.err;
  EXPECT_EQ(Losses(mpi), Losses(local));
  EXPECT_EQ(Losses(mpi).size(), 2u);
  std::filesystem::remove_all(dir);
}

}  // namespace
