// The MPI backend's entry points in a build without MPI (no MPI C library at configure time):
// LaunchedByMpi() is false and everything else fails with FailedPrecondition.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/comm/mpi.h"

namespace pipewright {
namespace {

absl::Status BuiltWithoutMpi(const char* what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what,
                   ": pipewright was built without MPI (no MPI C library was found when it "
                   "was configured; install libopenmpi-dev and reconfigure)"));
}

}  // namespace

bool LaunchedByMpi() { return false; }

absl::StatusOr<MpiProcess> InitMpi() { return BuiltWithoutMpi("InitMpi"); }

void FinalizeMpi() {}

void NoteMpiFailure(int) {}

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(const MpiWorldOptions&) {
  return BuiltWithoutMpi("CreateMpiWorld");
}

namespace mpi {
absl::Status ToStatus(int mpi_error, const char* expr, const char* file, int line) {
  if (mpi_error == 0) return absl::OkStatus();
  return absl::UnknownError(absl::StrCat(expr, " at ", file, ":", line, ": MPI error ", mpi_error,
                                         " (pipewright was built without MPI)"));
}
}  // namespace mpi

}  // namespace pipewright
