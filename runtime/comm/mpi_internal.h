// The MPI backend's internals, shared by its files (runtime-internal; the public entry points are
// in runtime/comm/mpi.h, the protocol is documented in docs/mpi_backend.md):
//   mpi_process.cc       MPI initialisation and finalisation, launcher detection, ToStatus, the
//                        progress engine and thread, closing groups and worlds;
//   mpi_transport.cc     packets and message buffers, point-to-point messages, abort notices;
//   mpi_collectives.cc   the collective protocol (AllReduce, ReduceScatter, AllGather, Broadcast,
//                        Barrier, Split);
//   mpi_communicator.cc  MpiCommunicator, its Work and CreateMpiWorld.
// This header includes <mpi.h>: only those files include it.
//
// Every MPI call of the backend, and all of its state, is guarded by one process-wide mutex, so
// the backend needs no more than MPI_THREAD_SERIALIZED. Nothing blocks inside MPI except
// CreateMpiWorld's MPI_Comm_dup and InitMpi: every operation is a state machine driven by
// non-blocking calls (MPI_Improbe/MPI_Imrecv/MPI_Isend/MPI_Test/MPI_Comm_idup), advanced by
// whoever holds the mutex in Progress: Work::Wait and Work::Done, and a progress thread that
// keeps MPI moving (large sends, abort notices) while the application computes. Wait spins
// (yielding the core) while MPI requests are in flight, as MPI_Wait would, sleeps with a growing
// backoff (up to 1 ms) while it waits for a message that has not come, and returns by its
// deadline, whatever the peers do.
//
// MPI communicators: a world owns a duplicate of MPI_COMM_WORLD for abort notices (`control`);
// each group (the world or a Split result) owns two more, one for point-to-point messages and one
// for the messages of collectives. A Split group's communicators are MPI_Comm_idup copies of its
// parent's (all parent ranks take part), used with a group rank -> MPI rank table: the groups of
// one Split are disjoint, so they can share the copies without their messages meeting.
//
// Messages: a header (PacketHeader: kind, user tag or collective number, dtype, numel, shape
// text, error) followed by the payload, in a buffer owned by the backend (Send copies the tensor,
// so it completes without the receiver and the caller may reuse its tensor at once; the buffer
// lives until MPI_Isend completes, or is leaked on purpose when it never does).
//
// P2P tags: a tag in [0, max_direct_tag] (MPI_TAG_UB - 1 by default) is the MPI tag, and the
// message travels as two MPI messages of that tag, the header and then the payload (both from the
// one owned buffer). MPI matches them (source, tag); only the oldest pending receive of a
// (source, tag) probes (MPI_Improbe), and it keeps that place until its payload is matched, so
// same-(peer, tag) messages are received in send order and a header is never taken for a
// payload. A payload of the announced layout is received straight into the tensor (contiguous,
// so transports copy it once); any other one into a scratch buffer, and the receive fails with
// the mismatch, the tensor untouched. Larger tags all use the MPI tag max_direct_tag + 1 with
// header and payload in one message: while a receive for such a tag is pending from a peer,
// every message of that MPI tag from that peer is received into a buffer in order and matched
// by the header's 64-bit tag (like the local backend's mailboxes). Either way matching is exact.
//
// Collectives (k-th call on a group = collective #k, MPI tag 2*(k mod P) + phase on the
// collective communicator): phase 1, every rank sends every other rank its header (kind,
// layout, root, color/key, or its own argument error) plus the data that rank needs; each rank
// then checks all N headers with the same deterministic rules, so all ranks reach the same
// verdict without another round. Barrier and Split end there; Broadcast's root sends its tensor
// in phase 1, and AllGather's every rank its input, which every rank places at the sender's
// offset of its output; AllReduce sends rank r the r-th chunk of its tensor, rank r sums its
// chunk over all ranks in group-rank order (comm_core.h, Note [rank-order sum]: the same float
// operations as the local backend, so the bits are the same) and phase 2 sends every rank the
// summed chunks. ReduceScatter is AllReduce's phase 1 with the caller's chunks (rank r's is
// [r * n, (r + 1) * n) of `in`, n = out.numel()), summed straight into `out`: no phase 2.
//
// Abort: the first Abort (or MPI error) seen by a process marks its world aborted and sends an
#ifndef PIPEWRIGHT_RUNTIME_COMM_MPI_INTERNAL_H_
#define PIPEWRIGHT_RUNTIME_COMM_MPI_INTERNAL_H_

