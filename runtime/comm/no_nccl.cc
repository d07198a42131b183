// Built without NCCL (no CUDA, or nccl.h/libnccl not found): the NCCL factories of comm.h fail
// with FailedPrecondition.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "pipewright/comm.h"

namespace pipewright {
namespace {

absl::Status NoNccl(const char* what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      ": pipewright was built without NCCL (it needs a CUDA build and nccl.h/libnccl; see "
      "docs/cuda.md)"));
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclWorld(
    const std::vector<int>& cuda_devices, absl::Duration timeout) {
  return NoNccl("CreateNcclWorld");
}

absl::StatusOr<std::string> NcclUniqueId() { return NoNccl("NcclUniqueId"); }

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const std::string& unique_id,
                                                                     int rank, int size,
                                                                     int cuda_device,
                                                                     absl::Duration timeout) {
  return NoNccl("CreateNcclCommunicator");
}

}  // namespace pipewright
