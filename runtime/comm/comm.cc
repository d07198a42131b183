// The backend-independent functions of include/pipewright/comm.h.
#include "pipewright/comm.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pipewright {

void MarkRelayedAbort(absl::Status* status) {
  if (!status->ok()) status->SetPayload(kRelayedAbortPayload, absl::Cord("1"));
}

bool IsRelayedAbort(const absl::Status& status) {
  return status.GetPayload(kRelayedAbortPayload).has_value();
}

const char* CommBackendName(CommBackend b) {
  switch (b) {
    case CommBackend::kLocal:
      return "local";
    case CommBackend::kMpi:
      return "mpi";
    case CommBackend::kNccl:
      return "nccl";
  }
  return "unknown";
}

absl::StatusOr<CommBackend> ParseCommBackend(absl::string_view name) {
  for (CommBackend b : {CommBackend::kLocal, CommBackend::kMpi, CommBackend::kNccl}) {
    if (name == CommBackendName(b)) return b;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown communicator backend '", name, "': expected local, mpi or nccl"));
}

}  // namespace pipewright
