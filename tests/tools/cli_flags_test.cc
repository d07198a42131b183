// End-to-end tests of the values every `pipewright` option accepts (tools/flags.h; issue 34):
// a numeric option refuses, at parse time with exit 2 and naming itself, anything outside its
// range (empty, NaN, infinities, overflow, octal or hex spellings), no option takes an empty
// value, and no value crashes or hangs a subcommand. The sweep walks the CLI's own command tree
// (hidden options and positionals included), so a new option is swept without being listed
// here; a new subcommand fails EverySubcommandIsSwept until it is.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tests/tools/cli_util.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace {

using pipewright::cli_test::Bin;
using pipewright::cli_test::ReadAll;
using pipewright::cli_test::Result;
using pipewright::cli_test::RunCli;
using pipewright::cli_test::Summary;
using pipewright::cli_test::TempPath;

// A small training run: what the reproductions start from.
const std::string kTrain = "train --preset gpt-tiny --micro-batches 2 --micro-batch-size 2 --json ";

// Refused at parse time: exit 2, "pipewright: <flag> ..." on stderr, nothing on stdout (so no
// step was trained and no JSON line printed).
void ExpectRefused(const Result& r, const std::string& flag, const std::string& what) {
  EXPECT_EQ(r.exit_code, 2) << what << "\nstderr: " << r.err;
  EXPECT_NE(r.err.find("pipewright: " + flag), std::string::npos) << what << "\nstderr: " << r.err;
  EXPECT_TRUE(r.out.empty()) << what << "\nstdout: " << r.out;
}

// --- The reproductions of issue 34, item 4 ------------------------------------------------------

TEST(CliFlags, MicroBatchesBeyondIntAreRefusedNotTruncated) {
  // Was: 4294967298 = 2^32 + 2 ran with 2 micro-batches.
  Result r = RunCli(
      "train --preset gpt-tiny --micro-batch-size 2 --json --steps 1 "
      "--micro-batches 4294967298");
  ExpectRefused(r, "--micro-batches 4294967298", "--micro-batches 4294967298");
  EXPECT_NE(r.err.find("[1, 1048576]"), std::string::npos) << r.err;
}

TEST(CliFlags, EmptyStepsIsRefusedNotZero) {
  // Was: CLI11 read '' as 0 and the run trained nothing, exit 0.
  ExpectRefused(RunCli(kTrain + "--steps ''"), "--steps ''", "--steps ''");
}

TEST(CliFlags, NonFiniteWeightDecayIsRefused) {
  for (const std::string v : {"nan", "inf", "-inf", "-1"}) {
    Result r = RunCli(kTrain + "--steps 1 --weight-decay " + v);
    ExpectRefused(r, "--weight-decay " + v, v);
    EXPECT_NE(r.err.find("finite"), std::string::npos) << r.err;
  }
}

TEST(CliFlags, MinLrRatioOutsideZeroOneIsRefused) {
  for (const std::string v : {"nan", "-1", "inf", "1.5"}) {
    Result r = RunCli(kTrain + "--steps 1 --min-lr-ratio " + v);
    ExpectRefused(r, "--min-lr-ratio " + v, v);
    EXPECT_NE(r.err.find("[0, 1]"), std::string::npos) << r.err;
  }
}

TEST(CliFlags, ClipNanNegativeOrInfiniteIsRefused) {
  for (const std::string v : {"nan", "-1", "inf"}) {
    Result r = RunCli(kTrain + "--steps 1 --clip " + v);
    ExpectRefused(r, "--clip " + v, v);
    EXPECT_NE(r.err.find("(0: off)"), std::string::npos) << r.err;
  }
  // 0 still turns clipping off.
  EXPECT_EQ(RunCli(kTrain + "--steps 1 --clip 0").exit_code, 0);
}

TEST(CliFlags, EmptySaveIsRefused) {
  // Was: nothing saved, exit 0.
  ExpectRefused(RunCli(kTrain + "--steps 1 --save ''"), "--save ''", "--save ''");
  ExpectRefused(RunCli(kTrain + "--steps 1 --data ''"), "--data ''", "--data ''");
}

