// Validators of the `pipewright` options (Note [Flag values] in flags.h).
#include "tools/flags.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tools/commands.h"

namespace pipewright::tools {
namespace {

// The names the validators go by in CLI11 (Option::get_validator).
constexpr char kRangeValidator[] = "pipewright-range";
constexpr char kNonEmptyValidator[] = "pipewright-non-empty";

// The shortest text that reads back as `x` at the precision of T: "0.003", "1e9", "16777216".
template <typename T>
std::string Shortest(T x) {
  if (x == std::floor(x) && std::abs(x) < 1e7) return absl::StrFormat("%.0f", x);
  std::string text;
  for (int digits = 1; digits <= std::numeric_limits<T>::max_digits10; ++digits) {
    text = absl::StrFormat("%.*g", digits, static_cast<double>(x));
    T back = 0;
    if (std::sscanf(text.c_str(), std::is_same_v<T, float> ? "%f" : "%lf", &back) == 1 &&
        back == x) {
      break;
    }
  }
  // "1e+09" -> "1e9", "1e-06" -> "1e-6".
  const size_t e = text.find('e');
  if (e != std::string::npos) {
    std::string exponent = text.substr(e + 1);
    const bool negative = exponent[0] == '-';
    exponent = exponent.substr(exponent[0] == '-' || exponent[0] == '+' ? 1 : 0);
    while (exponent.size() > 1 && exponent[0] == '0') exponent.erase(0, 1);
    text = absl::StrCat(text.substr(0, e), "e", negative ? "-" : "", exponent);
  }
  return text;
}

std::string Interval(const RealRange& r) {
  return absl::StrCat(r.min_open ? "(" : "[", Shortest(r.min), ", ", Shortest(r.max), "]");
}

std::string IntInterval(const IntRange& r) { return absl::StrCat("[", r.min, ", ", r.max, "]"); }

// "1EiB", "80GiB", "3000": exact binary multiples in their unit, anything else in bytes.
std::string Bytes(int64_t n) {
  static const std::pair<const char*, int64_t> kUnits[] = {
      {"EiB", int64_t{1} << 60}, {"PiB", int64_t{1} << 50}, {"TiB", int64_t{1} << 40},
      {"GiB", int64_t{1} << 30}, {"MiB", int64_t{1} << 20}, {"KiB", int64_t{1} << 10}};
  for (const auto& [unit, scale] : kUnits) {
    if (n != 0 && n % scale == 0) return absl::StrCat(n / scale, unit);
  }
  return absl::StrCat(n);
}

}  // namespace

std::string FlagError(const std::string& flag, const std::string& value, const std::string& rule,
                      const std::string& note) {
  const bool quote = value.empty() || value.find_first_of(" \t\n'") != std::string::npos;
  return absl::StrCat(flag, " ", quote ? absl::StrCat("'", value, "'") : value, ": ", rule,
                      note.empty() ? "" : absl::StrCat(" (", note, ")"));
}

std::string OptionName(const CLI::Option& opt) {
  if (!opt.get_lnames().empty()) return "--" + opt.get_lnames().front();
  if (!opt.get_snames().empty()) return "-" + opt.get_snames().front();
  return opt.get_single_name();
}

CLI::Validator IntValidator(const std::string& flag, const IntRange& range) {
  return CLI::Validator(
      [flag, range](std::string& text) -> std::string {
        int64_t v = 0;
        // absl reads decimal only: no octal "010", no hex "0x10", no "1e3", no overflow.
        if (!absl::SimpleAtoi(text, &v) || v < range.min || v > range.max) {
          throw FlagValueError(FlagError(
              flag, text, absl::StrCat("must be an integer in ", IntInterval(range)), range.note));
        }
        text = absl::StrCat(v);
        return "";
      },
      IntInterval(range), kRangeValidator);
}

CLI::Validator Uint64Validator(const std::string& flag) {
  return CLI::Validator(
      [flag](std::string& text) -> std::string {
        uint64_t v = 0;
        if (!absl::SimpleAtoi(text, &v)) {
          throw FlagValueError(FlagError(
              flag, text,
              absl::StrCat("must be an integer in [0, ", std::numeric_limits<uint64_t>::max(), "]"),
              ""));
        }
        text = absl::StrCat(v);
        return "";
      },
      "", kRangeValidator);
}

CLI::Validator RealValidator(const std::string& flag, const RealRange& range, bool float_target) {
  return CLI::Validator(
      [flag, range, float_target](std::string& text) -> std::string {
        double v = 0;
        // Decimal only: absl::SimpleAtod (strtod) would also read hex ("0x10") and "nan(...)".
        // "1e400" reads as inf, refused below like "inf".
        const absl::string_view digits = absl::StripAsciiWhitespace(text);
        bool ok = !digits.empty() &&
                  digits.find_first_not_of("0123456789.eE+-") == absl::string_view::npos &&
                  absl::SimpleAtod(digits, &v) && std::isfinite(v);
        // What the option's variable will hold (a float rounds 1e-50 to 0 and 1e39 to inf).
        if (ok && float_target) v = static_cast<float>(v);
        ok = ok && std::isfinite(v) && (range.min_open ? v > range.min : v >= range.min) &&
             v <= range.max;
        if (!ok) {
          throw FlagValueError(
              FlagError(flag, text, absl::StrCat("must be a finite number in ", Interval(range)),
                        range.note));
        }
        text = float_target ? Shortest(static_cast<float>(v)) : Shortest(v);
        return "";
      },
      Interval(range), kRangeValidator);
}

CLI::Validator ByteSizeValidator(const std::string& flag, const IntRange& range) {
  const std::string interval = absl::StrCat("[", Bytes(range.min), ", ", Bytes(range.max), "]");
  return CLI::Validator(
      [flag, range, interval](std::string& text) -> std::string {
        absl::StatusOr<int64_t> bytes = ParseByteSize(text);
        if (!bytes.ok() || *bytes < range.min || *bytes > range.max) {
          throw FlagValueError(FlagError(
              flag, text,
              absl::StrCat("must be a size in ", interval,
                           " (bytes, or a number with KiB, MiB, GiB, TiB, KB, MB, GB, TB)"),
              range.note));
        }
        return "";
      },
      interval, kRangeValidator);
}

CLI::Option* AddByteSize(CLI::App* cmd, const std::string& names, std::string* value,
                         const IntRange& range, const std::string& help) {
  CLI::Option* opt = cmd->add_option(names, *value, help);
  opt->check(ByteSizeValidator(OptionName(*opt), range));
  opt->type_name("SIZE");
  opt->capture_default_str();
  return opt;
}

void RequireValues(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_expected_max() == 0) continue;  // a flag: takes no value
    // Text options show their default in --help too (numeric ones did where registered).
    if (opt->get_type_name().rfind("TEXT", 0) == 0) opt->capture_default_str();
    const std::string flag = OptionName(*opt);
    opt->check(CLI::Validator(
        [flag](std::string& text) -> std::string {
          if (text.empty()) throw FlagValueError(FlagError(flag, text, "must not be empty", ""));
          return "";
        },
        "", kNonEmptyValidator));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) RequireValues(*sub);
}

