// Subcommands of the `pipewright` CLI. Each Register* adds a CLI11 subcommand whose callback
// stores the exit code in *exit_code: 0 success, 2 bad input, 1 runtime failure.
#ifndef PIPEWRIGHT_TOOLS_COMMANDS_H_
#define PIPEWRIGHT_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/input.h"

namespace pipewright::tools {

void RegisterTrain(CLI::App& app, int* exit_code);
void RegisterEval(CLI::App& app, int* exit_code);
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

// Prints "pipewright: <message>" on stderr and returns the exit code for `status`:
// 2 for InvalidArgument / NotFound / FailedPrecondition / OutOfRange / Unimplemented, 1 otherwise.
int ReportError(const absl::Status& status);

// The whole regular file `path`, at most `max_bytes` of it (ReadRegularFile, pipewright/input.h):
// a FIFO, a device or a directory is InvalidArgument naming `what` (the flag, e.g. "--plan") and
// the kind of file, a missing file NotFound, a larger file InvalidArgument naming the limit.
// Every file a subcommand reads goes through ReadFile or ReadJsonFile (docs/runtime.md, "Input
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

// "80GiB", "512 MiB", "1.5GB", "4096" (bytes): binary and decimal units, case-insensitive.
absl::StatusOr<int64_t> ParseByteSize(const std::string& text);

// Terminal progress bar ("[#####.....] 12/60 ..."), drawn only when stdout is a terminal.
class ProgressBar {
 public:
  ProgressBar(int64_t total, bool enabled);
  void Update(int64_t done, const std::string& text);
  void Finish();

 private:
  int64_t total_;
  bool enabled_;
};

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_COMMANDS_H_
