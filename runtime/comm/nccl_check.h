// ToStatus for ncclResult_t (runtime-internal; only the NCCL build includes it): the failed
// expression, file:line, ncclGetErrorString and NCCL's last error message.
#ifndef PIPEWRIGHT_RUNTIME_COMM_NCCL_CHECK_H_
#define PIPEWRIGHT_RUNTIME_COMM_NCCL_CHECK_H_

#include <nccl.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pipewright::nccl {

// OK for ncclSuccess. `comm` (may be null) selects NCCL's last-error message; pass null for a
// communicator that was aborted (its handle is gone).
inline absl::Status ToStatus(ncclResult_t result, const char* expr, const char* file, int line,
                             ncclComm_t comm = nullptr) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(expr, " at ", file, ":", line, ": ", ncclGetErrorString(result));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&msg, ": ", last);
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(msg);
    case ncclSystemError:
    case ncclRemoteError:
    case ncclInProgress:
      return absl::UnavailableError(msg);
    case ncclUnhandledCudaError:
    case ncclInternalError:
      return absl::InternalError(msg);
    default:
      return absl::UnknownError(msg);
  }
}

}  // namespace pipewright::nccl

#define PW_NCCL_RETURN_IF_ERROR(expr) \
  PW_RETURN_IF_ERROR(::pipewright::nccl::ToStatus((expr), #expr, __FILE__, __LINE__))

#endif  // PIPEWRIGHT_RUNTIME_COMM_NCCL_CHECK_H_
