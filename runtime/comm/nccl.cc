// The NCCL backend (comm.h, docs/cuda.md): one communicator per GPU rank, for the rank threads of
// one process (CreateNcclWorld) or one rank per process (CreateNcclCommunicator).
//
// Streams and completion. Each communicator owns a non-blocking CUDA stream for its NCCL work,
// separate from the compute stream. An operation first makes that stream wait (on the GPU) for
// an event recorded on each tensor's allocator stream, so its inputs are ready without a host
// synchronisation and the all-reduce of one gradient bucket overlaps the backward compute that
// follows on the compute stream. After enqueueing (or after GroupEnd, for a group) it records a
// done event on the NCCL stream; Work::Wait polls that event (sleeping briefly between polls)
// until it is done, the timeout passes (DeadlineExceeded naming the operation and the peer), or
// the world is aborted. The operation keeps its tensors referenced until the GPU has finished
// with them, also when its Work is dropped early (the communicator's in-flight list), so a
// stream-ordered free on the compute stream never hands their memory out while NCCL uses it.
//
// Blocking calls. The communicators are NCCL's default, blocking kind. An enqueue call may still
// block the host (NCCL connects peers lazily, on their first operation, and that needs the peer
// to post its side; ncclCommSplit is a collective), so every NCCL call runs under a per-world
// watchdog: a call still blocked after the world's timeout (Split: its own timeout) aborts the
// world with DeadlineExceeded, which makes the blocked call return (NcclWorld, nccl_world.h).
// Wait itself never blocks in NCCL.
//
// Collectives are NCCL's: AllReduce is ncclAllReduce (ncclSum), ReduceScatter ncclReduceScatter
// (ncclSum: NCCL's summation order, not the rank order of the local and MPI backends), AllGather
// ncclAllGather of the bytes, Broadcast ncclBroadcast of the bytes, Barrier an all-reduce of one
// int. Only each rank's own arguments are checked; NCCL cannot tell ranks whose sizes disagree.
//
// Abort. The world state (shared by the communicators of a world and every communicator split
// from them) records the first abort status and calls ncclCommAbort on every communicator, also
// one whose owning thread is blocked inside an NCCL call (that is how NCCL unblocks it); after
// that the handle is never used again. Destroying a communicator also ends it with
// ncclCommAbort: it never waits for peers, and operations still in flight (a receive nobody sent
// to) are cancelled rather than waited for.
//
// Thread use: a communicator and its Works belong to one thread at a time (the rank's); Abort
// and abort_status may be called from any thread.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/cuda/cuda_check.cuh"
#include "pipewright/comm.h"
#include "pipewright/device.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"
#include "runtime/comm/comm_core.h"
#include "runtime/comm/nccl_check.h"
#include "runtime/comm/nccl_world.h"

namespace pipewright {
namespace {

using comm_internal::CollectiveDescription;
using comm_internal::CollectiveKind;
using cuda::DeviceGuard;
using nccl_internal::CheckDevices;
using nccl_internal::InitWithTimeout;
using nccl_internal::NcclHandle;
using nccl_internal::NcclWorld;

// CUDA tensors of the communicator's GPU, ordered after their allocator streams' work; no tags
// (one FIFO per peer pair), rendezvous sends that must be grouped, NCCL's own sum order.
constexpr CommCapabilities kNcclCapabilities{.tagged_p2p = false,
                                             .eager_send = false,
                                             .host_memory = false,
                                             .device_memory = true,
                                             .stream_ordered = true,
                                             .grouped_p2p = true,
                                             .rank_order_sum = false,
                                             .concurrent_p2p = false};

// One operation, shared by its Work and the communicator's in-flight list (one thread).
struct NcclOp {
  std::string what;             // "rank 1: Recv from rank 0 (tag 3)"
  std::vector<Tensor> tensors;  // referenced until the GPU has finished with them
  CudaEvent done;               // recorded on the NCCL stream after the launch
  absl::Status status;          // the enqueue (or its group) failed
  bool finished = false;        // the GPU is done with the tensors (or never got them)
  bool complete = false;        // finished successfully, before any abort

