// The pipewright command-line program. Usage errors exit 2, runtime failures 1.
#include <cstdio>

#include "pipewright/cpu.h"
#include "pipewright/launch.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  // OpenBLAS's kernels for this CPU when its own detection fell short (Note in
  // kernels/cpu/cpu_features.cc); returns unless it re-executes this program.
  pipewright::ReexecForBlasCore(argv);
  CLI::App app{"pipewright: pipeline-parallel model-sharding runtime"};
  app.require_subcommand(1);
  int exit_code = 0;
  pipewright::tools::RegisterCommands(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Among them a refused option value (tools/flags.h), whose message names the option.
    std::fprintf(stderr, "pipewright: %s\n", e.what());
    std::fprintf(stderr, "%s", pipewright::tools::UsageHint(app, argc, argv).c_str());
    return 2;
  }
  // Under mpirun a failed process must not wait for its peers without bound at exit (a stopped
  // peer never comes): MPI_Finalize then gives way to MPI_Abort after a grace period.
  if (exit_code != 0) pipewright::NoteFailedExit(exit_code);
  return exit_code;
}
