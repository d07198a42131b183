// One validation, two vocabularies (issue 35, part 5; Note [Field names in errors] in
// pipewright/train.h, Note [Field names to flags] in tools/flags.h): the library's checks name
// the fields a C++ caller set and never a flag; the CLI says the same message in the flags the
// user typed through one table, FieldFlags, which covers every field name the library's sources
// write; and the `pipewright` binary's refusals read in flags.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "pipewright/model.h"
#include "pipewright/partitioner.h"
#include "pipewright/plan.h"
#include "pipewright/precision.h"
#include "pipewright/run_spec.h"
#include "pipewright/train.h"
#include "pipewright/train_testing.h"
#include "tests/tools/cli_util.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace {

using pipewright::tools::FieldFlags;
using pipewright::tools::InFlagTerms;

bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// The dotted names `Struct.field[.field]` in `text`: a capitalised word that does not continue a
// name, then one or more ".lower_case" parts ("TrainOptions.optimizer.kind"; not "docs/x.md").
std::vector<std::string> FieldNames(const std::string& text) {
  std::vector<std::string> names;
  for (size_t i = 0; i < text.size(); ++i) {
    if (!std::isupper(static_cast<unsigned char>(text[i]))) continue;
    if (i > 0 && (IsNameChar(text[i - 1]) || text[i - 1] == '.')) continue;
    size_t j = i;
    while (j < text.size() && IsNameChar(text[j])) ++j;
    size_t end = j;
    while (end + 1 < text.size() && text[end] == '.' &&
           (std::islower(static_cast<unsigned char>(text[end + 1])) || text[end + 1] == '_')) {
      end += 1;
      while (end < text.size() && IsNameChar(text[end])) ++end;
    }
    if (end > j) names.push_back(text.substr(i, end - i));
    i = end;
  }
  return names;
}

std::map<std::string, std::string> Table() {
  std::map<std::string, std::string> m;
  for (const auto& ff : FieldFlags()) m[ff.field] = ff.flag;
  return m;
}

// A library message: names `field`, no flag; the CLI's: names `flag`, no field left.
void ExpectBothVocabularies(const absl::Status& s, const std::string& field,
                            const std::string& flag) {
  ASSERT_FALSE(s.ok()) << field;
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  const std::string lib(s.message());
  EXPECT_NE(lib.find(field), std::string::npos) << field << " not in: " << lib;
  EXPECT_EQ(lib.find("--"), std::string::npos) << "a flag in a library message: " << lib;
  const std::string cli = InFlagTerms(lib);
  EXPECT_NE(cli.find(flag), std::string::npos) << flag << " not in: " << cli;
  for (const std::string& name : FieldNames(cli)) {
    ADD_FAILURE() << "the CLI's message still names " << name << ": " << cli;
  }
}

TEST(FieldFlags, InFlagTermsRewritesWholeNamesOnly) {
  EXPECT_EQ(InFlagTerms("TrainOptions.staleness = -1: must be >= 0 (0: lock-step)"),
            "--staleness -1: must be >= 0 (0: lock-step)");
  EXPECT_EQ(InFlagTerms("needs RunSpec.data_parallel >= 2."), "needs --dp >= 2.");
  EXPECT_EQ(InFlagTerms("TrainOptions.optimizer.kind = sgd"), "--optimizer sgd");
  EXPECT_EQ(InFlagTerms("PartitionOptions.pp = 4 x PartitionOptions.dp = 2 = 8 ranks"),
            "--pp 4 x --dp 2 = 8 ranks");
  // Not a whole name: part of a longer one, or unknown.
  for (const char* kept : {"XTrainOptions.lr", "a.TrainOptions.lr", "TrainOptions.lr_x",
                           "TrainOptions.optimizer", "TrainOptions.lr.x", "Options.lr"}) {
    EXPECT_EQ(InFlagTerms(kept), kept);
  }
  EXPECT_EQ(InFlagTerms("GPT spec 'layers=x': bad"), "--gpt 'layers=x': bad");
  EXPECT_EQ(InFlagTerms(""), "");
}

