// Subcommands of the `pipewright` CLI. Each Register* adds a CLI11 subcommand whose callback
// stores the exit code in *exit_code: 0 success, 2 bad input, 1 runtime failure.
#ifndef PIPEWRIGHT_TOOLS_COMMANDS_H_
#define PIPEWRIGHT_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "pipewright/input.h"

namespace pipewright::tools {

void RegisterTrain(CLI::App& app, int* exit_code);
void RegisterEval(CLI::App& app, int* exit_code);
void RegisterGenerate(CLI::App& app, int* exit_code);
void RegisterPlot(CLI::App& app, int* exit_code);
void RegisterBench(CLI::App& app, int* exit_code);
void RegisterSimulate(CLI::App& app, int* exit_code);
void RegisterModel(CLI::App& app, int* exit_code);
void RegisterPlan(CLI::App& app, int* exit_code);
void RegisterValidate(CLI::App& app, int* exit_code);
void RegisterData(CLI::App& app, int* exit_code);
void RegisterExport(CLI::App& app, int* exit_code);
void RegisterImport(CLI::App& app, int* exit_code);
// Every subcommand above, then RequireValues (tools/flags.h): the whole command tree.
void RegisterCommands(CLI::App& app, int* exit_code);

// What to tell a user whose command line did not parse, after CLI11's message: for each option
// the subcommand does not have, the nearest one it does ("unknown option --step for 'pipewright
// train'; did you mean --steps?"), then which help to read ("run 'pipewright train --help' for
// its options"; the top-level help when no subcommand was named). Lines end in '\n'.
std::string UsageHint(const CLI::App& app, int argc, const char* const* argv);

// Prints "pipewright: <message>" on stderr and returns the exit code for `status`:
// 2 for InvalidArgument / NotFound / FailedPrecondition / OutOfRange / Unimplemented, 1 otherwise.
int ReportError(const absl::Status& status);

// The whole regular file `path`, at most `max_bytes` of it (ReadRegularFile, pipewright/input.h):
// a FIFO, a device or a directory is InvalidArgument naming `what` (the flag, e.g. "--plan") and
// the kind of file, a missing file NotFound, a larger file InvalidArgument naming the limit.
// Every file a subcommand reads goes through ReadFile or ReadJsonFile (docs/input-limits.md, "Input
// limits").
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what,
                                     int64_t max_bytes = kMaxJsonFileBytes);
// ReadFile for a JSON document: at most kMaxJsonFileBytes, and nested at most kMaxJsonDepth
// deep ("plan 'p.json': JSON nested deeper than 64 levels (at byte 105)"), checked before any
// parser sees it.
absl::StatusOr<std::string> ReadJsonFile(const std::string& path, absl::string_view what);
// Replaces `path` with `text`: a FIFO, socket, block device or directory there is refused
// (CheckOutputPath, InvalidArgument naming `what`); a regular file is replaced atomically (a
// temporary file beside it, renamed over it), so a failed write leaves the old file whole; a
// character device (/dev/null) is written in place. NotFound when the file cannot be created,
// DataLoss when the disk is full.
absl::Status WriteFile(const std::string& path, const std::string& text,
                       absl::string_view what = "output file");

// Human units for printed tables: "41.25 MiB" (B, KiB, MiB, GiB, TiB with two decimals),
// "124.48M" (K, M, B, T), "0.41 ms" (ns to s with three significant digits, then s).
std::string HumanBytes(double bytes);
std::string HumanCount(double n);
std::string HumanSeconds(double s);

// "80GiB", "512 MiB", "1.5GB", "4096" (bytes): binary and decimal units, case-insensitive.
absl::StatusOr<int64_t> ParseByteSize(const std::string& text);

// Whether a launcher (mpirun, srun) started this process: its stdout is forwarded, and may be a
// terminal (Open MPI gives rank 0 a pseudo-terminal) when the launcher's own output is a file.
bool UnderLauncher();

// What `train` prints per step on the root process (issue 36). On a terminal, and not under a
// launcher, a progress bar redrawn in place with the elapsed time and an ETA; anywhere else (a
// file, a pipe, any launcher), or when `every` > 0 (--log-every), one plain line without control
// codes every `every` steps (kDefaultEvery when 0), plus the first and the last step:
//   step 10/60  loss 4.1234  lr 3.00e-03  812 samples/s  (2.1s elapsed, eta 10.4s)
class StepLog {
 public:
  static constexpr int64_t kDefaultEvery = 10;
  // Steps first+1 .. total will be reported (done counts steps, as StepResult::step + 1).
  StepLog(int64_t first, int64_t total, int64_t every, bool enabled);
  void Update(int64_t done, const std::string& text);
  void Finish();

 private:
  std::string Eta(int64_t done) const;
  int64_t first_, total_;
  absl::Time start_;
  bool bar_ = false, drawn_ = false;
  int64_t every_ = 0;  // 0: nothing printed
};

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_COMMANDS_H_
