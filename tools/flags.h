// Options of the `pipewright` subcommands with the values they accept (Note [Flag values]).
//
// Every option that takes a number is registered with AddInt, AddUint64, AddReal or AddByteSize:
// the value must be written in decimal and lie in the option's range, and a refusal names the
// flag, the value given and the range, at parse time (exit 2). RequireValues, called once on
// the whole command tree, makes every option that takes a value refuse an empty one.
#ifndef PIPEWRIGHT_TOOLS_FLAGS_H_
#define PIPEWRIGHT_TOOLS_FLAGS_H_

#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "pipewright/status.h"

namespace pipewright::tools {

// Ranges several subcommands share (docs/input-limits.md, "Flag ranges").
inline constexpr int64_t kMaxParallel = 65536;                 // --pp, --dp, --chunks, --stages
inline constexpr int64_t kMaxMicroBatches = int64_t{1} << 20;  // per replica and step
inline constexpr int64_t kMaxMicroBatchSize = int64_t{1} << 24;
inline constexpr int64_t kMaxSteps = int64_t{1} << 40;  // --steps, --warmup, --save-every, ...

// Note [Flag values]. CLI11 alone converts "" to 0, reads "010" as octal and "0x10" as hex,
// lets "nan" through its Range checks, and its unsigned conversion takes "-1". So each numeric
// option gets a Validator that reads the text itself (absl: decimal only), checks the range and
// rewrites the text to the canonical decimal form that CLI11 then converts exactly; a value is
// never truncated (the range must fit the variable) and never silently changed. A refused value
// throws FlagValueError, whose message main() prints as "pipewright: <message>" (exit 2).
class FlagValueError : public CLI::ParseError {
 public:
  explicit FlagValueError(const std::string& message)
      : CLI::ParseError("FlagValueError", message, CLI::ExitCodes::ValidationError) {}
};

// Accepted integers: [min, max]. `note` explains special values, e.g. "0: off".
struct IntRange {
  IntRange(int64_t min, int64_t max, std::string note = "")
      : min(min), max(max), note(std::move(note)) {}
  int64_t min, max;
  std::string note;
};

// Accepted reals: finite numbers in [min, max] (Closed) or (min, max] (LeftOpen); NaN and +-inf
// are always refused.
struct RealRange {
  static RealRange Closed(double min, double max, std::string note = "") {
    return {min, max, false, std::move(note)};
  }
  static RealRange LeftOpen(double min, double max, std::string note = "") {
    return {min, max, true, std::move(note)};
  }
  double min, max;
  bool min_open;
  std::string note;
};

// "--clip nan: must be a finite number in [0, 1e9] (0: off)"; an empty value shows as ''.
std::string FlagError(const std::string& flag, const std::string& value, const std::string& rule,
                      const std::string& note);

// The validators behind the Add* functions (Note [Flag values]); `flag` names the option in
// errors. Each rewrites an accepted value to its canonical decimal form. IntValidator accepts
// [range.min, range.max] of int64; Uint64Validator every uint64 ("-1" refused); RealValidator's
// `float_target` also refuses values that round to outside the range (or to 0 from a range
// that excludes 0) as a float.
CLI::Validator IntValidator(const std::string& flag, const IntRange& range);
CLI::Validator Uint64Validator(const std::string& flag);
CLI::Validator RealValidator(const std::string& flag, const RealRange& range, bool float_target);
CLI::Validator ByteSizeValidator(const std::string& flag, const IntRange& range);

// The name errors give an option: "--output" for "-o,--output", "plan" for a positional (CLI11's
// get_name() is empty for an option hidden from --help).
std::string OptionName(const CLI::Option& opt);

// An integer option; T holds every value of `range` (checked at registration).
template <typename T>
CLI::Option* AddInt(CLI::App* cmd, const std::string& names, T* value, const IntRange& range,
                    const std::string& help) {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>, "AddInt takes a signed integer");
  PW_CHECK(range.min <= range.max && range.min >= std::numeric_limits<T>::min() &&
           range.max <= std::numeric_limits<T>::max());
  CLI::Option* opt = cmd->add_option(names, *value, help);
  opt->transform(IntValidator(OptionName(*opt), range));
  // The default, in --help, where it is one of the accepted values (not a "not given" marker).
  if (*value >= range.min && *value <= range.max) opt->capture_default_str();
  return opt;
}

// An option taking any uint64 (a seed); T is uint64_t or std::optional<uint64_t>.
template <typename T>
CLI::Option* AddUint64(CLI::App* cmd, const std::string& names, T* value, const std::string& help) {
  static_assert(std::is_same_v<T, uint64_t> || std::is_same_v<T, std::optional<uint64_t>>);
  CLI::Option* opt = cmd->add_option(names, *value, help);
  opt->transform(Uint64Validator(OptionName(*opt)));
  if constexpr (std::is_same_v<T, uint64_t>) opt->capture_default_str();
  return opt;
}

// A float or double option.
template <typename T>
CLI::Option* AddReal(CLI::App* cmd, const std::string& names, T* value, const RealRange& range,
                     const std::string& help) {
  static_assert(std::is_floating_point_v<T>);
  CLI::Option* opt = cmd->add_option(names, *value, help);
  opt->transform(RealValidator(OptionName(*opt), range, std::is_same_v<T, float>));
  opt->capture_default_str();
  return opt;
}

// A size in bytes ("80GiB", "512 MiB", "4096"; ParseByteSize) kept as text in *value; the
// number of bytes must lie in `range`.
CLI::Option* AddByteSize(CLI::App* cmd, const std::string& names, std::string* value,
                         const IntRange& range, const std::string& help);

// Every option of `app` and its subcommands, at any depth, that takes a value refuses an empty
// one ("--save ''"), naming it. Called once, after every subcommand is registered.
void RequireValues(CLI::App& app);

// Note [Field names to flags]. The library checks its options once and names what was wrong by
// the field a C++ caller set ("TrainOptions.staleness = -1: must be >= 0", Note [Field names in
// errors] in pipewright/train.h). The CLI does not check them again: it hands the library what
// the flags said and, where an error is printed (ReportError), rewrites each field name into the
// flag that sets it through the one table below, "Field = value" into "--flag value"; so the
// user reads "--staleness -1: must be >= 0". A field the library names that no flag sets (the
// loss scale's bounds) stays as it is. tests/tools/field_flags_test.cc checks that every field
// name the library's sources write is here or deliberately absent.
struct FieldFlag {
  const char* field;  // "TrainOptions.staleness"; "GPT spec" (ParseGptSpec's name for its text)
  const char* flag;   // "--staleness"
};
const std::vector<FieldFlag>& FieldFlags();

// `message` with every field name of FieldFlags that stands as a whole name (not part of a longer
// dotted name) replaced by its flag, and "<field> = " by "<flag> ".
std::string InFlagTerms(absl::string_view message);

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_FLAGS_H_