// Each check of ValidateTrainOptions, failed on purpose: the message names the field, the CLI's
// the flag.
TEST(FieldFlags, EveryTrainOptionsCheckNamesItsFieldAndTheCliItsFlag) {
  struct Case {
    std::string field, flag;
    std::function<void(pipewright::TrainOptions&)> set;
    int dp = 2;
  };
  using pipewright::DpMode;
  using pipewright::GradCompression;
  using pipewright::Precision;
  using O = pipewright::TrainOptions;
  const float nan = std::nanf("");
  const std::vector<Case> cases = {
      {"TrainOptions.steps = -1", "--steps -1", [](O& o) { o.steps = -1; }},
      {"TrainOptions.lr", "--lr", [](O& o) { o.lr = 0; }},
      {"TrainOptions.lr", "--lr", [&](O& o) { o.lr = nan; }},
      {"TrainOptions.min_lr_ratio", "--min-lr-ratio", [](O& o) { o.min_lr_ratio = 2; }},
      {"TrainOptions.clip_norm", "--clip", [](O& o) { o.clip_norm = -1; }},
      {"TrainOptions.optimizer.weight_decay", "--weight-decay",
       [](O& o) { o.optimizer.weight_decay = -1; }},
      {"TrainOptions.warmup_steps", "--warmup", [](O& o) { o.warmup_steps = -1; }},
      {"TrainOptions.base_batch", "--base-batch", [](O& o) { o.base_batch = 0; }},
      {"LossScaleOptions.initial_scale", "--loss-scale",
       [](O& o) {
         o.precision = Precision::kFp16;
         o.loss_scale.initial_scale = 0;
       }},
      {"LossScaleOptions.growth_interval", "--loss-scale-window",
       [](O& o) {
         o.precision = Precision::kFp16;
         o.loss_scale.growth_interval = 0;
       }},
      {"TrainOptions.bucket_bytes", "--bucket-mb", [](O& o) { o.bucket_bytes = 0; }},
      {"TrainOptions.threads_per_rank", "--threads-per-rank",
       [](O& o) { o.threads_per_rank = 256; }},
      {"TrainOptions.data_workers", "--data-workers", [](O& o) { o.data_workers = -1; }},
      {"TrainOptions.staleness = -1", "--staleness -1", [](O& o) { o.staleness = -1; }},
      {"TrainOptions.zero = 3", "--zero 3", [](O& o) { o.zero = 3; }},
      {"TrainOptions.zero_buffers = 1 sets ZeRO-2's gradient buffers: it needs TrainOptions.zero = "
       "2",
       "--zero-buffers 1 sets ZeRO-2's gradient buffers: it needs --zero 2",
       [](O& o) {
         o.zero = 1;
         o.zero_buffers = 1;
       },
       2},
      {"TrainOptions.zero = 2 does not combine with TrainOptions.grad_compression",
       "--zero 2 does not combine with --grad-compression",
       [](O& o) {
         o.zero = 2;
         o.grad_compression = GradCompression::Bf16();
       },
       2},
      {"TrainOptions.grad_compression = bf16",
       "--grad-compression bf16 does not support "
       "--precision fp16",
       [](O& o) {
         o.grad_compression = GradCompression::Bf16();
         o.precision = Precision::kFp16;
       }},
      {"TrainOptions.zero = 1 needs synchronous DP", "--zero 1 needs synchronous DP",
       [](O& o) {
         o.zero = 1;
         o.dp_mode = DpMode::kAsync;
       }},
      {"TrainOptions.dp_mode = async", "--dp-mode async does not combine with --grad-compression",
       [](O& o) {
         o.dp_mode = DpMode::kAsync;
         o.grad_compression = GradCompression::PowerSgd(2);
       }},
      {"TrainOptions.dp_mode = async", "--dp-mode async does not support --precision fp16",
       [](O& o) {
         o.dp_mode = DpMode::kAsync;
         o.precision = Precision::kFp16;
       }},
      {"RunSpec.data_parallel >= 2", "--dp-mode async needs data parallelism (--dp >= 2)",
       [](O& o) { o.dp_mode = DpMode::kAsync; }, 1},
      {"RunSpec.data_parallel >= 2", "--grad-compression bf16 needs data parallelism (--dp >= 2)",
       [](O& o) { o.grad_compression = GradCompression::Bf16(); }, 1},
      {"RunSpec.data_parallel >= 2", "--zero 1 shards", [](O& o) { o.zero = 1; }, 1},
  };
  for (const Case& c : cases) {
    O o;
    c.set(o);
    ExpectBothVocabularies(pipewright::ValidateTrainOptions(o, c.dp), c.field, c.flag);
  }
  EXPECT_TRUE(pipewright::ValidateTrainOptions(O(), 1).ok());
}

