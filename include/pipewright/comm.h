// Communication between ranks: the Topology of a pp x dp run and the Communicator interface that
// every backend implements (local: threads of one process; mpi: processes; nccl: GPUs). The engine
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
//    so every rank gets bit-identical results and reruns are bit-stable. ReduceScatter sums the
//    same way and gives rank r the r-th chunk of that sum, bit-identical to the same elements of
//    AllReduce's result for the same inputs.
//  - Collectives (AllReduce, ReduceScatter, AllGather, Broadcast, Barrier, Split) are matched by
//    call order: every rank's k-th collective on a communicator meets the others' k-th.
//  - Abort(status) ends every pending and future operation, on every rank, of this
//    communicator and of every communicator split from the same world, with the first abort's
//    status. A timed-out Wait is DeadlineExceeded and does not abort by itself.
//  - Tensors passed to an operation stay referenced by it (storage is shared), so a rank that
//    gives up on a Wait never leaves a dangling buffer behind.
//
// Device tensors (docs/cuda.md). The local backend accepts CUDA tensors too (a pipeline of
// several stages on one GPU): messages are copied device to device, ordered by events on the
// tensors' allocator streams, and AllReduce/ReduceScatter/AllGather/Broadcast stage through host
// memory with the same rank-order sum as on the host. A completed operation's result is ready for
// work queued on the destination tensor's allocator stream after Wait; a host reader synchronises
// that stream.
//
// The NCCL backend (CreateNcclWorld, CreateNcclCommunicator) differs from the rules above:
//  - Tensors are CUDA tensors on the communicator's GPU. Each operation first waits (on the GPU)
//    for the work queued on the tensor's allocator stream, runs on the communicator's own
//    stream, and completes when the GPU has finished it; Wait polls for that.
//  - Send is not eager: it completes once the receiver has taken the data, and the sender must
//    not overwrite the tensor before its Wait returns (dropping it is safe).
//  - No tags: between two ranks, receives match sends in posting order (one FIFO per peer
//    pair), which the engine's per-peer program order makes agree with the tags. A receive
//    whose size differs from the matching send cannot be detected; it is undefined.
//  - AllReduce and ReduceScatter are NCCL's sum: identical on every rank and run to run for a
//    fixed NCCL_ALGO/NCCL_PROTO and topology, but not the local backend's rank-order sum (and a
//    ReduceScatter's chunk need not match the same elements of an AllReduce bit for bit).
//  - Collectives' arguments are not compared across ranks: an AllReduce, ReduceScatter or
//    AllGather whose size differs between ranks, or a Broadcast with another root, is undefined.
//  - Abort calls ncclCommAbort on every communicator of the world (and its splits); pending
//    and future operations fail with the abort status.
// Code that must work on every backend asks capabilities() rather than the backend's name.
#ifndef PIPEWRIGHT_COMM_H_
#define PIPEWRIGHT_COMM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pipewright/tensor.h"

namespace pipewright {

// A pp x dp grid of ranks. Global rank = replica * pp + pipeline rank, so the stages of one
// replica are consecutive ranks (pipeline neighbours land on the same node when a launcher
// fills nodes in rank order).
struct Topology {
  int pp = 1;  // pipeline ranks
  int dp = 1;  // data-parallel replicas
  // Tensor-parallel ranks: reserved for tensor parallelism (issue 37); 1 today. The fastest
  // varying (Megatron's order), so that a tensor-parallel group stays on one node.
  int tp = 1;