  // True once finished. A done event counts as success only if neither the world was aborted
  // nor the communicator destroyed when it was seen: an abort makes NCCL's kernels exit early
  // (and sets those flags before it does), so their completion proves nothing.
  bool Poll(NcclWorld& world, NcclHandle& handle) {
    if (finished) return true;
    if (!done.valid()) {  // never launched, or in a group that has not ended
      finished = !status.ok();
      if (finished) tensors.clear();
      return finished;
    }
    absl::StatusOr<bool> q = done.Query();
    if (!q.ok()) {
      if (status.ok()) {
        status = comm_internal::Annotate(q.status(), what);
      }
      finished = true;  // the context is broken; nothing runs on it any more
    } else if (*q) {
      finished = true;
      complete = status.ok() && !world.aborted() && !handle.is_gone();
    }
    if (finished) tensors.clear();
    return finished;
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclWorld> world, std::shared_ptr<NcclHandle> handle,
           std::shared_ptr<NcclOp> op)
      : world_(std::move(world)), handle_(std::move(handle)), op_(std::move(op)) {}

  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    absl::Duration nap = absl::Microseconds(5);
    for (int polls = 0;; ++polls) {
      if (absl::Status s = Settled(); !s.ok() || op_->complete) return s;
      if (!op_->done.valid()) {
        return absl::FailedPreconditionError(
            absl::StrCat(op_->what, ": Wait inside an open group (call GroupEnd first)"));
      }
      if (op_->Poll(*world_, *handle_)) {
        if (absl::Status s = Settled(); !s.ok() || op_->complete) return s;
        return absl::InternalError(absl::StrCat(op_->what, ": finished without a result"));
      }
      if (polls % 64 == 63) PW_RETURN_IF_ERROR(CheckAsyncError());
      if (absl::Now() >= deadline) {
        return comm_internal::TimedOut(op_->what, timeout, " (the GPU has not finished it)");
      }
      absl::SleepFor(std::min(nap, deadline - absl::Now()));
      nap = std::min(nap * 2, absl::Milliseconds(1));
    }
  }

  bool Done() override {
    if (op_->complete || !Settled().ok()) return true;
    if (!op_->done.valid()) return false;  // in a group that has not ended
    return op_->Poll(*world_, *handle_);
  }

 private:
  // OK with op_->complete when it succeeded; the error when it failed, the world was aborted
  // or the communicator destroyed first; OK without complete while it is still running.
  absl::Status Settled() const {
    if (op_->complete) return absl::OkStatus();
    if (!op_->status.ok()) return op_->status;
    if (world_->aborted()) return world_->abort_status();
    if (handle_->is_gone()) {
      return absl::CancelledError(absl::StrCat(
          op_->what, ": the communicator was destroyed before the operation finished"));
    }
    return absl::OkStatus();
  }

  // An asynchronous NCCL error (a peer failed, the network broke) aborts the world with it.
  absl::Status CheckAsyncError() {
    std::unique_lock<std::timed_mutex> call(handle_->call_mu, std::try_to_lock);
    if (!call.owns_lock() || handle_->is_gone()) return absl::OkStatus();
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(handle_->comm, &async);
    if (r == ncclSuccess) r = async;
    if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
    absl::Status s = nccl::ToStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__, handle_->comm);
    s = comm_internal::Annotate(s, op_->what);
    call.unlock();
    world_->Abort(s);
    return world_->abort_status();
  }

  std::shared_ptr<NcclWorld> world_;
  std::shared_ptr<NcclHandle> handle_;
  std::shared_ptr<NcclOp> op_;
};

