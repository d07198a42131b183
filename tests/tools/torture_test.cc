// The adversarial pass of issue 34, repeatable: the `pipewright` binary killed between any two
// steps of a save, special files where files are expected, two writers on one directory, and
// damaged, foreign or mismatched checkpoints. Every case asserts what survives and what is said.
// Labelled `torture`; `scripts/torture` runs the label (also under ASan), and CI runs it with the
// rest of the suite (docs/input-limits.md, "Torture tests", lists the cases and their counts).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "pipewright/checkpoint.h"
#include "tests/tools/cli_util.h"

namespace {

namespace fs = std::filesystem;
using namespace pipewright::cli_test;

// Four steps of gpt-tiny, a save after each.
const std::string kTrain =
    "train --preset gpt-tiny --micro-batches 2 --micro-batch-size 2 --seed 5 --json ";

// The uninterrupted run's losses by step (six steps: the resumed runs below go up to six).
const std::map<int, double>& Reference() {
  static const std::map<int, double>* ref = [] {
    auto* m = new std::map<int, double>;
    Result r = RunCli(kTrain + "--steps 6");
    for (const auto& [step, loss] : StepLosses(r.out)) (*m)[step] = loss;
    return m;
  }();
  return *ref;
}

// Runs the binary with `env` (NAME=VALUE ...) under timeout(1), 120 s or
// $PIPEWRIGHT_TORTURE_TIMEOUT_S: a run that hangs is killed (137, or 124 if it exits on TERM);
// one killed by a crash point also exits 137, so the tests also check what the run printed.
Result RunEnv(const std::string& env, const std::string& args) {
  const char* limit = std::getenv("PIPEWRIGHT_TORTURE_TIMEOUT_S");
  return RunCliWith(
      "env " + env + " timeout -s KILL " + std::string(limit ? limit : "120") + " " + Bin(), args);
}
Result RunBounded(const std::string& args) { return RunEnv("", args); }
constexpr int kKilled = 137;  // 128 + SIGKILL, as timeout(1) reports it

class Torture : public CliDirTest {
 protected:
  Torture() : CliDirTest("torture_") {}
  void SetUp() override {
    ASSERT_EQ(Reference().size(), 6u) << "the reference run failed";
    CliDirTest::SetUp();
  }
};

// Every (step, loss) line equals the uninterrupted run's.
void ExpectReferenceLosses(const Result& r, const std::string& what) {
  for (const auto& [step, loss] : StepLosses(r.out)) {
    ASSERT_EQ(Reference().count(step), 1u) << what << ": step " << step;
    EXPECT_EQ(loss, Reference().at(step)) << what << ": step " << step;
  }
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

std::string Latest(const std::string& dir) {
  std::string line;
  std::getline(std::ifstream(dir + "/latest"), line);
  return line;
}

void FlipByte(const std::string& path) {
  std::string bytes = ReadAll(path);
  ASSERT_FALSE(bytes.empty()) << path;
  bytes[bytes.size() / 2] ^= 0x10;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A FIFO, a link to /dev/zero, or a sparse 1 GiB file in place of `path`.
enum class Special { kFifo, kDevZero, kSparse };
const char* SpecialName(Special s) {
  return s == Special::kFifo ? "fifo" : s == Special::kDevZero ? "devzero" : "sparse";
}
void MakeSpecial(const std::string& path, Special kind) {
  fs::remove(path);
  switch (kind) {
    case Special::kFifo:
      ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0) << path;
      break;
    case Special::kDevZero:
      fs::create_symlink("/dev/zero", path);
      break;
    case Special::kSparse: {
      const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY, 0644);
      ASSERT_GE(fd, 0) << path;
      ASSERT_EQ(::ftruncate(fd, int64_t{1} << 30), 0);
      ::close(fd);
      break;
    }
  }
}

// ---- kills between any two steps of a save (Note [Crash points]) ----

// How the directory looks before the run that is killed.
enum class Setup {
  kFresh,       // empty: the run saves steps 1..4 afresh, --keep 2 prunes at saves 3 and 4
  kReplace,     // steps 2 and 4 saved, step 4 damaged: the run falls back to step 2, saves step 3
                // afresh and then replaces the damaged step 4
  kCompleted,   // steps 1..4 saved: the restart of a finished run, which must write nothing
  kRenamedOut,  // steps 1..4 saved, then step 4 moved to step-000004.old-1 (what the old
                // two-rename save left when killed between its renames)
};
struct KillCase {
  const char* name;
  Setup setup;
  const char* point;  // PIPEWRIGHT_CRASH_AT, "" for none
  bool no_exchange;   // PIPEWRIGHT_NO_RENAME_EXCHANGE=1: the two-rename fallback
};
void PrintTo(const KillCase& c, std::ostream* os) { *os << c.name; }

class TortureKill : public Torture, public ::testing::WithParamInterface<KillCase> {};

TEST_P(TortureKill, EveryRestartResumesACompleteCheckpointBitIdentically) {
  const KillCase& c = GetParam();
  const std::string dir = Path("run");
  const std::string save = "--save-every 1 --save " + dir + " ";
  // The setup, uninterrupted.
  if (c.setup == Setup::kReplace) {
    ASSERT_EQ(RunBounded(kTrain + "--steps 4 --save-every 2 --save " + dir).exit_code, 0);
    FlipByte(dir + "/step-000004/model.safetensors");
  } else if (c.setup == Setup::kCompleted || c.setup == Setup::kRenamedOut) {
    ASSERT_EQ(RunBounded(kTrain + "--steps 4 " + save).exit_code, 0);
    if (c.setup == Setup::kRenamedOut) {
      fs::rename(dir + "/step-000004", dir + "/step-000004.old-1");
    }
  }
  std::map<std::string, fs::file_time_type> before;
  for (const std::string& e : Entries(dir)) {
    if (e != ".lock") before[e] = fs::last_write_time(dir + "/" + e);
  }
  std::string env = std::string("PIPEWRIGHT_CRASH_AT=") + c.point;
  if (c.no_exchange) env += " PIPEWRIGHT_NO_RENAME_EXCHANGE=1";
  const std::string args = kTrain + "--steps 4 --keep 2 --resume auto " + save;
  Result killed = RunEnv(env, args);
  ExpectReferenceLosses(killed, "the killed run");
  if (c.setup == Setup::kCompleted) {
    // A finished run has nothing to do: no save, so no crash point is reached; nothing changes.
    ASSERT_EQ(killed.exit_code, 0) << killed.err;
    EXPECT_NE(killed.err.find("nothing to train"), std::string::npos) << killed.err;
    EXPECT_TRUE(StepLosses(killed.out).empty());
    std::map<std::string, fs::file_time_type> after;
    for (const std::string& e : Entries(dir)) {
      if (e != ".lock") after[e] = fs::last_write_time(dir + "/" + e);
    }
    EXPECT_EQ(after, before) << "the finished run's directory changed";
    return;
  }
  if (*c.point != '\0') {
    ASSERT_EQ(killed.exit_code, kKilled) << "never reached " << c.point << "\n" << killed.err;
  }
  // Whatever the moment, the directory still holds a complete checkpoint: a reader finds one.
  const std::string named = Latest(dir);
  absl::StatusOr<pipewright::Checkpoint> readable = pipewright::ReadCheckpoint(dir);
  ASSERT_TRUE(readable.ok()) << c.name << ": " << readable.status();
  // The restart recovers and resumes from the step `latest` names, and finishes the run.
  Result rest = RunBounded(args);
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  ExpectReferenceLosses(rest, "the restart");
  auto steps = StepLosses(rest.out);
  const int from = named.empty() ? 0 : std::stoi(named.substr(5));
  if (from < 4) {
    ASSERT_FALSE(steps.empty()) << rest.err;
    EXPECT_EQ(steps.front().first, from) << rest.err;
  } else {
    EXPECT_NE(rest.err.find("nothing to train"), std::string::npos) << rest.err;
  }
  EXPECT_EQ(steps.empty() ? from : steps.back().first + 1, 4);
  EXPECT_EQ(Latest(dir), "step-000004");
  for (const std::string& e : Entries(dir)) {
    EXPECT_EQ(e.find(".tmp-"), std::string::npos) << c.name << ": debris left: " << e;
    EXPECT_EQ(e.find(".old-"), std::string::npos) << c.name << ": debris left: " << e;
    EXPECT_EQ(e.find(".pruned-"), std::string::npos) << c.name << ": debris left: " << e;
  }
  if (c.setup == Setup::kRenamedOut && *c.point == '\0') {
    EXPECT_NE(killed.err.find("restored the complete checkpoint '" + dir + "/step-000004.old-1'"),
              std::string::npos)
        << killed.err;
  }
  // The checkpoint left verifies.
  absl::StatusOr<pipewright::Checkpoint> last = pipewright::ReadCheckpoint(dir);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->path, dir + "/step-000004");
  EXPECT_TRUE(last->warnings.empty()) << last->warnings[0];
}