const std::vector<FieldFlag>& FieldFlags() {
  static const std::vector<FieldFlag> kTable = {
      // TrainOptions (pipewright/train.h): train.
      {"TrainOptions.steps", "--steps"},
      {"TrainOptions.seed", "--seed"},
      {"TrainOptions.lr", "--lr"},
      {"TrainOptions.lr_scaling", "--lr-scaling"},
      {"TrainOptions.base_batch", "--base-batch"},
      {"TrainOptions.warmup_steps", "--warmup"},
      {"TrainOptions.min_lr_ratio", "--min-lr-ratio"},
      {"TrainOptions.clip_norm", "--clip"},
      {"TrainOptions.optimizer.kind", "--optimizer"},
      {"TrainOptions.optimizer.weight_decay", "--weight-decay"},
      {"TrainOptions.precision", "--precision"},
      {"TrainOptions.bucket_bytes", "--bucket-mb"},
      {"TrainOptions.grad_compression", "--grad-compression"},
      {"TrainOptions.dp_mode", "--dp-mode"},
      {"TrainOptions.zero", "--zero"},
      {"TrainOptions.zero_buffers", "--zero-buffers"},
      {"TrainOptions.staleness", "--staleness"},
      {"TrainOptions.threads_per_rank", "--threads-per-rank"},
      {"TrainOptions.data_workers", "--data-workers"},
      {"GenerateOptions.tokens", "--tokens"},
      {"GenerateOptions.temperature", "--temperature"},
      {"GenerateOptions.top_k", "--top-k"},
      {"GenerateOptions.prompt", "--prompt"},
      {"GenerateOptions.device", "--device"},
      {"LossScaleOptions.initial_scale", "--loss-scale"},
      {"LossScaleOptions.growth_interval", "--loss-scale-window"},
      {"OptimizerConfig.kind", "--optimizer"},
      // TrainTestingHooks (pipewright/train_testing.h): train's hidden testing flags.
      {"TrainTestingHooks.slow_replica", "--slow-replica"},
      {"TrainTestingHooks.slow_factor", "the --slow-replica factor"},
      {"TrainTestingHooks.inject_failure_rank", "the --inject-failure rank"},
      {"TrainTestingHooks.inject_failure_step", "the --inject-failure step"},
      // RunSpec (pipewright/run_spec.h) and the model's micro-batch: train.
      {"RunSpec.data_parallel", "--dp"},
      {"RunSpec.tensor_parallel", "--tp"},
      {"RunSpec.sequence_parallel", "--sequence-parallel"},
      {"RunSpec.recompute", "--recompute"},
      {"RunSpec.boundaries", "--split"},
      {"MicroBatchShape.batch", "--micro-batch-size"},
      {"ScheduleSpec.micro_batches", "--micro-batches"},
      // WorldOptions (pipewright/launch.h): train.
      {"WorldOptions.device", "--device"},
      {"WorldOptions.comm", "--comm"},
      // DeviceSpec, PartitionOptions, SearchOptions (pipewright/partitioner.h): plan.
      {"DeviceSpec.count", "--devices"},
      {"DeviceSpec.memory_bytes", "--device-memory"},
      {"DeviceSpec.reserve_bytes", "--reserve"},
      {"DeviceSpec.tflops", "--device-tflops"},
      {"DeviceSpec.link_bandwidth", "--link-gbps"},
      {"DeviceSpec.link_latency_s", "--link-latency-us"},
      {"DeviceSpec.memory_bandwidth", "--hbm-gbps"},
      {"DeviceSpec.devices_per_node", "--devices-per-node"},
      {"DeviceSpec.tp_bandwidth", "--tp-bandwidth"},
      {"PartitionOptions.pp", "--pp"},
      {"PartitionOptions.dp", "--dp"},
      {"PartitionOptions.schedule", "--schedule"},
      {"PartitionOptions.chunks", "--chunks"},
      {"PartitionOptions.micro_batches", "--micro-batches"},
      {"PartitionOptions.micro_batch_size", "--micro-batch-size"},
      {"PartitionOptions.precision", "--precision"},
      {"PartitionOptions.zero", "--zero"},
      {"PartitionOptions.tp", "--tp"},
      {"PartitionOptions.sequence_parallel", "--sequence-parallel"},
      {"SearchOptions.global_batch", "--global-batch"},
      {"SearchOptions.pp", "--pp"},
      {"SearchOptions.dp", "--dp"},
      {"SearchOptions.chunks", "--chunks"},
      {"SearchOptions.zero", "--zero"},
      {"SearchOptions.tp", "--tp"},
      {"SearchOptions.sequence_parallel", "--sequence-parallel"},
      {"SearchOptions.schedule", "--schedule"},
      {"SearchOptions.micro_batch_size", "--micro-batch-size"},
      // TrainTokenizerOptions, PrepareOptions (pipewright/data.h): data train-tokenizer, prepare.
      {"TrainTokenizerOptions.input", "--input"},
      {"TrainTokenizerOptions.model_prefix", "--model-prefix"},
      {"TrainTokenizerOptions.vocab_size", "--vocab-size"},
      {"TrainTokenizerOptions.model_type", "--model-type"},
      {"PrepareOptions.input", "--input"},
      {"PrepareOptions.output", "--output"},
      {"PrepareOptions.tokenizer", "--tokenizer"},
      // ParseGptSpec (pipewright/model.h): model.
      {"GPT spec", "--gpt"},
  };
  return kTable;
}