  constexpr int world_size() const { return pp * dp * tp; }
  constexpr int GlobalRank(int pipeline_rank, int replica, int tensor_rank = 0) const {
    return (replica * pp + pipeline_rank) * tp + tensor_rank;
  }
  constexpr int PipelineRank(int global_rank) const { return global_rank / tp % pp; }
  constexpr int Replica(int global_rank) const { return global_rank / tp / pp; }
  constexpr int TensorRank(int global_rank) const { return global_rank % tp; }
  // Global ranks holding pipeline rank `pipeline_rank` (and tensor rank `tensor_rank`) in every
  // replica, in replica order: the data-parallel group that reduces that rank's stages'
  // gradients.
  std::vector<int> DataParallelGroup(int pipeline_rank, int tensor_rank = 0) const {
    std::vector<int> g;
    for (int r = 0; r < dp; ++r) g.push_back(GlobalRank(pipeline_rank, r, tensor_rank));
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

// The communicator backends.
enum class CommBackend { kLocal, kMpi, kNccl };

// "local", "mpi", "nccl".
const char* CommBackendName(CommBackend b);
// A launcher's world relays a failing process's error to every other process, each of which
// then fails with it ("rank 1 aborted: ..."). Such a relayed status carries this payload, so a
// program that reports errors can print it once (the CLI: on the root process only) instead of
// once per process.
inline constexpr char kRelayedAbortPayload[] = "type.pipewright.dev/relayed-abort";
void MarkRelayedAbort(absl::Status* status);
bool IsRelayedAbort(const absl::Status& status);
// The inverse of CommBackendName; InvalidArgument naming the allowed values for anything else.
absl::StatusOr<CommBackend> ParseCommBackend(absl::string_view name);

// What a backend does where backends differ (see the rules at the top of this file). Constant for
// the lifetime of a communicator and the same for every communicator of one world. The defaults
// describe the reference semantics (the local backend on host tensors).
struct CommCapabilities {
  // Recv matches (peer, tag) whatever the arrival order; false = one FIFO per peer pair, tags
  // ignored (NCCL): receives must be posted in the peer's send order.
  bool tagged_p2p = true;
  // Send completes without waiting for the receiver (the backend copies the tensor); false = a
  // Send's Wait returns only once the receiver has posted the matching Recv, and the sender must
  // not overwrite the tensor before then.
  bool eager_send = true;
  bool host_memory = true;     // accepts CPU tensors
  bool device_memory = false;  // accepts CUDA tensors
  // Operations on a CUDA tensor wait for the work queued on its allocator stream before reading
  // it, so the caller need not synchronise before posting. False = the backend may read the
  // buffer on another thread as soon as the operation is posted, so device work producing it
  // must be complete (irrelevant without device_memory).
  bool stream_ordered = false;
  // Sends and receives that pair up between two ranks must be posted inside one
  // GroupStart/GroupEnd (or in an order that never waits on the peer), else both sides block.
  bool grouped_p2p = false;
  // AllReduce and ReduceScatter sum in group-rank order, ((x0 + x1) + x2) + ..., bit-identical to
  // the local backend for the same inputs (and a ReduceScatter's output on rank r to elements
  // [r * out.numel(), (r + 1) * out.numel()) of AllReduce's result); false = the library's own
  // (deterministic per topology) order.
  bool rank_order_sum = true;
  // Two threads may post point-to-point operations (Send, Recv, and Wait/Done on them) on one
  // communicator at the same time; collectives stay one thread at a time. Asynchronous data
  // parallelism needs it (an owner's service thread beside the rank's own).
  bool concurrent_p2p = true;
};

// A process group. Methods that post an operation return a Work whose Wait observes the result;
// errors of an operation (bad arguments, a disagreement with the peers, an abort) are the status
// of its Work. A communicator is used by one thread at a time (but see
// CommCapabilities::concurrent_p2p).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // in this communicator
  virtual int size() const = 0;
  virtual CommBackend kind() const = 0;
  virtual CommCapabilities capabilities() const = 0;

  // Sends `t` to `peer` with `tag` (>= 0). Eager (copies `t`) where capabilities().eager_send.
  virtual std::unique_ptr<Work> Send(const Tensor& t, int peer, int64_t tag) = 0;
  // Receives the message of (`peer`, `tag`) into the preallocated `t` (same size and dtype as
  // the message).
  virtual std::unique_ptr<Work> Recv(Tensor& t, int peer, int64_t tag) = 0;
  // In-place sum over the group (f32, f64 or i32; InvalidArgument for other dtypes). Every rank
  // passes the same dtype and element count.
  virtual std::unique_ptr<Work> AllReduce(Tensor& t) = 0;
  // Concatenates every rank's `in` into `out` in group-rank order: rank r's elements land at
  // [r * in.numel(), (r + 1) * in.numel()) of every rank's `out`. Any dtype (f32, f64, i32,
  // bf16, f16). `out` is preallocated by the caller with in's dtype and size() * in.numel()
  // elements (shapes are free, only element counts matter); otherwise the operation fails with
  // InvalidArgument naming AllGather. Every rank passes the same dtype and element count for
  // `in`; a rank whose arguments are invalid, or disagree with rank 0's, fails the collective on
  // every rank (it still counts, so later collectives stay matched). On NCCL only the rank with
  // invalid arguments fails (the others wait for their timeout or an abort) and ranks that
  // disagree are undefined. `in` must not change and `out` must not be read until the Work
  // completes; `in` may be `out` itself only when size() == 1.
  virtual std::unique_ptr<Work> AllGather(const Tensor& in, Tensor& out) = 0;
  // Sums every rank's `in` element-wise over the group and leaves the r-th chunk of the sum in
  // rank r's `out`: with n = out.numel(), rank r receives elements [r * n, (r + 1) * n) of what
  // AllReduce of the same inputs gives, bit for bit where capabilities().rank_order_sum
  // (((x0 + x1) + x2) + ... in group-rank order). f32, f64 or i32, like AllReduce. `in` is
  // preallocated by the caller with out's dtype and size() * out.numel() elements (shapes are
  // free, only element counts matter); otherwise, or for another dtype, the operation fails with
  // InvalidArgument naming ReduceScatter. Every rank passes the same dtype and element count for
  // `in`; invalid or disagreeing arguments fail the collective as for AllGather: on every rank
  // (it still counts, so later collectives stay matched), except on NCCL, where only the rank
  // with invalid arguments fails and ranks that disagree are undefined. `in` must not change and
  // `out` must not be read until the Work completes. In place: `out` may be a view (Tensor::View)
  // of this rank's own chunk of `in` (elements [rank * n, (rank + 1) * n)), as NCCL allows; it
  // may overlap no other part of `in`.
  virtual std::unique_ptr<Work> ReduceScatter(const Tensor& in, Tensor& out) = 0;
  // Copies `root`'s tensor into every rank's `t` (same shape and dtype everywhere).
  virtual std::unique_ptr<Work> Broadcast(Tensor& t, int root) = 0;
  virtual std::unique_ptr<Work> Barrier() = 0;

  // Groups the point-to-point operations posted between GroupStart and GroupEnd (nestable) so a
  // backend issues them together (NCCL: ncclGroupStart/ncclGroupEnd, one launch, so two ranks
  // that send to each other cannot deadlock). Do not Wait for an operation of an open group.
  // No-ops where !capabilities().grouped_p2p (local, mpi: their operations never block when
  // posted).
  virtual void GroupStart() {}
  // Ends the group; an error here is also the status of the group's operations.
  virtual absl::Status GroupEnd() { return absl::OkStatus(); }

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

// The NCCL backend, for the rank threads of one process: rank i on CUDA device cuda_devices[i]
// (distinct devices; ncclCommInitAll). `timeout` bounds the creation and every NCCL call that
// may block the host (a call still blocked after it aborts the world with DeadlineExceeded).
// FailedPrecondition "pipewright was built without NCCL" in builds without NCCL.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclWorld(
    const std::vector<int>& cuda_devices, absl::Duration timeout);
// Multi-process NCCL: one process makes the id (NCCL_UNIQUE_ID_BYTES = 128 bytes, returned as
// a byte string), every process receives it out of band and creates its rank.
absl::StatusOr<std::string> NcclUniqueId();
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const std::string& unique_id,
                                                                     int rank, int size,
                                                                     int cuda_device,
                                                                     absl::Duration timeout);

}  // namespace pipewright

#endif  // PIPEWRIGHT_COMM_H_
