// Communication between ranks: the Topology of a pp x dp run and the Communicator interface that
// every backend implements (local threads here; MPI and NCCL in their own issues). The engine
// talks to other ranks only through this interface, so the in-process default exercises the
// same code paths as a cluster.
//
// Semantics every backend keeps:
//  - Send is eager: it completes without waiting for the receiver (the backend buffers).
//  - Recv(t, peer, tag) completes with the message sent by `peer` to this rank with the same
//    tag; messages with other tags, or from other peers, never match it, whatever the order
//    they arrive in. Two messages with the same (peer, tag) are received in send order. `t` is
//    preallocated by the receiver: a message of another size or dtype is an error.
//  - AllReduce sums element-wise over the group in group-rank order (((x0 + x1) + x2) + ...),
//    so every rank gets bit-identical results and reruns are bit-stable.
//  - Collectives (AllReduce, Broadcast, Barrier, Split) are matched by call order: every
//    rank's k-th collective on a communicator meets the others' k-th.
//  - Abort(status) ends every pending and future operation, on every rank, of this
//    communicator and of every communicator split from the same world, with the first abort's
//    status. A timed-out Wait is DeadlineExceeded and does not abort by itself.
//  - Tensors passed to an operation stay referenced by it (storage is shared), so a rank that
//    gives up on a Wait never leaves a dangling buffer behind.
#ifndef PIPEWRIGHT_COMM_H_
#define PIPEWRIGHT_COMM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipewright/tensor.h"

namespace pipewright {

// A pp x dp grid of ranks. Global rank = replica * pp + pipeline rank, so the stages of one
// replica are consecutive ranks (pipeline neighbours land on the same node when a launcher
// fills nodes in rank order).
struct Topology {
  int pp = 1;  // pipeline ranks
  int dp = 1;  // data-parallel replicas

  constexpr int world_size() const { return pp * dp; }
  constexpr int GlobalRank(int pipeline_rank, int replica) const {
    return replica * pp + pipeline_rank;
  }
  constexpr int PipelineRank(int global_rank) const { return global_rank % pp; }
  constexpr int Replica(int global_rank) const { return global_rank / pp; }
  // Global rank of the next / previous pipeline rank of the same replica, or -1 at the ends.
  constexpr int Next(int global_rank) const {
    return PipelineRank(global_rank) + 1 < pp ? global_rank + 1 : -1;
  }
  constexpr int Prev(int global_rank) const {
    return PipelineRank(global_rank) > 0 ? global_rank - 1 : -1;
  }
  // Global ranks holding pipeline rank `pipeline_rank` in every replica, in replica order: the
  // data-parallel group that all-reduces that rank's stages' gradients.
  std::vector<int> DataParallelGroup(int pipeline_rank) const {
    std::vector<int> g;
    for (int r = 0; r < dp; ++r) g.push_back(GlobalRank(pipeline_rank, r));
    return g;
  }
};

// Handle of an asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completes (OK), fails or the communicator is aborted (that
  // error), or `timeout` passes (DeadlineExceeded naming the operation and the peer).
  virtual absl::Status Wait(absl::Duration timeout) = 0;
  // True once Wait would return without blocking.
  virtual bool Done() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // in this communicator
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "local", "mpi", "nccl"

  virtual std::unique_ptr<Work> Send(const Tensor& t, int peer, int64_t tag) = 0;
  virtual std::unique_ptr<Work> Recv(Tensor& t, int peer, int64_t tag) = 0;
  // In-place sum over the group (f32, f64 or i32).
  virtual std::unique_ptr<Work> AllReduce(Tensor& t) = 0;
  // Copies `root`'s tensor into every rank's `t` (same shape and dtype everywhere).
  virtual std::unique_ptr<Work> Broadcast(Tensor& t, int root) = 0;
  virtual std::unique_ptr<Work> Barrier() = 0;
  virtual void Abort(const absl::Status& status) = 0;
  // OK, or the status the world was aborted with.
  virtual absl::Status abort_status() const = 0;

  // Collective over this communicator: ranks passing the same `color` form a new communicator,
  // ranked by (key, rank). A negative color takes no part and gets nullptr.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                              absl::Duration timeout) = 0;
};

// The local backend: `size` communicators of one world, for `size` threads of this process.
// Element i is rank i's and must be used by one thread at a time.
std::vector<std::unique_ptr<Communicator>> CreateLocalWorld(int size);

}  // namespace pipewright

#endif  // PIPEWRIGHT_COMM_H_