TEST(CliFlags, NumbersAreDecimalAndExact) {
  // CLI11 alone read "010" as octal 8 and "0x10" as 16.
  Result r = RunCli(
      "train --preset gpt-tiny --micro-batches 1 --micro-batch-size 1 --json "
      "--steps 010");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_FALSE(Summary(r).is_null()) << r.out;
  EXPECT_EQ(Summary(r)["steps"].get<int>(), 10);
  ExpectRefused(RunCli(kTrain + "--steps 1 --lr 0x10"), "--lr 0x10", "hex");
  ExpectRefused(RunCli(kTrain + "--steps 1e1"), "--steps 1e1", "exponent");
  // A float flag refuses a value that would round to 0 in a float.
  ExpectRefused(RunCli(kTrain + "--steps 1 --lr 1e-50"), "--lr 1e-50", "float underflow");
}

TEST(CliFlags, SeedTakesEveryUint64ButNoNegative) {
  ExpectRefused(RunCli(kTrain + "--steps 0 --seed -1"), "--seed -1", "negative seed");
  ExpectRefused(RunCli(kTrain + "--steps 0 --seed 18446744073709551616"),
                "--seed 18446744073709551616", "2^64");
  EXPECT_EQ(RunCli(kTrain + "--steps 0 --seed 18446744073709551615").exit_code, 0);
}

TEST(CliFlags, ByteSizesRefuseNonFiniteNegativeAndOverflow) {
  for (const std::string v : {"nan", "inf", "-1GiB", "1e30GiB", "0x10", "''", "1.5XB"}) {
    Result r = RunCli("plan --preset gpt-tiny --devices 1 --device-memory " + v);
    ExpectRefused(r, "--device-memory", v);
  }
  EXPECT_EQ(RunCli("plan --preset gpt-tiny --devices 1 --device-memory 2GiB").exit_code, 0);
}

TEST(CliFlags, EmptyPositionalsAreRefused) {
  ExpectRefused(RunCli("validate ''"), "plan ''", "validate ''");
  ExpectRefused(RunCli("export --checkpoint x ''"), "OUT ''", "export OUT ''");
  ExpectRefused(RunCli("import --preset gpt-tiny '' out"), "IN ''", "import IN ''");
  ExpectRefused(RunCli("import --preset gpt-tiny in ''"), "DIR ''", "import DIR ''");
}

TEST(CliFlags, ScheduleSizeIsBounded) {
  // p x m x v above 2^20 would take gigabytes and minutes to generate and simulate.
  Result r = RunCli("simulate --stages 64 --micro-batches 1048576");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("at most 1048576"), std::string::npos) << r.err;
}

