// End-to-end: `pipewright plan` writes a plan that `validate` accepts and `train --plan` runs
// unchanged, with the predicted and measured per-stage numbers side by side.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
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

// --zero 2 (ZeRO-2): the table, the best line and the written plan say so; the plan validates.
// --zero 3 is refused naming the flag.
TEST(CliPlan, ZeroTwoIsPlannedShownAndWritten) {
  const std::string plan = TempPath("plan_zero2_" + std::to_string(getpid()) + ".json");
  Result p = RunCli(
      "plan --preset gpt-tiny --devices 4 --pp 2 --schedule 1f1b --micro-batch-size 2 "
      "--micro-batches 4 --device-memory 1GiB --zero 2 -o " +
      plan);
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(p.out.find("best: pp=2 dp=2 zero=2 1f1b"), std::string::npos) << p.out;
  EXPECT_NE(p.out.find("   2  1f1b"), std::string::npos) << "the table's zero column\n" << p.out;
  json pj = ReadJson(plan);
  ASSERT_TRUE(pj.is_object());
  EXPECT_EQ(pj["zero"], 2);
  Result v = RunCli("validate " + plan);
  EXPECT_EQ(v.exit_code, 0) << v.err;
  EXPECT_NE(v.out.find("zero=2"), std::string::npos) << v.out;
  Result j = RunCli(
      "plan --preset gpt-tiny --devices 4 --pp 2 --schedule 1f1b --micro-batch-size 2 "
      "--micro-batches 4 --device-memory 1GiB --zero 2 --json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  json out = json::parse(j.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << j.out;
  EXPECT_EQ(out["best"][0]["zero"], 2);
  for (const char* zero : {"3", "-1"}) {
    Result bad = RunCli(std::string("plan --preset gpt-tiny --devices 4 --zero ") + zero);
    EXPECT_EQ(bad.exit_code, 2) << zero;
    EXPECT_NE(bad.err.find("--zero"), std::string::npos) << bad.err;
  }
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

// --- hostile files (issue 34): every file a subcommand reads or writes -----------------------

// Under the shell's `timeout 60`: a blocked open shows as exit 124, not as a hung test.
Result RunBounded(const std::string& args) { return RunCliWith("timeout 60 " + Bin(), args); }

#define EXPECT_REFUSED(result, text)                                                \
  do {                                                                              \
    const Result& pw_r = (result);                                                  \
    EXPECT_EQ(pw_r.exit_code, 2) << pw_r.err;                                       \
    EXPECT_NE(pw_r.err.find(text), std::string::npos) << "want: " << (text) << "\n" \
                                                      << pw_r.err.substr(0, 2000);  \
  } while (0)

std::string Fifo(const std::string& name) {
  const std::string path = TempPath("input_" + name);
  std::filesystem::remove(path);
  EXPECT_EQ(mkfifo(path.c_str(), 0600), 0) << path;
  return path;
}

std::string LinkTo(const std::string& name, const std::string& target) {
  const std::string path = TempPath("input_" + name);
  std::filesystem::remove(path);
  std::filesystem::create_symlink(target, path);
  return path;
}

std::string Sparse(const std::string& name) {  // `truncate -s 1G`
  const std::string path = TempPath("input_" + name);
  std::ofstream(path, std::ios::trunc).close();
  std::filesystem::resize_file(path, int64_t{1} << 30);
  return path;
}

// The file arguments of every subcommand that reads one, with the role named in messages.
struct Reader {
  std::string before, what;  // command line up to the file; "--plan", "plan", ...
};
const Reader kReaders[] = {
    {"validate ", "plan"},
    {"train --steps 1 --plan ", "--plan"},
    {"train --preset gpt-tiny --steps 1 --program ", "--program"},
    {"plan --devices 2 --model ", "--model"},
    {"simulate --stages 2 --micro-batches 2 --program ", "--program"},
};

TEST(CliPlanInput, FifoAndCharacterDevicesAreRefusedByName) {
  const std::string fifo = Fifo("fifo");
  const std::string link = LinkTo("zero_link", "/dev/zero");
  for (const Reader& r : kReaders) {
    EXPECT_REFUSED(RunBounded(r.before + fifo),
                   r.what + " '" + fifo + "' is a FIFO, not a regular file");
    EXPECT_REFUSED(RunBounded(r.before + "/dev/zero"),
                   r.what + " '/dev/zero' is a character device, not a regular file");
    EXPECT_REFUSED(RunBounded(r.before + link), r.what + " '" + link + "' is a character device");
  }
}

TEST(CliPlanInput, OversizedFilesAreRefusedNamingTheLimit) {
  const std::string big = Sparse("big");
  for (const Reader& r : kReaders) {
    EXPECT_REFUSED(RunBounded(r.before + big), r.what + " '" + big + "' is 1073741824 bytes; a " +
                                                   r.what + " is at most 67108864");
  }
}

TEST(CliPlanInput, OutputsThatWouldBlockAreRefusedBeforeTheWork) {
  const std::string fifo = Fifo("out_fifo");
  EXPECT_REFUSED(RunBounded("plan --preset gpt-tiny --devices 2 --device-memory 1GiB -o " + fifo),
                 "cannot write --output '" + fifo + "': it is a FIFO");
  EXPECT_REFUSED(RunBounded("model --preset gpt-tiny -o " + fifo),
                 "cannot write --output '" + fifo + "': it is a FIFO");
  EXPECT_REFUSED(RunBounded("simulate --stages 2 --micro-batches 4 --trace " + fifo),
                 "cannot write --trace '" + fifo + "': it is a FIFO");
  EXPECT_REFUSED(RunBounded("simulate --stages 2 --micro-batches 4 --svg " + fifo),
                 "cannot write --svg '" + fifo + "': it is a FIFO");
  EXPECT_REFUSED(RunBounded("simulate --stages 2 --micro-batches 4 --svg " + ::testing::TempDir()),
                 "it is a directory");
  // A character device is written in place.
  Result null = RunBounded("plan --preset gpt-tiny --devices 2 --device-memory 1GiB -o /dev/null");
  EXPECT_EQ(null.exit_code, 0) << null.err;
}

TEST(CliPlanInput, OutputReplacesTheFileWholeAndKeepsLinks) {
  const std::string dir = TempPath("out_dir");
  std::filesystem::create_directories(dir);
  const std::string plan = dir + "/plan.json", link = dir + "/link.json";
  std::ofstream(plan) << "old";
  std::filesystem::permissions(plan, std::filesystem::perms::owner_read |
                                         std::filesystem::perms::owner_write |
                                         std::filesystem::perms::group_read);
  std::filesystem::create_symlink("plan.json", link);
  Result r = RunBounded("plan --preset gpt-tiny --devices 2 --device-memory 1GiB -o " + link);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Written through the link: the link stays, the file it names holds the plan, with its mode.
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  json j = ReadJson(plan);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["format"], "pipewright.plan/v1");
  EXPECT_EQ(std::filesystem::status(plan).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                std::filesystem::perms::group_read);
  // Nothing but the two names is left in the directory (no temporary file).
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    ++entries;
    EXPECT_TRUE(e.path() == plan || e.path() == link) << e.path();
  }
  EXPECT_EQ(entries, 2);
  // A directory that does not exist: a named error, exit 2.
  EXPECT_REFUSED(RunBounded("plan --preset gpt-tiny --devices 2 --device-memory 1GiB -o " + dir +
                            "/no/such/plan.json"),
                 "cannot write --output '" + dir + "/no/such/plan.json'");
}

}  // namespace

