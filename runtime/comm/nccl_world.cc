// The NCCL backend's world state, watchdog and initialisation (nccl_world.h).
#include "runtime/comm/nccl_world.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/cuda/cuda_check.cuh"
#include "pipewright/device.h"
#include "runtime/comm/comm_core.h"
#include "runtime/comm/mpi.h"
#include "runtime/comm/nccl_check.h"

namespace pipewright::nccl_internal {

using comm_internal::FormatSeconds;

bool NcclHandle::is_gone() {
  std::lock_guard<std::mutex> lock(state_mu);
  return gone;
}

void NcclHandle::AbortOnce() {
  {
    std::lock_guard<std::mutex> lock(state_mu);
    if (gone) return;
    gone = true;
  }
  const bool locked = call_mu.try_lock_for(std::chrono::milliseconds(200));
  {
    cuda::DeviceGuard guard(device);
    (void)ncclCommAbort(comm);  // nothing more to do if it fails
  }
  if (locked) call_mu.unlock();
}

NcclWorld::NcclWorld(absl::Duration timeout) : timeout_(timeout) {
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

NcclWorld::~NcclWorld() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  watchdog_.join();
}

void NcclWorld::Register(const std::shared_ptr<NcclHandle>& handle) {
  absl::MutexLock lock(&mu_);
  handles_.push_back(handle);
}

void NcclWorld::Abort(const absl::Status& status) {
  std::vector<std::shared_ptr<NcclHandle>> handles;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_) return;
    aborted_ = true;
    abort_status_ = status.ok() ? absl::AbortedError("aborted") : status;
    for (const std::weak_ptr<NcclHandle>& w : handles_) {
      if (std::shared_ptr<NcclHandle> h = w.lock()) handles.push_back(std::move(h));
    }
  }
  // Under a launcher this process failed: its exit must not wait for its peers without bound in
  // MPI_Finalize (Note [Leaving after a failure] in mpi_process.cc).
  NoteMpiFailure(0);
  for (const std::shared_ptr<NcclHandle>& h : handles) h->AbortOnce();
}

bool NcclWorld::aborted() {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

absl::Status NcclWorld::abort_status() {
  absl::MutexLock lock(&mu_);
  return aborted_ ? abort_status_ : absl::OkStatus();
}

int64_t NcclWorld::BeginCall(std::string what, absl::Duration limit) {
  absl::MutexLock lock(&mu_);
  const int64_t id = next_call_++;
  calls_[id] = Call{std::move(what), limit, absl::Now() + limit};
  return id;
}

void NcclWorld::EndCall(int64_t id) {
  absl::MutexLock lock(&mu_);
  calls_.erase(id);
}

void NcclWorld::WatchdogLoop() {
  while (true) {
    absl::Status expired;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(50));
      if (stop_) return;
      if (aborted_) continue;
      const absl::Time now = absl::Now();
      for (const auto& [id, call] : calls_) {
        if (now >= call.deadline) {
          expired = absl::DeadlineExceededError(
              absl::StrCat(call.what, ": blocked in NCCL for more than ", FormatSeconds(call.limit),
                           " (a peer never posted its side, or died); aborting the NCCL world"));
          break;
        }
      }
    }
    if (!expired.ok()) Abort(expired);
  }
}

absl::Status InitWithTimeout(const std::string& what, absl::Duration timeout,
                             std::function<ncclResult_t(std::vector<ncclComm_t>&)> init,
                             std::vector<ncclComm_t>& comms) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false, abandoned = false;
    ncclResult_t result = ncclSuccess;
    std::vector<ncclComm_t> comms;
  };
  auto state = std::make_shared<State>();
  state->comms.assign(comms.size(), nullptr);
  std::thread([state, init = std::move(init)] {
    std::vector<ncclComm_t> local(state->comms.size(), nullptr);
    const ncclResult_t r = init(local);
    std::lock_guard<std::mutex> lock(state->mu);
    state->done = true;
    state->result = r;
    if (state->abandoned) {
      for (ncclComm_t c : local) {
        if (c != nullptr) (void)ncclCommAbort(c);
      }
      return;
    }
    state->comms = local;
    state->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mu);
  const bool finished =
      state->cv.wait_for(lock, absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24 * 365))),
                         [&] { return state->done; });
  if (!finished) {
    state->abandoned = true;
    return absl::DeadlineExceededError(
        absl::StrCat(what, " did not finish within ", FormatSeconds(timeout),
                     " (every rank must create its communicator; is one missing?)"));
  }
  if (state->result != ncclSuccess) {
    for (ncclComm_t c : state->comms) {
      if (c != nullptr) (void)ncclCommAbort(c);
    }
    return nccl::ToStatus(state->result, what.c_str(), __FILE__, __LINE__);
  }
  comms = state->comms;
  return absl::OkStatus();
}

absl::Status CheckDevices(const std::vector<int>& devices, const char* what) {
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what,
                     ": no CUDA GPU is visible (no driver, no device, or "
                     "CUDA_VISIBLE_DEVICES hides them)"));
  }
  std::set<int> seen;
  for (int d : devices) {
    if (d < 0 || d >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": CUDA device ", d, " does not exist (", count, " visible)"));
    }
    if (!seen.insert(d).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": CUDA device ", d, " is listed twice; NCCL needs one GPU per rank [",
                       absl::StrJoin(devices, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pipewright::nccl_internal