TEST(CliFlags, PlanGlobalBatchIsBounded) {
  Result r = RunCli(
      "plan --preset gpt-tiny --devices 2 --dp 2 --micro-batch-size 65536 "
      "--micro-batches 2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("the global batch must be at most 65536"), std::string::npos) << r.err;
}

// --- GPT spec limits (issue 34, item 3) ----------------------------------------------------------

TEST(CliFlags, GptSpecWithTenMillionLayersIsRefusedByName) {
  // Was: bad_alloc building 10M layer nodes.
  Result r = RunCli("model --gpt layers=10000000,hidden=64,heads=4,seq=32,vocab=256");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("layers=10000000 is out of range [1, 100000]"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty());
  r = RunCli("plan --devices 1 --preset gpt-tiny");  // the presets are within every limit
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(CliFlags, GptSpecWhoseBytesOverflowIsRefused) {
  Result r = RunCli("model --gpt layers=100000,hidden=1048576,heads=16,seq=32,vocab=256");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("overflow 64-bit integers"), std::string::npos) << r.err;
}

TEST(CliFlags, EvalRefusesAManifestWithABillionLayers) {
  // Was: eval rebuilt the GPT of the manifest's model.gpt and died of bad_alloc.
  const std::string dir = TempPath("flags_eval_layers");
  std::filesystem::remove_all(dir);
  Result r = RunCli(
      "train --preset gpt-tiny --micro-batches 1 --micro-batch-size 1 --steps 1 "
      "--save " +
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string step = dir + "/step-000001";
  nlohmann::json manifest = nlohmann::json::parse(ReadAll(step + "/manifest.json"));
  ASSERT_TRUE(manifest["model"]["gpt"].is_object()) << manifest["model"].dump();
  manifest["model"]["gpt"]["layers"] = 1000000000;
  std::ofstream(step + "/manifest.json") << manifest.dump();
  // The manifest's digest, rewritten so that only the layer count is wrong.
  ASSERT_EQ(
      std::system(("cd '" + step + "' && sha256sum manifest.json > manifest.json.sha256").c_str()),
      0);
  r = RunCli("eval --checkpoint " + dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("model.gpt: layers=1000000000 is out of range [1, 100000]"),
            std::string::npos)
      << r.err;
}

// --- The sweep: every option of every subcommand ----------------------------------------------
//
// In-process: the command tree main() parses (RegisterCommands), stopped before any subcommand
// runs (MakeTree), so each of some two thousand command lines costs a parse. Then, as processes,
// the runs whose values are accepted.

// Values tried on every option that takes one.
const std::vector<std::string> kBadValues = {"",
                                             "nan",
                                             "inf",
                                             "-inf",
                                             "-1",
                                             "1e400",
                                             "0x10",
                                             "2147483648",
                                             "4294967298",
                                             "9223372036854775808",
                                             "18446744073709551616"};

// Each subcommand with the arguments that let a command line with an accepted value parse and,
// run as a process in a scratch directory (what a run writes stays there), end quickly.
struct Command {
  std::vector<std::string> path;                          // {"data", "prepare"}
  std::vector<std::pair<std::string, std::string>> base;  // value "": a flag
  std::vector<std::string> positionals;
};
const std::vector<Command>& Commands() {
  static const std::vector<Command> kCommands = {
      // --stop-after 1: an accepted --steps value trains one step.
      {{"train"},
       {{"--preset", "gpt-tiny"},
        {"--micro-batches", "1"},
        {"--micro-batch-size", "1"},
        {"--steps", "0"},
        {"--stop-after", "1"},
        {"--json", ""}},
       {}},
      {{"eval"}, {{"--checkpoint", "no-such-checkpoint"}, {"--batches", "1"}}, {}},
      {{"generate"}, {{"--checkpoint", "no-such-checkpoint"}, {"--tokens", "1"}}, {}},
      {{"plot"}, {{"-o", "out.svg"}}, {"no-such-metrics.csv"}},
      {{"bench"}, {{"--suite", "overhead"}, {"--steps", "1"}, {"--stage-ms", "0.01"}}, {}},
      {{"simulate"}, {{"--stages", "2"}, {"--micro-batches", "2"}}, {}},
      {{"model"}, {{"--preset", "gpt-tiny"}}, {}},
      {{"plan"}, {{"--preset", "gpt-tiny"}, {"--devices", "1"}}, {}},
      {{"validate"}, {}, {"no-such-plan.json"}},
      {{"data", "prepare"}, {{"--input", "no-such-corpus.txt"}, {"--output", "out.tokens"}}, {}},
      {{"data", "train-tokenizer"},
       {{"--input", "no-such-corpus.txt"}, {"--model-prefix", "tok"}, {"--vocab-size", "300"}},
       {}},
      {{"export"}, {{"--checkpoint", "no-such-checkpoint"}}, {"out-hf"}},
      {{"import"}, {{"--preset", "gpt-tiny"}}, {"no-such-hf-dir", "out-checkpoint"}},
  };
  return kCommands;
}

// The bad values that some numeric options legitimately accept: a step count or a seed may be
// 2^31, a simulated cost 4e9, a memory size 4 GiB. Every other (numeric option, bad value) is
// refused, and so is an empty value everywhere.
const std::map<std::string, std::set<std::string>>& Accepted() {
  static const std::set<std::string> kBig = {"2147483648", "4294967298"};
  static const std::set<std::string> kSeed = {"2147483648", "4294967298", "9223372036854775808"};
  static const std::map<std::string, std::set<std::string>> kAccepted = {
      {"train --steps", kBig},
      {"train --stop-after", kBig},
      {"train --warmup", kBig},
      {"train --base-batch", kBig},
      {"train --loss-scale-window", kBig},
      {"train --save-every", kBig},
      {"train --log-every", kBig},
      {"train --eval-every", kBig},
      {"generate --seed", kSeed},
      {"train --seed", kSeed},
      {"model --seed", kSeed},
      {"import --seed", kSeed},
      {"simulate --cost-f", kBig},
      {"simulate --cost-b", kBig},
      {"simulate --cost-w", kBig},
      {"simulate --comm-latency", kBig},
      {"simulate --comm-per-byte", kBig},
      {"simulate --message-bytes", kBig},
      {"simulate --reduce-time", kBig},
      {"simulate --optimizer-time", kBig},
      {"plan --device-memory", kBig},
      {"plan --reserve", kBig},
  };
  return kAccepted;
}

std::string Join(const std::vector<std::string>& words) {
  std::string s;
  for (const std::string& w : words) s += (s.empty() ? "" : " ") + w;
  return s;
}

// The command tree of `pipewright`, parsing only: a required top-level option that no command
// line gives stops every parse after all values were checked and converted (CLI11 checks the
// requirements last) and before any subcommand runs.
constexpr char kStop[] = "--test-stops-here";

struct Tree {
  CLI::App app{"pipewright"};
  int exit_code = 0;
};

std::unique_ptr<Tree> MakeTree() {
  auto t = std::make_unique<Tree>();
  t->app.require_subcommand(1);
  pipewright::tools::RegisterCommands(t->app, &t->exit_code);
  t->app.add_option(kStop)->required();
  return t;
}

// What parsing `args` came to.
struct Parsed {
  std::string error;              // the ParseError's message; "" when the parse went through
  bool flag_value_error = false;  // a tools::FlagValueError: refused by a range or emptiness check
};

Parsed Parse(std::vector<std::string> args) {
  std::unique_ptr<Tree> t = MakeTree();
  std::reverse(args.begin(), args.end());  // CLI11 takes them last first
  Parsed p;
  try {
    t->app.parse(args);
    p.error = "the parse went past " + std::string(kStop);
  } catch (const pipewright::tools::FlagValueError& e) {
    p.error = e.what();
    p.flag_value_error = true;
  } catch (const CLI::RequiredError& e) {
    if (std::string(e.what()).find(kStop) == std::string::npos) p.error = e.what();
  } catch (const CLI::ParseError& e) {
    p.error = e.what();
  }
  return p;
}

// An option that takes a value.
struct Option {
  std::vector<std::string> path;  // its subcommand
  std::string name;               // "--steps"; a positional's name ("plan")
  std::string type;               // INT, UINT, FLOAT, SIZE or TEXT
  std::string type_name;          // with the range: "INT:[0, 1099511627776]"
  bool positional = false;
  bool numeric() const { return type != "TEXT"; }
  std::string key() const { return Join(path) + " " + name; }
};

// Every option of every subcommand that takes a value, hidden ones included.
const std::vector<Option>& AllOptions() {
  static const std::vector<Option> kOptions = [] {
    std::unique_ptr<Tree> t = MakeTree();
    std::vector<Option> options;
    std::vector<std::pair<std::vector<std::string>, CLI::App*>> todo;
    for (CLI::App* sub : t->app.get_subcommands([](CLI::App*) { return true; })) {
      todo.push_back({{sub->get_name()}, sub});
    }
    while (!todo.empty()) {
      auto [path, app] = todo.back();
      todo.pop_back();
      for (CLI::App* sub : app->get_subcommands([](CLI::App*) { return true; })) {
        std::vector<std::string> p = path;
        p.push_back(sub->get_name());
        todo.push_back({p, sub});
      }
      for (const CLI::Option* opt : app->get_options()) {
        if (opt->get_expected_max() == 0) continue;  // a flag: takes no value
        Option o;
        o.path = path;
        o.positional = opt->get_positional();
        o.name = pipewright::tools::OptionName(*opt);
        o.type_name = opt->get_type_name();
        o.type = o.type_name.substr(0, o.type_name.find(':'));
        options.push_back(o);
      }
    }
    return options;
  }();
  return kOptions;
}

const Command& CommandOf(const Option& o) {
  for (const Command& c : Commands()) {
    if (c.path == o.path) return c;
  }
  ADD_FAILURE() << Join(o.path) << ": a subcommand Commands() does not list";
  return Commands().front();
}

// The command line giving option `o` the value `value`, with its subcommand's base arguments.
std::vector<std::string> CommandLine(const Option& o, const std::string& value) {
  const Command& c = CommandOf(o);
  std::vector<std::string> args = o.path;
  for (const auto& [flag, v] : c.base) {
    if (flag == o.name) continue;  // given twice, CLI11 would refuse it
    args.push_back(flag);
    if (!v.empty()) args.push_back(v);
  }
  if (!o.positional) {
    args.push_back(o.name);
    args.push_back(value);
  }
  // Positionals in their order; the one under test gets `value`.
  size_t i = 0;
  for (const Option& other : AllOptions()) {
    if (!other.positional || other.path != o.path) continue;
    if (i < c.positionals.size()) args.push_back(other.name == o.name ? value : c.positionals[i]);
    ++i;
  }
  return args;
}

bool IsAccepted(const Option& o, const std::string& value) {
  if (value.empty()) return false;
  auto it = Accepted().find(o.key());
  return it != Accepted().end() && it->second.count(value) > 0;
}

TEST(CliFlags, EverySubcommandIsSwept) {
  std::set<std::vector<std::string>> in_tree, listed;
  for (const Option& o : AllOptions()) in_tree.insert(o.path);
  for (const Command& c : Commands()) listed.insert(c.path);
  EXPECT_EQ(in_tree, listed) << "a subcommand was added or removed: update Commands()";

  // Each listed command line parses as it is.
  for (const Command& c : Commands()) {
    std::vector<std::string> args = c.path;
    for (const auto& [flag, v] : c.base) {
      args.push_back(flag);
      if (!v.empty()) args.push_back(v);
    }
    for (const std::string& p : c.positionals) args.push_back(p);
    EXPECT_EQ(Parse(args).error, "") << Join(args);
  }
}

TEST(CliFlags, EveryNumericOptionHasARange) {
  const std::vector<Option>& options = AllOptions();
  EXPECT_GT(options.size(), 90u);
  for (const Option& o : options) {
    EXPECT_TRUE(o.type == "TEXT" || o.type == "INT" || o.type == "UINT" || o.type == "FLOAT" ||
                o.type == "SIZE")
        << o.key() << ": " << o.type_name;
    // UINT is a seed: every uint64. Any other numeric option shows its range after the type.
    if (o.type != "TEXT" && o.type != "UINT") {
      EXPECT_NE(o.type_name.find(':'), std::string::npos)
          << o.key() << " " << o.type_name << ": register it with tools/flags.h";
    }
  }
}

TEST(CliFlags, EveryOptionRefusesBadValuesByName) {
  int refused = 0;
  for (const Option& o : AllOptions()) {
    for (const std::string& v : kBadValues) {
      const std::vector<std::string> args = CommandLine(o, v);
      const std::string what = "pipewright " + Join(args) + " (value '" + v + "')";
      Parsed p = Parse(args);
      if (IsAccepted(o, v) || (!o.numeric() && !v.empty())) {
        // A text option's value is its subcommand's to judge when it runs; a refusal, if any,
        // is not of an empty or out-of-range value.
        EXPECT_FALSE(p.flag_value_error) << what << ": " << p.error;
        if (IsAccepted(o, v)) {
          EXPECT_EQ(p.error, "") << what;
        }
        continue;
      }
      ++refused;
      // "--steps '': ..." or, for a text option with a list of choices, "--preset: ...".
      EXPECT_TRUE(p.error.rfind(o.name + " ", 0) == 0 || p.error.rfind(o.name + ":", 0) == 0)
          << what << ": " << p.error;
      if (o.numeric()) {
        EXPECT_TRUE(p.flag_value_error) << what << ": " << p.error;
        EXPECT_NE(p.error.find(o.type == "SIZE" ? "must be a size in" : "must be a"),
                  std::string::npos)
            << what << ": " << p.error;
      }
    }
  }
  EXPECT_GT(refused, 500);
}

// Runs `args` as a process in `dir` under `timeout 60`: a hang ends with 124.
Result RunInDir(const std::string& dir, const std::vector<std::string>& args) {
  std::string line = "cd '" + dir + "' && timeout 60 " + Bin();
  for (const std::string& a : args) line += " '" + a + "'";
  return pipewright::cli_test::RunCliWith(line, "");
}

TEST(CliFlags, AcceptedOddValuesNeitherCrashNorHang) {
  const std::string scratch = TempPath("flags_sweep");
  std::filesystem::remove_all(scratch);
  std::filesystem::create_directories(scratch);
  int runs = 0;
  for (const Option& o : AllOptions()) {
    // The accepted bad values of numeric options; any text option given "-1" (which CLI11 could
    // take for an option) and "nan".
    std::vector<std::string> values;
    for (const std::string& v : kBadValues) {
      if (IsAccepted(o, v) || (!o.numeric() && (v == "-1" || v == "nan"))) values.push_back(v);
    }
    for (const std::string& v : values) {
      const std::vector<std::string> args = CommandLine(o, v);
      Result r = RunInDir(scratch, args);
      ++runs;
      // 0 or a usage or runtime error: never a signal (128 + its number) nor timeout's 124.
      EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 1 || r.exit_code == 2)
          << "pipewright " << Join(args) << "\nexit " << r.exit_code << "\nstderr: " << r.err;
    }
  }
  EXPECT_GT(runs, 100);
}

TEST(CliFlags, RefusedValuesExitTwoNamingTheOptionInEverySubcommand) {
  // The in-process sweep shows which values are refused; here, that the program exits 2 with
  // the message for one of them in each subcommand.
  const std::string scratch = TempPath("flags_refused");
  std::filesystem::create_directories(scratch);
  for (const Command& c : Commands()) {
    for (const Option& o : AllOptions()) {
      // (Not an option with a list of choices: CLI11 words their refusal.)
      if (o.path != c.path || o.type_name.find('{') != std::string::npos) continue;
      Result r = RunInDir(scratch, CommandLine(o, ""));
      ExpectRefused(r, o.name + " ''", Join(c.path) + " " + o.name + " ''");
      break;
    }
  }
}

}  // namespace

// --- A mistyped option (issue 36, item 4) --------------------------------------------------------

TEST(CliFlags, AMistypedOptionNamesTheNearestOneAndTheSubcommandsHelp) {
  Result r = RunCli("train --step 5");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("unknown option --step for 'pipewright train'; did you mean --steps?"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("run 'pipewright train --help' for its options"), std::string::npos)
      << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  // A nested subcommand, a value given with '=', and a name far from every option.
  r = RunCli("plan --preset gpt-tiny --devics=2");
  EXPECT_NE(r.err.find("unknown option --devics for 'pipewright plan'; did you mean --devices?"),
            std::string::npos)
      << r.err;
  r = RunCli("data prepare --input x --output y --zzzzzzzz");
  EXPECT_NE(r.err.find("unknown option --zzzzzzzz for 'pipewright data prepare'\n"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("run 'pipewright data prepare --help'"), std::string::npos) << r.err;
  // No subcommand: the top-level help.
  r = RunCli("--bogus");
  EXPECT_NE(r.err.find("run 'pipewright --help' for usage"), std::string::npos) << r.err;
}
