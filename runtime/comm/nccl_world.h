// The NCCL backend's shared state (runtime-internal; only the NCCL build includes it): one
// NcclHandle per ncclComm_t, one NcclWorld per world (its abort state, shared with every
// communicator split from it, and the watchdog that aborts the world when an NCCL call stays
// blocked past its limit), and the bounded communicator initialisation. runtime/comm/nccl.cc
// builds the Communicator on top.
#ifndef PIPEWRIGHT_RUNTIME_COMM_NCCL_WORLD_H_
#define PIPEWRIGHT_RUNTIME_COMM_NCCL_WORLD_H_

#include <nccl.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pipewright::nccl_internal {

// One ncclComm_t. `call_mu` is held for every NCCL call on it; `gone` (under state_mu) is set
// once it was aborted or destroyed, after which nothing calls NCCL on it again.
struct NcclHandle {
  ncclComm_t comm = nullptr;
  int device = 0;
  std::timed_mutex call_mu;
  std::mutex state_mu;
  bool gone = false;

  bool is_gone();
  // ncclCommAbort, once. A thread blocked in an NCCL call on this communicator holds call_mu:
  // after a short grace the abort goes ahead anyway, which is what makes that call return.
  void AbortOnce();
};

// State shared by the communicators of one world and of everything split from it. Thread-safe.
class NcclWorld {
 public:
  // Starts the watchdog thread (stopped and joined by the destructor).
  explicit NcclWorld(absl::Duration timeout);
  ~NcclWorld();
  NcclWorld(const NcclWorld&) = delete;
  NcclWorld& operator=(const NcclWorld&) = delete;

  // The limit of a blocking NCCL call (Split has its own).
  absl::Duration timeout() const { return timeout_; }

  // Adds a communicator for Abort to reach (held weakly).
  void Register(const std::shared_ptr<NcclHandle>& handle);

  // The first abort wins (an OK status becomes Aborted "aborted"); every communicator of the
  // world is aborted.
  void Abort(const absl::Status& status);

  bool aborted();
  // OK, or the first abort's status.
  absl::Status abort_status();

  // Brackets an NCCL call that may block the host: past `limit` the watchdog aborts the world
  // with DeadlineExceeded naming `what`.
  int64_t BeginCall(std::string what, absl::Duration limit);
  void EndCall(int64_t id);

 private:
  struct Call {
    std::string what;
    absl::Duration limit;
    absl::Time deadline;
  };

  void WatchdogLoop();

  const absl::Duration timeout_;
  absl::Mutex mu_;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status abort_status_ ABSL_GUARDED_BY(mu_);
  std::vector<std::weak_ptr<NcclHandle>> handles_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Call> calls_ ABSL_GUARDED_BY(mu_);
  int64_t next_call_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

// Runs a communicator initialisation on its own thread, waiting at most `timeout`. If it does not
// finish in time the thread is left behind; should it finish later it aborts what it created.
// `comms` has the number of communicators to create and receives them.
absl::Status InitWithTimeout(const std::string& what, absl::Duration timeout,
                             std::function<ncclResult_t(std::vector<ncclComm_t>&)> init,
                             std::vector<ncclComm_t>& comms);

// `devices` are distinct, visible CUDA devices; else FailedPrecondition (no GPU) or
// InvalidArgument naming `what` and the bad device.
absl::Status CheckDevices(const std::vector<int>& devices, const char* what);

}  // namespace pipewright::nccl_internal

#endif  // PIPEWRIGHT_RUNTIME_COMM_NCCL_WORLD_H_