INSTANTIATE_TEST_SUITE_P(
    Points, TortureKill,
    ::testing::Values(
        KillCase{"fresh_tensors_written", Setup::kFresh, "checkpoint.tensors-written:2", false},
        KillCase{"fresh_manifest_written", Setup::kFresh, "checkpoint.manifest-written:2", false},
        KillCase{"fresh_renamed_into_place", Setup::kFresh, "checkpoint.renamed-into-place:2",
                 false},
        KillCase{"fresh_step_written", Setup::kFresh, "checkpoint.step-written:2", false},
        KillCase{"fresh_pointer_written", Setup::kFresh, "checkpoint.pointer-written:2", false},
        KillCase{"fresh_pointer_updated", Setup::kFresh, "checkpoint.pointer-updated:2", false},
        KillCase{"fresh_pruning_first", Setup::kFresh, "checkpoint.pruning:1", false},
        KillCase{"fresh_pruning_last", Setup::kFresh, "checkpoint.pruning:2", false},
        KillCase{"replace_exchanged", Setup::kReplace, "checkpoint.exchanged:1", false},
        KillCase{"replace_manifest_written", Setup::kReplace, "checkpoint.manifest-written:2",
                 false},
        KillCase{"replace_moved_aside", Setup::kReplace, "checkpoint.moved-aside:1", true},
        KillCase{"replace_renamed_into_place", Setup::kReplace, "checkpoint.renamed-into-place:2",
                 true},
        KillCase{"completed_exchange", Setup::kCompleted, "checkpoint.exchanged:1", false},
        KillCase{"completed_moved_aside", Setup::kCompleted, "checkpoint.moved-aside:1", true},
        KillCase{"renamed_out_restored", Setup::kRenamedOut, "", false},
        KillCase{"renamed_out_killed_restoring", Setup::kRenamedOut, "checkpoint.restored:1",
                 false}),
    [](const ::testing::TestParamInfo<KillCase>& info) { return std::string(info.param.name); });