// The C API only (Open MPI and MPICH would otherwise pull in their C++ bindings).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"
#include "runtime/comm/comm_core.h"
#include "runtime/comm/mpi.h"

#define PW_MPI_STATUS(expr) ::pipewright::mpi::ToStatus((expr), #expr, __FILE__, __LINE__)
#define PW_MPI_RETURN_IF_ERROR(expr) PW_RETURN_IF_ERROR(PW_MPI_STATUS(expr))

namespace pipewright::mpi_internal {

using comm_internal::CollectiveKind;

constexpr uint32_t kMagic = 0x504d5750;  // "PWMP"
constexpr int kAbortTag = 0;             // on a world's control communicator
constexpr size_t kMaxAbortMessage = 2048;

enum class PacketKind : int32_t { kP2P = 1, kCollective = 2, kAbort = 3 };

// ---- Packets and buffers (mpi_transport.cc) ----

// The fixed header of every message. Processes of one job share their ABI (MPI_BYTE is not
// converted), as MPI jobs of one binary do.
struct PacketHeader {
  uint32_t magic = kMagic;
  int32_t kind = 0;           // PacketKind
  int64_t tag = 0;            // P2P: the user's tag; collective: its number
  int64_t numel = 0;          // of the tensor the payload comes from
  int64_t payload_bytes = 0;  // bytes after the header
  int64_t error_bytes = 0;    // bytes of error text after the payload
  int32_t dtype = -1;         // DType, -1 without a tensor
  int32_t code = 0;           // absl::StatusCode of the sender's error; 0 = OK
  int32_t coll_kind = 0;      // CollectiveKind
  int32_t root = 0;
  int32_t color = 0;
  int32_t key = 0;
  int32_t sender = 0;  // group rank (collectives) or world rank (abort notices)
  int32_t reserved = 0;
  char shape[56] = {};  // Tensor::ShapeString(), for error messages (truncated)
};
static_assert(sizeof(PacketHeader) == 128);
static_assert(std::is_trivially_copyable_v<PacketHeader>);

void SetShape(PacketHeader& h, const Tensor& t);
std::string ShapeOf(const PacketHeader& h);

// Bytes owned by the backend (message buffers). Never moved while MPI may use them.
struct Buffer {
  std::unique_ptr<char[]> data;
  size_t size = 0;
  char* payload() { return data.get() + sizeof(PacketHeader); }
};

absl::StatusOr<std::shared_ptr<Buffer>> NewBuffer(size_t bytes);
// header | payload | error text
absl::StatusOr<std::shared_ptr<Buffer>> MakePacket(PacketHeader h, const void* payload,
                                                   size_t payload_bytes, absl::string_view error);

struct ParsedPacket {
  PacketHeader header;
  const char* payload = nullptr;
  std::string error;
};
absl::StatusOr<ParsedPacket> ParsePacket(const Buffer& b, absl::string_view what);

// `n` bytes as an MPI (count, datatype): MPI counts are int, so past `max_block` bytes a derived
// datatype of blocks (freed by the caller once the operation is posted).
struct BytesType {
  MPI_Datatype type = MPI_BYTE;
  int count = 0;
  bool derived = false;
};
absl::StatusOr<BytesType> MakeBytesType(size_t n, int64_t max_block);
void FreeType(BytesType& t);

// ---- State (all guarded by ProcessState::mu) ----

struct World;
struct Group;
struct Coll;

struct Op {
  std::string label;        // "rank 1" (or "rank 1 (world rank 3, group 2)")
  std::string description;  // "Recv from rank 0 (tag 17)"
  bool done = false;
  absl::Status status;
  std::weak_ptr<Coll> coll;  // while a collective waits for its peers
};

inline void Complete(Op& op, absl::Status status) {
  if (op.done) return;
  op.done = true;
  op.status = std::move(status);
}

struct SendReq {
  MPI_Request req = MPI_REQUEST_NULL;
  std::shared_ptr<Buffer> buf;
};

struct RecvOp {
  // Direct path: header message, then (when the header announces bytes) the payload message.
  enum class Stage { kProbeHeader, kHeader, kProbePayload, kPayload };
  std::shared_ptr<Op> op;
  Tensor tensor;  // the receiver's tensor (shares its storage)
  int peer = 0;
  int64_t tag = 0;
  Stage stage = Stage::kProbeHeader;
  MPI_Request req = MPI_REQUEST_NULL;  // of the header or the payload
  PacketHeader header;
  std::shared_ptr<Buffer> discard;  // the payload of a message that does not fit
};

struct StagedRecv {
  MPI_Request req = MPI_REQUEST_NULL;
  std::shared_ptr<Buffer> buf;
};

struct Coll {
  int64_t seq = 0;
  CollectiveKind kind = CollectiveKind::kBarrier;
  std::shared_ptr<Op> op;
  Tensor tensor;  // AllReduce, Broadcast: the buffer; AllGather, ReduceScatter: the input
  Tensor out;     // AllGather, ReduceScatter: the output
  int root = 0;
  PacketHeader mine;
  std::string my_error;
  int phase = 1;  // 1, 2 (AllReduce), 3 = finished
  // Packets of the current phase, by group rank: the buffer, its receive request while in
  // flight, and whether it arrived.
  std::vector<std::shared_ptr<Buffer>> bufs;
  std::vector<MPI_Request> reqs;
  std::vector<char> got;
  std::vector<int> colors, keys;  // Split: every rank's
};

using P2PKey = std::pair<int, int64_t>;  // (peer, tag)

struct Group {
  std::shared_ptr<World> world;
  int id = 0;
  int rank = 0;
  int size = 0;
  std::vector<int> mpi_ranks;  // group rank -> rank in p2p/coll (= world rank)
  MPI_Comm p2p = MPI_COMM_NULL;
  MPI_Comm coll = MPI_COMM_NULL;
  std::string label;
  int64_t max_direct_tag = 0;
  int overflow_tag = 0;
  int64_t coll_tag_period = 1;
  bool closed = false;
  absl::Status closed_status;
  bool split_broken = false;