// The NCCL type of a reduction's dtype; InvalidArgument naming `kind` for the others.
absl::StatusOr<ncclDataType_t> ReduceType(DType d, CollectiveKind kind) {
  switch (d) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kI32:
      return ncclInt32;
    default:
      return comm_internal::CheckReduceDType(d, kind);
  }
}

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (aborted on failure too).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(std::shared_ptr<NcclWorld> world,
                                                                  ncclComm_t comm, int device,
                                                                  int rank, int size,
                                                                  std::string label) {
    auto handle = std::make_shared<NcclHandle>();
    handle->comm = comm;
    handle->device = device;
    world->Register(handle);
    std::unique_ptr<NcclCommunicator> c(
        new NcclCommunicator(world, handle, device, rank, size, std::move(label)));
    absl::StatusOr<CudaStream> stream = CudaStream::Create(Device::Cuda(device));
    if (!stream.ok()) return stream.status();  // ~NcclCommunicator aborts the comm
    c->stream_ = *std::move(stream);
    DeviceGuard guard(device);
    void* scratch = nullptr;
    PW_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch, sizeof(int32_t)));
    c->scratch_ = scratch;
    PW_CUDA_RETURN_IF_ERROR(cudaMemset(scratch, 0, sizeof(int32_t)));
    return c;
  }

  ~NcclCommunicator() override {
    Reap();  // what finished before counts as finished
    // Ends the communicator locally, never waiting for peers; cancels what is still in flight.
    handle_->AbortOnce();
    // Aborted kernels exit; wait (bounded) before the in-flight tensors and the scratch word
    // may be freed. Whatever is still running after that is leaked rather than freed under it.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!inflight_.empty() && absl::Now() < deadline) {
      Reap();
      if (!inflight_.empty()) absl::SleepFor(absl::Milliseconds(1));
    }
    if (!inflight_.empty()) {
      new std::vector<std::shared_ptr<NcclOp>>(std::move(inflight_));  // leaked on purpose
      return;
    }
    if (scratch_ != nullptr) {
      DeviceGuard guard(device_);
      if (cudaFree(scratch_) != cudaSuccess) (void)cudaGetLastError();
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  CommBackend kind() const override { return CommBackend::kNccl; }
  CommCapabilities capabilities() const override { return kNcclCapabilities; }

  std::unique_ptr<Work> Send(const Tensor& t, int peer, int64_t tag) override {
    const std::string what = comm_internal::SendDescription(peer, tag);
    if (absl::Status s = comm_internal::CheckPeerAndTag(peer, tag, size_); !s.ok()) {
      return Failed(what, s);
    }
    void* buf = const_cast<void*>(t.raw());
    const size_t bytes = t.nbytes();
    return Enqueue(what, {t}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclSend(buf, bytes, ncclUint8, peer, comm, s);
    });
  }

  std::unique_ptr<Work> Recv(Tensor& t, int peer, int64_t tag) override {
    const std::string what = comm_internal::RecvDescription(peer, tag);
    if (absl::Status s = comm_internal::CheckPeerAndTag(peer, tag, size_); !s.ok()) {
      return Failed(what, s);
    }
    void* buf = t.raw();
    const size_t bytes = t.nbytes();
    return Enqueue(what, {t}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclRecv(buf, bytes, ncclUint8, peer, comm, s);
    });
  }

  std::unique_ptr<Work> AllReduce(Tensor& t) override {
    const std::string what = CollectiveDescription(CollectiveKind::kAllReduce, next_seq_++);
    absl::StatusOr<ncclDataType_t> type = ReduceType(t.dtype(), CollectiveKind::kAllReduce);
    if (!type.ok()) return Failed(what, type.status());
    void* buf = t.raw();
    const size_t count = static_cast<size_t>(t.numel());
    const ncclDataType_t nccl_type = *type;
    return Enqueue(what, {t}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(buf, buf, count, nccl_type, ncclSum, comm, s);
    });
  }

  // Rank r's `in` into [r * in.nbytes(), (r + 1) * in.nbytes()) of every `out`, as bytes (any
  // dtype). Only this rank's layout can be checked; ranks that disagree are undefined (comm.h).
  std::unique_ptr<Work> AllGather(const Tensor& in, Tensor& out) override {
    const std::string what = CollectiveDescription(CollectiveKind::kAllGather, next_seq_++);
    if (in.defined() && out.defined()) {
      if (absl::Status s = comm_internal::CheckGatherLayout(in, out, size_); !s.ok()) {
        return Failed(what, s);
      }
    }
    const void* send = in.raw();
    void* recv = out.raw();
    const size_t bytes = in.nbytes();
    return Enqueue(what, {in, out}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclAllGather(send, recv, bytes, ncclUint8, comm, s);
    });
  }

  // NCCL's sum of every rank's `in`; rank r's `out` gets chunk r (out.numel() elements). Only
  // this rank's dtype and layout can be checked; ranks that disagree are undefined (comm.h).
  std::unique_ptr<Work> ReduceScatter(const Tensor& in, Tensor& out) override {
    const std::string what = CollectiveDescription(CollectiveKind::kReduceScatter, next_seq_++);
    absl::StatusOr<ncclDataType_t> type = ReduceType(in.dtype(), CollectiveKind::kReduceScatter);
    if (!type.ok()) return Failed(what, type.status());
    if (in.defined() && out.defined()) {
      if (absl::Status s = comm_internal::CheckScatterLayout(in, out, size_); !s.ok()) {
        return Failed(what, s);
      }
    }
    const void* send = in.raw();
    void* recv = out.raw();
    const size_t count = static_cast<size_t>(out.numel());
    const ncclDataType_t nccl_type = *type;
    return Enqueue(what, {in, out}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclReduceScatter(send, recv, count, nccl_type, ncclSum, comm, s);
    });
  }

  std::unique_ptr<Work> Broadcast(Tensor& t, int root) override {
    const std::string what =
        absl::StrCat("Broadcast from rank ", root, " (collective #", next_seq_++, ")");
    if (absl::Status s = comm_internal::CheckRoot(root, size_); !s.ok()) return Failed(what, s);
    void* buf = t.raw();
    const size_t bytes = t.nbytes();
    return Enqueue(what, {t}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm, s);
    });
  }

  std::unique_ptr<Work> Barrier() override {
    const std::string what = CollectiveDescription(CollectiveKind::kBarrier, next_seq_++);
    void* buf = scratch_;
    return Enqueue(what, {}, [=](ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(buf, buf, 1, ncclInt32, ncclSum, comm, s);
    });
  }

  void GroupStart() override {
    ++group_depth_;
    if (handle_->is_gone()) return;
    if (Call(absl::StrCat(label_, ": ncclGroupStart"), world_->timeout(), [](ncclComm_t) {
          return ncclGroupStart();
        }).ok()) {
      ++nccl_group_depth_;
    }
  }

  absl::Status GroupEnd() override {
    if (group_depth_ == 0) {
      return absl::FailedPreconditionError(absl::StrCat(label_, ": GroupEnd without GroupStart"));
    }
    --group_depth_;
    absl::Status status;
    if (nccl_group_depth_ > group_depth_) {
      --nccl_group_depth_;
      if (!handle_->is_gone() || !group_enqueued_) {
        // An abort after operations were queued leaves them to a freed communicator: then the
        // group is not ended (this thread must not use NCCL again; docs/cuda.md).
        status = Call(
            absl::StrCat(label_, ": grouped operations (ncclGroupEnd)"), world_->timeout(),
            [](ncclComm_t) { return ncclGroupEnd(); },
            /*allow_gone=*/true);
      } else {
        status = world_->abort_status();
      }
    } else if (world_->aborted()) {
      status = world_->abort_status();
    }
    if (group_depth_ > 0) return status;
    // The outermost group ended: its operations were launched together, behind one event.
    std::vector<std::shared_ptr<NcclOp>> ops = std::move(group_ops_);
    group_ops_.clear();
    group_enqueued_ = false;
    if (status.ok() && !ops.empty()) status = RecordDone(ops);
    for (const std::shared_ptr<NcclOp>& op : ops) {
      if (!status.ok() && op->status.ok()) op->status = status;
    }
    if (!status.ok()) {
      return comm_internal::Annotate(status, label_);
    }
    return absl::OkStatus();
  }

  void Abort(const absl::Status& status) override { world_->Abort(status); }
  absl::Status abort_status() const override { return world_->abort_status(); }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      absl::Duration timeout) override {
    PW_RETURN_IF_ERROR(world_->abort_status());
    if (group_depth_ > 0) {
      return absl::FailedPreconditionError(absl::StrCat(label_, ": Split inside a group"));
    }
    ncclComm_t child = nullptr;
    const std::string what = absl::StrCat(label_, ": Split (color ", color, ", key ", key, ")");
    PW_RETURN_IF_ERROR(Call(what, timeout, [&](ncclComm_t comm) {
      return ncclCommSplit(comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr);
    }));
    if (child == nullptr) return std::unique_ptr<Communicator>();
    int rank = 0, size = 0;
    absl::Status s = nccl::ToStatus(ncclCommUserRank(child, &rank), "ncclCommUserRank", __FILE__,
                                    __LINE__, child);
    if (s.ok()) {
      s = nccl::ToStatus(ncclCommCount(child, &size), "ncclCommCount", __FILE__, __LINE__, child);
    }
    if (!s.ok()) {
      DeviceGuard guard(device_);
      (void)ncclCommAbort(child);
      return s;
    }
    PW_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> c,
                        Create(world_, child, device_, rank, size,
                               absl::StrCat("rank ", rank, " (world rank ", world_rank_, ")")));
    c->world_rank_ = world_rank_;
    return std::unique_ptr<Communicator>(std::move(c));
  }

 private:
  NcclCommunicator(std::shared_ptr<NcclWorld> world, std::shared_ptr<NcclHandle> handle, int device,
                   int rank, int size, std::string label)
      : world_(std::move(world)),
        handle_(std::move(handle)),
        device_(device),
        rank_(rank),
        size_(size),
        world_rank_(rank),
        label_(std::move(label)) {}

  std::unique_ptr<Work> Failed(const std::string& what, const absl::Status& s) {
    auto op = std::make_shared<NcclOp>();
    op->what = absl::StrCat(label_, ": ", what);
    op->status = comm_internal::Annotate(s, op->what);
    return std::make_unique<NcclWork>(world_, handle_, std::move(op));
  }

  // Runs one NCCL call on the communicator under the watchdog; OK if `allow_gone` and the
  // communicator was aborted meanwhile is not an excuse to skip it (ncclGroupEnd of an empty
  // group).
  template <typename F>
  absl::Status Call(const std::string& what, absl::Duration limit, F&& fn,
                    bool allow_gone = false) {
    std::unique_lock<std::timed_mutex> call(handle_->call_mu);
    if (!allow_gone && handle_->is_gone()) {
      absl::Status s = world_->abort_status();
      return s.ok() ? absl::FailedPreconditionError("the NCCL communicator was destroyed") : s;
    }
    DeviceGuard guard(device_);
    const int64_t id = world_->BeginCall(what, limit);
    const ncclResult_t r = fn(handle_->comm);
    world_->EndCall(id);
    if (r == ncclSuccess) return absl::OkStatus();
    // A call that failed because the world was aborted reports the abort.
    if (world_->aborted()) return world_->abort_status();
    return nccl::ToStatus(r, what.c_str(), __FILE__, __LINE__,
                          handle_->is_gone() ? nullptr : handle_->comm);
  }

  // Records one done event on the NCCL stream for `ops` and puts them in flight.
  absl::Status RecordDone(const std::vector<std::shared_ptr<NcclOp>>& ops) {
    PW_ASSIGN_OR_RETURN(CudaEvent first, CudaEvent::Create(Device::Cuda(device_), false));
    PW_RETURN_IF_ERROR(first.Record(stream_.get()));
    // Every op needs its own handle to the same point of the stream: record one event each.
    for (size_t i = 0; i < ops.size(); ++i) {
      if (i == 0) {
        ops[0]->done = std::move(first);
      } else {
        PW_ASSIGN_OR_RETURN(ops[i]->done, CudaEvent::Create(Device::Cuda(device_), false));
        PW_RETURN_IF_ERROR(ops[i]->done.Record(stream_.get()));
      }
      inflight_.push_back(ops[i]);
    }
    return absl::OkStatus();
  }

  // Drops the in-flight operations the GPU has finished.
  void Reap() {
    inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(),
                                   [this](const std::shared_ptr<NcclOp>& op) {
                                     return op->Poll(*world_, *handle_);
                                   }),
                    inflight_.end());
  }

  // Validates the tensors, orders the NCCL stream after their producers, launches, and (outside
  // a group) records the done event.
  template <typename F>
  std::unique_ptr<Work> Enqueue(const std::string& what, std::vector<Tensor> tensors, F&& launch) {
    auto op = std::make_shared<NcclOp>();
    op->what = absl::StrCat(label_, ": ", what);
    auto work = [&] { return std::make_unique<NcclWork>(world_, handle_, op); };
    Reap();
    if (absl::Status s = world_->abort_status(); !s.ok()) {
      op->status = s;
      return work();
    }
    absl::Status s = PrepareInputs(tensors);
    if (s.ok()) {
      s = Call(op->what, world_->timeout(), [&](ncclComm_t comm) {
        return launch(comm, static_cast<cudaStream_t>(stream_.get().handle));
      });
    }
    if (!s.ok()) {
      op->status = comm_internal::Annotate(s, op->what);
      return work();
    }
    op->tensors = std::move(tensors);
    if (group_depth_ > 0) {
      group_enqueued_ = true;
      group_ops_.push_back(op);
    } else if (absl::Status r = RecordDone({op}); !r.ok()) {
      op->status = comm_internal::Annotate(r, op->what);
    }
    return work();
  }

  // Checks that every tensor is a CUDA tensor of this GPU and makes the NCCL stream wait for
  // the work queued on each tensor's allocator stream.
  absl::Status PrepareInputs(const std::vector<Tensor>& tensors) {
    std::vector<Stream> waited;
    for (const Tensor& t : tensors) {
      if (!t.defined()) return absl::InvalidArgumentError("undefined tensor");
      if (t.device() != Device::Cuda(device_)) {
        return absl::InvalidArgumentError(
            absl::StrCat("the NCCL backend needs tensors on cuda:", device_, ", got ",
                         t.ShapeString(), " on ", t.device().ToString()));
      }
      const Stream producer = t.stream();
      if (producer.is_cpu() || producer == stream_.get()) continue;
      if (std::find(waited.begin(), waited.end(), producer) != waited.end()) continue;
      waited.push_back(producer);
      PW_ASSIGN_OR_RETURN(CudaEvent ready, CudaEvent::Create(Device::Cuda(device_), false));
      PW_RETURN_IF_ERROR(ready.Record(producer));
      PW_RETURN_IF_ERROR(ready.MakeStreamWait(stream_.get()));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<NcclWorld> world_;
  std::shared_ptr<NcclHandle> handle_;
  const int device_;
  const int rank_, size_;
  int world_rank_;
  const std::string label_;
  CudaStream stream_;
  void* scratch_ = nullptr;  // one int32 on the device, for Barrier
  int64_t next_seq_ = 0;
  int group_depth_ = 0;       // GroupStart calls not yet ended
  int nccl_group_depth_ = 0;  // of which reached ncclGroupStart
  bool group_enqueued_ = false;
  std::vector<std::shared_ptr<NcclOp>> group_ops_;
  std::vector<std::shared_ptr<NcclOp>> inflight_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclWorld(
    const std::vector<int>& cuda_devices, absl::Duration timeout) {
  if (cuda_devices.empty()) return absl::InvalidArgumentError("CreateNcclWorld: no devices");
  PW_RETURN_IF_ERROR(CheckDevices(cuda_devices, "CreateNcclWorld"));
  const int n = static_cast<int>(cuda_devices.size());
  std::vector<ncclComm_t> comms(n, nullptr);
  PW_RETURN_IF_ERROR(InitWithTimeout(
      absl::StrCat("ncclCommInitAll over cuda:[", absl::StrJoin(cuda_devices, ", "), "]"), timeout,
      [devices = cuda_devices](std::vector<ncclComm_t>& out) {
        return ncclCommInitAll(out.data(), static_cast<int>(devices.size()), devices.data());
      },
      comms));
  auto world = std::make_shared<NcclWorld>(timeout);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> c =
        NcclCommunicator::Create(world, comms[r], cuda_devices[r], r, n, absl::StrCat("rank ", r));
    comms[r] = nullptr;  // owned by the communicator now, even when its creation failed
    if (!c.ok()) {
      for (ncclComm_t rest : comms) {
        if (rest != nullptr) (void)ncclCommAbort(rest);
      }
      return c.status();  // the communicators made so far abort theirs as they go
    }
    out.push_back(*std::move(c));
  }
  return out;
}

absl::StatusOr<std::string> NcclUniqueId() {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  PW_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const std::string& unique_id,
                                                                     int rank, int size,
                                                                     int cuda_device,
                                                                     absl::Duration timeout) {
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError(absl::StrCat("CreateNcclCommunicator: the unique id has ",
                                                   unique_id.size(), " bytes, expected ",
                                                   sizeof(ncclUniqueId)));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateNcclCommunicator: rank ", rank, " of size ", size));
  }
  PW_RETURN_IF_ERROR(CheckDevices({cuda_device}, "CreateNcclCommunicator"));
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  std::vector<ncclComm_t> comms(1, nullptr);
  PW_RETURN_IF_ERROR(InitWithTimeout(
      absl::StrCat("ncclCommInitRank (rank ", rank, " of ", size, ", cuda:", cuda_device, ")"),
      timeout,
      [id, rank, size, cuda_device](std::vector<ncclComm_t>& out) {
        if (cudaSetDevice(cuda_device) != cudaSuccess) return ncclUnhandledCudaError;
        return ncclCommInitRank(&out[0], size, id, rank);
      },
      comms));
  auto world = std::make_shared<NcclWorld>(timeout);
  PW_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> c,
                      NcclCommunicator::Create(world, comms[0], cuda_device, rank, size,
                                               absl::StrCat("rank ", rank)));
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace pipewright