namespace {

bool IsNameChar(char c) { return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_'; }

}  // namespace

std::string InFlagTerms(absl::string_view message) {
  std::string out;
  size_t i = 0;
  while (i < message.size()) {
    // A name starts here unless it would continue a name ("XTrainOptions", "a.TrainOptions").
    const bool starts = i == 0 || !(IsNameChar(message[i - 1]) || message[i - 1] == '.');
    const FieldFlag* best = nullptr;
    size_t best_len = 0;
    for (const FieldFlag& ff : FieldFlags()) {
      const absl::string_view field = ff.field;
      if (!starts || field.size() <= best_len || message.substr(i, field.size()) != field) continue;
      // ... and ends there: not followed by more of a name ("TrainOptions.lr_x",
      // "TrainOptions.optimizer.kind" for "TrainOptions.optimizer").
      const size_t end = i + field.size();
      if (end < message.size() &&
          (IsNameChar(message[end]) ||
           (message[end] == '.' && end + 1 < message.size() && IsNameChar(message[end + 1])))) {
        continue;
      }
      best = &ff;
      best_len = field.size();
    }
    if (best == nullptr) {
      out.push_back(message[i++]);
      continue;
    }
    out += best->flag;
    i += best_len;
    if (message.substr(i, 3) == " = ") {  // "Field = value" -> "--flag value"
      out.push_back(' ');
      i += 3;
    }
  }
  return out;
}

}  // namespace pipewright::tools