TEST(FieldFlags, OtherLibraryChecksNameFieldsToo) {
  using namespace pipewright;
  TrainTestingHooks h;
  h.slow_replica = 2;
  ExpectBothVocabularies(ValidateTrainTestingHooks(h, 2), "TrainTestingHooks.slow_replica = 2",
                         "--slow-replica 2: there are only 2 replicas");
  h = TrainTestingHooks();
  h.slow_factor = 0.5;
  ExpectBothVocabularies(ValidateTrainTestingHooks(h, 2), "TrainTestingHooks.slow_factor",
                         "--slow-replica");
  ExpectBothVocabularies(ParseDpMode("eventually").status(), "TrainOptions.dp_mode",
                         "unknown --dp-mode 'eventually'");
  ExpectBothVocabularies(ParseGradCompression("powersgd:0").status(),
                         "TrainOptions.grad_compression = powersgd:0",
                         "--grad-compression powersgd:0: the PowerSGD rank");
  ExpectBothVocabularies(ParseRecompute("some").status(), "RunSpec.recompute",
                         "--recompute must be none, selective or full");
  ExpectBothVocabularies(ParseGptSpec("layers=2").status(), "GPT spec 'layers=2'",
                         "--gpt 'layers=2'");

  absl::StatusOr<LayerGraph> g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<Schedule> sched = GenerateSchedule({ScheduleKind::k1F1B, 1, 2, 1});
  ASSERT_TRUE(sched.ok()) << sched.status();
  ExpectBothVocabularies(RunSpecFromSchedule(*g, *sched, 0).status(), "RunSpec.data_parallel = 0",
                         "--dp 0: must be >= 1");

  const ModelCosts costs = ToModelCosts(*g);
  DeviceSpec dev;
  dev.count = 2;
  PartitionOptions o;
  o.pp = 1;
  o.dp = 2;
  o.micro_batches = 2;
  auto partition = [&](std::function<void(DeviceSpec&, PartitionOptions&)> set) {
    DeviceSpec d = dev;
    PartitionOptions p = o;
    set(d, p);
    return Partition(costs, d, p).status();
  };
  ASSERT_TRUE(partition([](DeviceSpec&, PartitionOptions&) {}).ok());
  ExpectBothVocabularies(partition([](DeviceSpec& d, PartitionOptions&) { d.count = 0; }),
                         "DeviceSpec.count = 0", "--devices 0");
  ExpectBothVocabularies(partition([](DeviceSpec& d, PartitionOptions&) { d.memory_bytes = 0; }),
                         "DeviceSpec.memory_bytes = 0", "--device-memory 0");
  ExpectBothVocabularies(
      partition([](DeviceSpec& d, PartitionOptions&) { d.reserve_bytes = d.memory_bytes; }),
      "DeviceSpec.reserve_bytes", "--reserve (80.00 GiB) must be >= 0 and below --device-memory");
  ExpectBothVocabularies(partition([](DeviceSpec& d, PartitionOptions&) { d.tflops = 0; }),
                         "DeviceSpec.tflops", "--device-tflops must be finite and > 0");
  ExpectBothVocabularies(partition([](DeviceSpec&, PartitionOptions& p) { p.pp = 0; }),
                         "PartitionOptions.pp = 0", "--pp 0");
  ExpectBothVocabularies(partition([](DeviceSpec&, PartitionOptions& p) { p.zero = 3; }),
                         "PartitionOptions.zero = 3", "--zero 3: must be 0, 1 or 2");
  ExpectBothVocabularies(partition([](DeviceSpec& d, PartitionOptions& p) {
                           d.count = 1;
                           p.dp = 1;
                           p.zero = 2;
                         }),
                         "PartitionOptions.zero = 2",
                         "--zero 2 splits the optimizer state and the gradients over --dp >= 2");
  ExpectBothVocabularies(partition([](DeviceSpec& d, PartitionOptions& p) {
                           d.count = 1;
                           p.dp = 1;
                           p.zero = 1;
                         }),
                         "PartitionOptions.zero = 1", "--zero 1 splits");
  ExpectBothVocabularies(partition([](DeviceSpec&, PartitionOptions& p) { p.pp = 2; }),
                         "PartitionOptions.pp = 2 x PartitionOptions.dp = 2",
                         "--pp 2 x --dp 2 = 4 ranks, but there are 2 devices (--devices)");
  ExpectBothVocabularies(
      partition([](DeviceSpec&, PartitionOptions& p) { p.micro_batch_size = -1; }),
      "PartitionOptions.micro_batch_size = -1", "--micro-batch-size -1");
}

