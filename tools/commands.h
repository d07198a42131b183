// Subcommands of the `pipewright` CLI. Each Register* adds a CLI11 subcommand whose callback
// stores the exit code in *exit_code: 0 success, 2 bad input, 1 runtime failure.
#ifndef PIPEWRIGHT_TOOLS_COMMANDS_H_
#define PIPEWRIGHT_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

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

// A whole file; NotFound naming `what` and the path when it cannot be read.
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what);
// Writes (truncates) a file: NotFound when it cannot be opened, DataLoss on a short write.
absl::Status WriteFile(const std::string& path, const std::string& text);

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