// A directory of step directories none of which is a checkpoint: --resume auto neither starts
// over nor touches them.
TEST_F(Torture, ResumeAutoNeverStartsOverOnUnusableCheckpoints) {
  const std::string dir = Path("run");
  fs::create_directories(dir + "/step-000003");
  std::ofstream(dir + "/step-000003/model.safetensors") << "partial";
  Result r = RunBounded(kTrain + "--steps 4 --save " + dir + " --resume auto");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("step-000003/manifest.json' not found"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not start over"), std::string::npos) << r.err;
  EXPECT_TRUE(StepLosses(r.out).empty());
  EXPECT_EQ(ReadAll(dir + "/step-000003/model.safetensors"), "partial");
  // Nor does a run without --resume: it would replace them.
  r = RunBounded(kTrain + "--steps 4 --save " + dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("already holds checkpoints"), std::string::npos) << r.err;
  EXPECT_EQ(ReadAll(dir + "/step-000003/model.safetensors"), "partial");
}

// ---- special files where files are expected ----

struct SpecialCase {
  const char* file;  // relative to the checkpoint directory
  Special kind;
  int resumed_step;  // what train --resume continues from: 4, or 2 when step 4 is unusable
};
void PrintTo(const SpecialCase& c, std::ostream* os) {
  *os << c.file << "_" << SpecialName(c.kind);
}

class TortureSpecial : public Torture, public ::testing::WithParamInterface<SpecialCase> {};

TEST_P(TortureSpecial, IsRefusedWithoutBlockingAndTheNextCheckpointIsUsed) {
  const SpecialCase& c = GetParam();
  const std::string dir = Path("run");
  ASSERT_EQ(RunBounded(kTrain + "--steps 4 --save-every 2 --save " + dir).exit_code, 0);
  MakeSpecial(dir + "/" + c.file, c.kind);
  const std::string named = dir + "/" + c.file;
  Result r = RunBounded(kTrain + "--steps 6 --resume " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto steps = StepLosses(r.out);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.front().first, c.resumed_step);
  ExpectReferenceLosses(r, named);
  // The file is named in a warning.
  EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
  Result e = RunBounded("eval --batches 1 --checkpoint " + dir);
  ASSERT_EQ(e.exit_code, 0) << e.err;
  EXPECT_NE(e.out.find("at step " + std::to_string(c.resumed_step)), std::string::npos) << e.out;
}

INSTANTIATE_TEST_SUITE_P(
    Files, TortureSpecial,
    ::testing::Values(SpecialCase{"latest", Special::kFifo, 4},
                      SpecialCase{"latest", Special::kDevZero, 4},
                      SpecialCase{"latest", Special::kSparse, 4},
                      SpecialCase{"step-000004/manifest.json", Special::kFifo, 2},
                      SpecialCase{"step-000004/manifest.json", Special::kDevZero, 2},
                      SpecialCase{"step-000004/manifest.json", Special::kSparse, 2},
                      SpecialCase{"step-000004/manifest.json.sha256", Special::kFifo, 2},
                      SpecialCase{"step-000004/manifest.json.sha256", Special::kDevZero, 2},
                      SpecialCase{"step-000004/manifest.json.sha256", Special::kSparse, 2},
                      SpecialCase{"step-000004/model.safetensors", Special::kFifo, 2},
                      SpecialCase{"step-000004/model.safetensors", Special::kDevZero, 2},
                      SpecialCase{"step-000004/optimizer.safetensors", Special::kSparse, 2}),
    [](const ::testing::TestParamInfo<SpecialCase>& info) {
      std::string name = std::string(info.param.file) + "_" + SpecialName(info.param.kind);
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

// Data and corpus inputs that are not regular files: a usage error naming the kind of file.
TEST_F(Torture, SpecialDataFilesAreUsageErrors) {
  for (Special kind : {Special::kFifo, Special::kDevZero}) {
    const std::string data = Path(std::string("data_") + SpecialName(kind));
    MakeSpecial(data, kind);
    const std::string said =
        kind == Special::kFifo ? "is a FIFO, not a regular file" : "is a character device";
    for (const std::string& args :
         {kTrain + "--steps 1 --data " + data,
          "data prepare --input " + data + " --output " + Path("out.tokens")}) {
      Result r = RunBounded(args);
      EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
      EXPECT_NE(r.err.find(said), std::string::npos) << args << "\n" << r.err;
    }
  }
  // A checkpoint to evaluate, on a FIFO.
  ASSERT_EQ(RunBounded(kTrain + "--steps 1 --save " + Path("ck")).exit_code, 0);
  MakeSpecial(Path("fifo"), Special::kFifo);
  Result e = RunBounded("eval --checkpoint " + Path("ck") + " --data " + Path("fifo"));
  EXPECT_EQ(e.exit_code, 2) << e.err;
  EXPECT_NE(e.err.find("is a FIFO"), std::string::npos) << e.err;
}

// `data prepare --input X --output X` would replace the text by its tokens.
TEST_F(Torture, DataPrepareNeverWritesOverItsInput) {
  const std::string text = Path("corpus.txt");
  std::ofstream(text) << std::string(4096, 'a');
  fs::create_hard_link(text, Path("same.txt"));
  for (const std::string& out : {text, Path("same.txt")}) {
    Result r = RunBounded("data prepare --input " + text + " --output " + out);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("is the input file"), std::string::npos) << r.err;
    EXPECT_EQ(ReadAll(text), std::string(4096, 'a'));
  }
}

// ---- two writers, one directory (Note [Checkpoint lock]) ----

TEST_F(Torture, ASecondWriterIsRefusedAndTheFirstIsUndisturbed) {
  const std::string dir = Path("run"), out = Path("a.out"), err = Path("a.err");
  const std::string args =
      kTrain + "--steps 6 --save-every 1 --resume auto --data-delay-us 100000 --save " + dir;
  pid_t first = Spawn(args, out, err);
  ASSERT_TRUE(WaitForSteps(out, 1, std::chrono::seconds(120), first)) << ReadAll(err);
  Result second = RunBounded(args);
  EXPECT_EQ(second.exit_code, 2) << second.err;
  EXPECT_NE(second.err.find("is in use by another run (pid " + std::to_string(first)),
            std::string::npos)
      << second.err;
  EXPECT_TRUE(StepLosses(second.out).empty());
  ASSERT_EQ(Reap(first), 0) << ReadAll(err);
  Result a{0, ReadAll(out), ReadAll(err)};
  EXPECT_EQ(StepLosses(a.out).size(), 6u);
  ExpectReferenceLosses(a, "the first writer");
  EXPECT_EQ(Latest(dir), "step-000006");
  // The kernel releases the lock of a killed writer: the next run resumes its checkpoint.
  pid_t killed = Spawn(kTrain +
                           "--steps 100 --save-every 1 --resume auto --data-delay-us "
                           "100000 --save " +
                           Path("k"),
                       out, err);
  ASSERT_TRUE(WaitForSteps(out, 2, std::chrono::seconds(120), killed)) << ReadAll(err);
  kill(killed, SIGKILL);
  Reap(killed);
  Result after = RunBounded(kTrain + "--steps 6 --resume auto --save " + Path("k"));
  EXPECT_EQ(after.exit_code, 0) << after.err;
  ExpectReferenceLosses(after, "after the killed writer");
}

// An unwritable --save, or an output that would block (a FIFO), fails at the start, before any
// step.
TEST_F(Torture, UnwritableOutputsFailBeforeTraining) {
  std::ofstream(Path("file")) << "x";
  Result r = RunBounded(kTrain + "--steps 2 --save " + Path("file") + "/ck");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--save: cannot create checkpoint directory"), std::string::npos) << r.err;
  EXPECT_TRUE(StepLosses(r.out).empty());
  MakeSpecial(Path("fifo"), Special::kFifo);
  for (const char* flag : {"--trace", "--svg", "--calibrate-out"}) {
    r = RunBounded(kTrain + "--steps 2 " + flag + " " + Path("fifo"));
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(std::string(flag) + " '" + Path("fifo") + "': it is a FIFO"),
              std::string::npos)
        << r.err;
    EXPECT_TRUE(StepLosses(r.out).empty());
  }
}

// ---- checkpoints that verify but must not be used as they are ----

// A tensor file the manifest does not list is never read (it was not verified).
TEST_F(Torture, UnlistedTensorFilesAreIgnoredWithAWarning) {
  const std::string dir = Path("run");
  ASSERT_EQ(RunBounded(kTrain + "--steps 2 --save " + dir).exit_code, 0);
  // A shard-like file holding every parameter again, with one changed.
  absl::StatusOr<pipewright::SafetensorsFile> model =
      pipewright::ReadSafetensors(dir + "/step-000002/model.safetensors");
  ASSERT_TRUE(model.ok()) << model.status();
  pipewright::Tensor bias = model->tensors.at("ln_f.bias").Clone();
  bias.data<float>()[0] += 1.0f;
  ASSERT_TRUE(
      pipewright::WriteSafetensors(dir + "/step-000002/model-p9.safetensors", {{"ln_f.bias", bias}})
          .ok());
  Result r = RunBounded(kTrain + "--steps 4 --resume " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("model-p9.safetensors: not listed in the manifest (not verified): ignored"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(StepLosses(r.out).size(), 2u);
  ExpectReferenceLosses(r, "an unlisted file beside the checkpoint");
}

// The newest checkpoint verifies but does not suit the run (a misshapen tensor, rewritten with
// valid digests): the previous one is used, with a warning naming why.
TEST_F(Torture, ADigestValidButUnusableNewestFallsBack) {
  const std::string dir = Path("run");
  ASSERT_EQ(RunBounded(kTrain + "--steps 4 --save-every 2 --save " + dir).exit_code, 0);
  const std::string step4 = dir + "/step-000004";
  absl::StatusOr<pipewright::Checkpoint> ck = pipewright::ReadCheckpoint(step4);
  ASSERT_TRUE(ck.ok()) << ck.status();
  pipewright::NamedTensors model, opt;
  for (auto& [name, t] : ck->model) {
    model.emplace_back(name,
                       name == "ln_f.bias" ? pipewright::Tensor::FromVector({3}, {0, 0, 0}) : t);
  }
  for (auto& [name, t] : ck->optimizer) opt.emplace_back(name, t);
  ASSERT_TRUE(pipewright::WriteCheckpoint(step4, ck->manifest_json, model, opt).ok());
  Result r = RunBounded(kTrain + "--steps 6 --resume " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("unusable checkpoint skipped: " + step4 +
                       "/model.safetensors: tensor 'ln_f.bias' is [3]"),
            std::string::npos)
      << r.err;
  auto steps = StepLosses(r.out);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.front().first, 2);
  ExpectReferenceLosses(r, "fallen back to step 2");
  // eval reads the same way, and names the checkpoint it read.
  Result e = RunBounded("eval --batches 1 --checkpoint " + dir);
  ASSERT_EQ(e.exit_code, 0) << e.err;
  EXPECT_NE(e.out.find("at step 2"), std::string::npos) << e.out;
  EXPECT_NE(e.err.find(step4), std::string::npos) << e.err;
}

// eval names the manifest it read, not the directory's: DIR/step-NNNNNN/manifest.json.
TEST_F(Torture, EvalNamesTheManifestItRead) {
  const std::string dir = Path("run");
  ASSERT_EQ(RunBounded(kTrain + "--steps 1 --save " + dir).exit_code, 0);
  const std::string step = dir + "/step-000001";
  absl::StatusOr<pipewright::Checkpoint> ck = pipewright::ReadCheckpoint(step);
  ASSERT_TRUE(ck.ok()) << ck.status();
  nlohmann::json m = nlohmann::json::parse(ck->manifest_json);
  pipewright::NamedTensors model(ck->model.begin(), ck->model.end()),
      opt(ck->optimizer.begin(), ck->optimizer.end());
  // Digest-valid, but not a GPT this runtime rebuilds: a string, and a float no integer holds.
  for (const nlohmann::json& layers : {nlohmann::json("eight"), nlohmann::json(1e300)}) {
    m["model"]["gpt"]["layers"] = layers;
    ASSERT_TRUE(pipewright::WriteCheckpoint(step, m.dump(), model, opt).ok());
    Result e = RunBounded("eval --batches 1 --checkpoint " + dir);
    EXPECT_EQ(e.exit_code, 2) << e.err;
    EXPECT_NE(e.err.find(step + "/manifest.json: model.gpt.layers is " + layers.dump() +
                         ": expected an integer"),
              std::string::npos)
        << e.err;
    EXPECT_EQ(e.err.find(dir + "/manifest.json"), std::string::npos) << e.err;
  }
}

// ---- resume checks ----

TEST_F(Torture, ResumeSaysWhatItResumesAndRefusesOrWarnsOnEachMismatch) {
  const std::string dir = Path("run");
  ASSERT_EQ(RunBounded(kTrain + "--steps 4 --save-every 2 --save " + dir).exit_code, 0);
  // Another seed would continue on another sample order: refused, naming both.
  const std::string no_seed =
      "train --preset gpt-tiny --micro-batches 2 --micro-batch-size 2 --json --steps 6 --resume " +
      dir;
  Result r = RunBounded(no_seed + " --seed 2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("rng.seed is 5, this run's seed is 2"), std::string::npos) << r.err;
  EXPECT_TRUE(StepLosses(r.out).empty());
  // Without --seed the checkpoint's is taken.
  r = RunBounded(no_seed);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ExpectReferenceLosses(r, "the checkpoint's seed");
  // What the checkpoint's run was: its layout, seed and data.
  EXPECT_NE(r.err.find("resumed from " + dir +
                       "/step-000004 at step 4 (saved by a pp 1 x dp 1 run, seed 5, data "
                       "synthetic (repeated patterns))"),
            std::string::npos)
      << r.err;
  // --steps below the checkpoint's step: refused; equal: nothing to do, nothing written.
  r = RunBounded(kTrain + "--steps 3 --resume " + dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("is at step 4, past --steps 3"), std::string::npos) << r.err;
  r = RunBounded(kTrain + "--steps 4 --resume " + dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("nothing to train"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("\"final_step\":4"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("0.0000"), std::string::npos) << r.out;
  // A longer run re-spans the cosine schedule: said, with the rate before and after.
  r = RunBounded(kTrain + "--steps 6 --resume " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("learning-rate schedule differs from the checkpoint's (total steps 4 -> 6)"),
            std::string::npos)
      << r.err;
  // Other data: said.
  const std::string text = Path("text.txt");
  std::ofstream(text) << std::string(5000, 'x');
  r = RunBounded(kTrain + "--steps 5 --resume " + dir + " --data " + text);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("the checkpoint was trained on synthetic"), std::string::npos) << r.err;
}

// Note [Resume across dp]: a checkpoint resumes under another dp or micro-batching to fp32
// rounding, said on stderr; under the same dp and micro-batching (any pp), bit for bit.
TEST_F(Torture, ResumeUnderAnotherDpIsWithinRoundingAndSaysSo) {
  const std::string base =
      "train --preset gpt-tiny --seed 7 --json --steps 6 --micro-batch-size 2 ";
  Result full = RunBounded(base + "--pp 2 --dp 2 --micro-batches 4");
  ASSERT_EQ(full.exit_code, 0) << full.err;
  auto want = StepLosses(full.out);
  ASSERT_EQ(want.size(), 6u);
  const std::string dir = Path("dp2");
  ASSERT_EQ(
      RunBounded(base + "--pp 2 --dp 2 --micro-batches 4 --stop-after 3 --save " + dir).exit_code,
      0);
  Result same = RunBounded(base + "--pp 1 --dp 2 --micro-batches 4 --resume " + dir);
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_EQ(same.err.find("agree with an uninterrupted run to fp32 rounding"), std::string::npos);
  for (const auto& [step, loss] : StepLosses(same.out)) EXPECT_EQ(loss, want[step].second);
  Result other = RunBounded(
      "train --preset gpt-tiny --seed 7 --json --steps 6 --micro-batch-size 4 --pp 2 "
      "--dp 1 --micro-batches 4 --resume " +
      dir);
  ASSERT_EQ(other.exit_code, 0) << other.err;
  EXPECT_NE(other.err.find("written at dp 2 x 4 micro-batches of 2, resumed at dp 1 x 4 of 4"),
            std::string::npos)
      << other.err;
  auto got = StepLosses(other.out);
  ASSERT_EQ(got.size(), 3u);
  for (const auto& [step, loss] : got) {
    EXPECT_NEAR(loss, want[step].second, 1e-5 * std::abs(want[step].second)) << step;
  }
}

}  // namespace