  std::map<P2PKey, std::deque<std::shared_ptr<RecvOp>>> direct_pending;
  std::vector<std::shared_ptr<RecvOp>> direct_inflight;
  std::map<P2PKey, std::deque<std::shared_ptr<RecvOp>>> overflow_pending;
  std::map<P2PKey, std::deque<std::shared_ptr<Buffer>>> overflow_unexpected;
  std::map<int, std::deque<StagedRecv>> overflow_inflight;  // by peer, in match order
  std::deque<std::shared_ptr<Coll>> colls;                  // in collective order
  std::vector<SendReq> sends;
  std::vector<MPI_Request> pending_idups;  // of a Split that gave up (never freed)
};

struct World {
  int rank = 0;
  int size = 0;
  MPI_Comm control = MPI_COMM_NULL;
  MpiWorldOptions options;
  bool aborted = false;
  absl::Status abort_status;
  bool closed = false;
  int next_group_id = 1;
  std::vector<std::shared_ptr<Group>> groups;  // open groups
  std::vector<SendReq> sends;                  // abort notices
};

struct ProcessState {
  absl::Mutex mu;
  absl::CondVar cv;  // signalled on progress, new work and abort
  bool have_info = false;
  MpiProcess info;
  absl::Status init_error;
  bool we_initialized = false;
  bool finalized = false;  // MPI_Finalize was called by FinalizeMpi
  // Non-zero once this process failed (NoteMpiFailure, or a world aborted): FinalizeMpi's roll
  // call is then bounded, and this is MPI_Abort's error code (Note [Leaving after a failure]).
  int failure_exit_code = 0;
  std::vector<std::shared_ptr<World>> worlds;  // open worlds
  std::thread progress;
  uint64_t progress_generation = 0;
  // Memory MPI may still use after a request was given up on (MPI_Request_free): kept forever.
  std::vector<std::shared_ptr<void>> graveyard;
};

// The process's backend state (never destroyed: usable at exit).
ProcessState& Proc();

// ---- Transport (mpi_transport.cc) ----

// Marks the world aborted with `status` (the first abort wins) and, for a local abort, tells every
// other process of the world. Unmatched receives are dropped (nothing of theirs is in MPI yet).
void AbortLocked(World& w, const absl::Status& status, bool notify);
// Receives abort notices; the first one aborts the world (later ones are consumed and dropped).
absl::Status ProbeAbortNotices(World& w, bool* progressed);
// Moves the pending direct receives that have an MPI request in flight (a header being received)
// to direct_inflight, where the request is tested to completion; the others hold no MPI state.
void ParkActiveReceives(Group& g);

// Posts `buf` as one message to `dest` of `comm`; the request joins `sends`.
absl::Status PostSend(Group& g, MPI_Comm comm, int dest, int tag, std::shared_ptr<Buffer> buf,
                      std::vector<SendReq>* sends);
// Sends a P2P packet to group rank `peer` (direct tag: header and payload as two messages).
absl::Status SendP2P(Group& g, int peer, int64_t tag, std::shared_ptr<Buffer> packet);
// Completes a receive from a whole message held in `b`.
void DeliverStaged(RecvOp& r, const Buffer& b);
// Tests `sends`, dropping the completed ones.
absl::Status TestSends(std::vector<SendReq>& sends, bool* progressed);
// MPI_Imrecv of a matched message of `bytes` bytes into `buf`.
absl::Status ImrecvBytes(void* buf, size_t bytes, int64_t max_block, MPI_Message* msg,
                         MPI_Request* req);
// Advance the group's receives of direct and of overflow tags. Not `live` (aborted): only test
// what is in flight to completion.
absl::Status ProgressDirect(Group& g, bool live, bool* progressed);
absl::Status ProgressOverflow(Group& g, bool live, bool* progressed);

// ---- Collectives (mpi_collectives.cc) ----

// The MPI tag of collective #seq's `phase` on the group's collective communicator.
int CollTag(const Group& g, int64_t seq, int phase);
// The phase-1 packets of `c` (whose `mine` and `my_error` are set), by destination group rank:
// AllReduce and ReduceScatter a chunk per peer, the others one packet shared by all.
absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> Phase1Packets(const Group& g, const Coll& c,
                                                                   const Tensor& t, bool valid);
void StartPhase(Group& g, Coll& c, int phase);
absl::Status ProgressColls(Group& g, bool live, bool* progressed);

// ---- Progress and teardown (mpi_process.cc) ----

// Advances every open world of the process; an MPI error aborts its world. True when anything
// changed.
bool ProgressAllLocked();

enum class Activity {
  kIdle,      // nothing pending
  kWaiting,   // receives or collectives wait for messages that have not come
  kTransfer,  // MPI requests in flight: data moves only while someone calls into MPI
};
Activity ActivityLocked();

void StartProgressThreadLocked();
// Closes a group: its pending operations fail with `code` and `reason`, its sends get up to
// drain_timeout to complete (none after an abort), requests that never complete are abandoned
// (their memory kept), and its MPI communicators are freed. The mutex is released while waiting.
// Closing a world's last group closes the world; closing the process's last world stops the
// progress thread, which the caller joins (`join`) after releasing the mutex.
void CloseGroupLocked(const std::shared_ptr<Group>& gp, absl::StatusCode code,
                      absl::string_view reason, std::thread* join);
absl::Status SetErrorsReturn(MPI_Comm comm);

}  // namespace pipewright::mpi_internal

#endif  // PIPEWRIGHT_RUNTIME_COMM_MPI_INTERNAL_H_