namespace {

// Issue 36, item 5: a small model's plan reads in its own units, never "0.00 GiB".
TEST(CliPlanText, SmallModelsPrintInHumanUnits) {
  pipewright::cli_test::Result r =
      pipewright::cli_test::RunCli("plan --preset gpt-tiny --devices 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("(8 layers, 234.88K parameters) on 2 devices of 80.00 GiB"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(" MiB "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" us per step"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(" 0.00 "), std::string::npos) << r.out;
}

}  // namespace

namespace {

// Issue 36, item 6: a run whose measured peak exceeds its plan's device memory says so.
TEST(CliPlanText, ARunOverThePlansDeviceMemoryIsWarnedAbout) {
  using namespace pipewright::cli_test;
  const std::string plan = TempPath("tight_plan.json");
  ASSERT_EQ(RunCli("plan --preset gpt-tiny --devices 2 --device-memory 4MiB -o " + plan).exit_code,
            0);
  Result r = RunCli("train --plan " + plan + " --steps 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json s = Summary(r);
  const int64_t device = json::parse(ReadAll(plan))["devices"]["memory_bytes"].get<int64_t>();
  std::vector<int> over;
  for (const json& rank : s["ranks"]) {
    if (rank["peak_memory_bytes"].get<int64_t>() > device) over.push_back(rank["rank"].get<int>());
  }
  EXPECT_EQ(s["plan"]["ranks_over_device_memory"].get<std::vector<int>>(), over);
  // gpt-tiny's 4 MiB plan predicts 3.80 MiB for rank 1's stage and runs rank 0 at 4.20 MiB.
  ASSERT_FALSE(over.empty()) << "no rank exceeds 4 MiB any more: pick a tighter plan";
  EXPECT_NE(r.err.find("warning: rank " + std::to_string(over[0]) + "'s measured peak memory"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("exceeds the plan's device memory 4.00 MiB"), std::string::npos) << r.err;
}

}  // namespace
