// Asynchronous data parallelism (internal; Note [Async DP] in async_dp.cc): the parameter shard a
// replica owns, the coordinator that grants steps within the staleness bound, and the service
// thread that answers the other replicas' pulls, pushes and claims over the stage's
// data-parallel communicator.
#ifndef PIPEWRIGHT_RUNTIME_DATA_PARALLEL_ASYNC_DP_H_
#define PIPEWRIGHT_RUNTIME_DATA_PARALLEL_ASYNC_DP_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/engine.h"
#include "pipewright/optimizer.h"

namespace pipewright::internal {

// The protocol on a stage's data-parallel communicator (group rank = replica). A request is an
// f64 header of kAsyncHeaderLen values {kind, a, b, c, d, e, f, g} on kAsyncTagRequest; a push's
// gradients follow on kAsyncTagGradients. Replies: parameter values on kAsyncTagValues, a push's
// acknowledgement on kAsyncTagAck, a claim's grant on kAsyncTagGrant (headers again).
enum class AsyncRequest : int {
  kPull = 1,   // send me your shard's current values
  kPush = 2,   // {a: the replica's step, b: lr, c: gradient scale}, then the gradients
  kClaim = 3,  // to the coordinator: {a: steps done, b: stop requested, c: seconds waited on the
               // bound so far, d: last update's ticket (-1: none), e: its loss, f: its grad norm}
  kBye = 4,    // this replica takes no more steps
};
inline constexpr int64_t kAsyncTagRequest = 1, kAsyncTagGradients = 2, kAsyncTagValues = 3,
                         kAsyncTagAck = 4, kAsyncTagGrant = 5;
inline constexpr int64_t kAsyncHeaderLen = 8;

// The owner (a replica) of each parameter: greedy by size, largest first, onto the replica that
// owns the fewest elements so far (ties: lower index); the same on every replica.
std::vector<int> AssignOwners(const std::vector<Parameter*>& params, int replicas);

// The parameters one replica owns: their master values and optimizer state, updated by each
// replica's gradients as they arrive. Shared by the rank's own thread and its service thread.
class AsyncShard {
 public:
  // `owned`: the rank's live parameters this replica owns (names, shapes, decay flags); the
  // master copies start as their values, the state as `from`'s for them (a fresh optimizer's
  // zeros, or a resumed checkpoint's) with `from`'s step count.
  static absl::StatusOr<std::unique_ptr<AsyncShard>> Create(const OptimizerConfig& config,
                                                            std::vector<Parameter*> owned,
                                                            const Optimizer& from, int replicas,
                                                            Allocator* alloc);
  int64_t numel() const { return numel_; }
  // The master values, concatenated in `owned` order.
  void Read(float* out) const;
  // Applies one replica step's gradients (concatenated like Read) with AdamW/SGD at `lr`, the
  // gradients times `scale`. `step` must be the next of that replica's (each gradient applied
  // once); returns the updates applied before this one.
  absl::StatusOr<int64_t> Apply(int replica, int64_t step, float lr, float scale,
                                const float* grads);
  // Copies the master values into the live parameters and the state into `to`'s tensors of
  // them (the engine's consolidation, after the run).
  absl::Status Store(Optimizer& to) const;
  std::vector<int64_t> applied() const;
  int64_t updates() const;

 private:
  AsyncShard() = default;
  mutable absl::Mutex mu_;
  std::vector<Parameter*> owned_;
  std::vector<std::unique_ptr<Parameter>> master_;  // value: master copy; grad: the push
  std::unique_ptr<Optimizer> opt_;
  std::vector<int64_t> applied_;  // per replica
  int64_t numel_ = 0;
};

// Grants replica steps (Note [Async DP]): a replica that has done `done` steps may start its next
// one while done - (the fewest steps any replica still running has done) <= staleness, and while
// tickets remain; each grant takes the next ticket (the update's place in the run: it picks the
// learning rate). One lives on global rank 0 (the coordinator).
class AsyncCoordinator {
 public:
  struct Grant {
    bool go = false;
    int64_t ticket = -1;
    int64_t staleness = 0;
  };
  AsyncCoordinator(int replicas, int staleness, int64_t first_ticket, int64_t end_ticket);
  // Replica `r`'s claim (the kClaim header's fields); the update it reports, if any, is recorded.
  void Claim(int r, const double* header);
  // Grants decided for replicas other than `local` since the last call (the service sends them).
  std::vector<std::pair<int, Grant>> TakeRemote(int local);
  // Blocks until replica `r`'s pending claim is decided, `timeout` passes or `aborted` is not OK.
  absl::StatusOr<Grant> WaitGrant(int r, absl::Duration timeout,
                                  const std::function<absl::Status()>& aborted);
  // After every replica has said goodbye.
  AsyncReport Report() const;
  int64_t end_ticket() const;

 private:
  void DecideLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  const int replicas_, staleness_;
  const int64_t first_ticket_;
  int64_t end_ticket_ ABSL_GUARDED_BY(mu_);
  int64_t next_ticket_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int64_t> done_ ABSL_GUARDED_BY(mu_);
  std::vector<char> running_ ABSL_GUARDED_BY(mu_), pending_ ABSL_GUARDED_BY(mu_);
  std::map<int, Grant> decided_ ABSL_GUARDED_BY(mu_);
  std::vector<AsyncReplicaReport> stats_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> staleness_sum_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, AsyncReport::Update> updates_ ABSL_GUARDED_BY(mu_);  // by ticket
};

// The service loop of one rank (its own thread): answers the other replicas' requests on `comm`
// (pulls from `shard`, pushes applied to it, claims to `coord` when this is the coordinator) until
// each of them has said goodbye, the world is aborted, or `cancel` is set. Returns the first error.
struct AsyncServiceArgs {
  Communicator* comm = nullptr;
  AsyncShard* shard = nullptr;
  AsyncCoordinator* coord = nullptr;  // on the coordinator's rank only
  absl::Duration timeout;
  const std::atomic<bool>* cancel = nullptr;
};
absl::Status RunAsyncService(const AsyncServiceArgs& args);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_DATA_PARALLEL_ASYNC_DP_H_