// Every option name a table entry gives is an option of the CLI.
TEST(FieldFlags, EveryFlagOfTheTableIsAnOptionOfTheCli) {
  CLI::App app{"pipewright"};
  int code = 0;
  pipewright::tools::RegisterCommands(app, &code);
  std::set<std::string> options;
  std::vector<CLI::App*> todo = {&app};
  while (!todo.empty()) {
    CLI::App* a = todo.back();
    todo.pop_back();
    for (CLI::App* sub : a->get_subcommands([](CLI::App*) { return true; })) todo.push_back(sub);
    for (const CLI::Option* opt : a->get_options()) {
      options.insert(pipewright::tools::OptionName(*opt));
    }
  }
  for (const auto& ff : FieldFlags()) {
    const std::string flag = ff.flag;
    const size_t dash = flag.find("--");
    ASSERT_NE(dash, std::string::npos) << ff.field << " -> " << flag;
    const std::string name = flag.substr(dash, flag.find(' ', dash) - dash);
    EXPECT_EQ(options.count(name), 1u) << ff.field << " -> " << flag << ": no option " << name;
  }
}

// Fields the library's messages name that no flag sets: they stay as they are in the CLI.
const std::set<std::string>& FieldsWithoutAFlag() {
  static const std::set<std::string> kNone = {
      "LossScaleOptions.min_scale",       // fixed by the CLI
      "LossScaleOptions.growth_factor",   // fixed by the CLI
      "LossScaleOptions.backoff_factor",  // fixed by the CLI
      "DeviceSpec.layer_overhead_s",      // fixed by the CLI
      "DeviceSpec.tp_latency_s",          // fixed by the CLI
      "ModelCosts.transformer",           // the layer graph's own (a --model file's "transformer")
      // Filled from a run's summary (tools/calibration.cc names the file), not from flags.
      "RunMeasurement.micro_batch_size",
      "RunMeasurement.boundaries",
      "RunMeasurement.rank_peak_bytes",
  };
  return kNone;
}

// The string literals of a C++ source, comments skipped.
std::vector<std::string> StringLiterals(const std::string& src) {
  std::vector<std::string> out;
  for (size_t i = 0; i < src.size(); ++i) {
    if (src.compare(i, 2, "//") == 0) {
      i = src.find('\n', i);
      if (i == std::string::npos) break;
    } else if (src.compare(i, 2, "/*") == 0) {
      i = src.find("*/", i);
      if (i == std::string::npos) break;
      ++i;
    } else if (src[i] == '\'') {  // a character literal ('"'), or a digit separator (1'000)
      if (i + 2 < src.size() && src[i + 1] == '\\') {
        i = src.find('\'', i + 3);
      } else if (i + 2 < src.size() && src[i + 2] == '\'') {
        i += 2;
      }
      if (i == std::string::npos) break;
    } else if (src[i] == '"') {
      std::string lit;
      size_t j = i + 1;
      for (; j < src.size() && src[j] != '"' && src[j] != '\n'; ++j) {
        if (src[j] == '\\' && j + 1 < src.size())
          lit.push_back(src[++j]);
        else
          lit.push_back(src[j]);
      }
      out.push_back(lit);
      i = j;
    }
  }
  return out;
}

