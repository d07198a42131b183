// The command tree of `pipewright` (main.cc parses it; tests parse it in-process) and the exit
// code of an error.
#include "tools/commands.h"

#include <cstdio>
#include <string>

#include "tools/flags.h"

namespace pipewright::tools {

void RegisterCommands(CLI::App& app, int* exit_code) {
  RegisterTrain(app, exit_code);
  RegisterEval(app, exit_code);
  RegisterBench(app, exit_code);
  RegisterSimulate(app, exit_code);
  RegisterModel(app, exit_code);
  RegisterPlan(app, exit_code);
  RegisterValidate(app, exit_code);
  RegisterData(app, exit_code);
  RegisterExport(app, exit_code);
  RegisterImport(app, exit_code);
  // No option of any subcommand takes an empty value ("--save ''"); each numeric option's range
  // was attached where it was registered (tools/flags.h).
  RequireValues(app);
}

int ReportError(const absl::Status& status) {
  // The library names fields; the user typed flags (Note [Field names to flags], flags.h).
  std::fprintf(stderr, "pipewright: %s\n", InFlagTerms(status.message()).c_str());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kAlreadyExists:
      return 2;
    default:
      return 1;
  }
}

}  // namespace pipewright::tools