// The library's sources: runtime/, partitioner/, schedules/ (what issue 35 says may not speak in
// flags).
std::vector<std::filesystem::path> LibrarySources() {
  std::vector<std::filesystem::path> files;
  for (const char* dir : {"runtime", "partitioner", "schedules"}) {
    for (const auto& e : std::filesystem::recursive_directory_iterator(
             std::filesystem::path(PIPEWRIGHT_SOURCE_DIR) / dir)) {
      const std::string ext = e.path().extension().string();
      if (ext == ".cc" || ext == ".h" || ext == ".cu" || ext == ".cuh") files.push_back(e.path());
    }
  }
  return files;
}

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(FieldFlags, EveryFieldNameTheLibraryWritesHasAFlagOrIsListedWithoutOne) {
  const std::map<std::string, std::string> table = Table();
  std::set<std::string> seen;
  const std::vector<std::filesystem::path> files = LibrarySources();
  ASSERT_GT(files.size(), 50u);
  for (const auto& file : files) {
    for (const std::string& lit : StringLiterals(ReadFile(file))) {
      for (const std::string& name : FieldNames(lit)) {
        seen.insert(name);
        EXPECT_TRUE(table.count(name) > 0 || FieldsWithoutAFlag().count(name) > 0)
            << file.string() << ": \"" << lit << "\" names " << name
            << ", which FieldFlags (tools/flags.cc) does not map to a flag";
      }
    }
  }
  // The scan sees what ValidateTrainOptions writes.
  for (const char* name : {"TrainOptions.staleness", "RunSpec.data_parallel",
                           "PartitionOptions.micro_batch_size", "WorldOptions.device"}) {
    EXPECT_EQ(seen.count(name), 1u) << name;
  }
}

// No string of the library names a flag ("--staleness", "use --foo"); another program's flags
// are allowed where they are listed here.
TEST(FieldFlags, NoLibraryStringNamesAFlag) {
  const std::vector<std::string> kOtherPrograms = {"srun "};  // a launcher's flag
  for (const auto& file : LibrarySources()) {
    for (const std::string& lit : StringLiterals(ReadFile(file))) {
      for (size_t at = lit.find("--"); at != std::string::npos; at = lit.find("--", at + 2)) {
        if (at + 2 >= lit.size() || !std::islower(static_cast<unsigned char>(lit[at + 2]))) {
          continue;
        }
        bool other = false;
        for (const std::string& o : kOtherPrograms) {
          other = other || (at >= o.size() && lit.compare(at - o.size(), o.size(), o) == 0);
        }
        EXPECT_TRUE(other) << file.string() << ": \"" << lit << "\" names a flag";
      }
    }
  }
}

// The binary: a refusal by the library's check reads in the flags the user typed, exit 2.
TEST(FieldFlags, CliRefusalsFromTheLibraryNameFlags) {
  using pipewright::cli_test::Result;
  using pipewright::cli_test::RunCli;
  const std::string base = "train --preset gpt-tiny --steps 1 --micro-batch-size 2 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--dp-mode async", "pipewright: --dp-mode async needs data parallelism (--dp >= 2)"},
      {"--dp 2 --dp-mode async --precision fp16",
       "pipewright: --dp-mode async does not support --precision fp16"},
      {"--dp 2 --precision fp16 --grad-compression bf16",
       "pipewright: --grad-compression bf16 does not support --precision fp16"},
      {"--zero 1", "pipewright: --zero 1 shards the optimizer state"},
      {"--dp 2 --dp-mode async --zero 1", "pipewright: --zero 1 needs synchronous DP"},
      {"--dp 2 --slow-replica 3:2", "pipewright: --slow-replica 3: there are only 2 replicas"},
      {"--recompute most", "pipewright: --recompute must be none, selective or full"},
  };
  for (const auto& [args, want] : cases) {
    const Result r = RunCli(base + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << "\n" << r.err;
    for (const std::string& name : FieldNames(r.err)) {
      ADD_FAILURE() << args << ": the CLI names the field " << name << ": " << r.err;
    }
  }
}

}  // namespace
