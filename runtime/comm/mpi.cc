// The MPI backend (runtime/comm/mpi.h; the protocol is documented in docs/mpi_backend.md).
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
// in phase 1; AllReduce sends rank r the r-th chunk of its tensor, rank r sums its chunk over
// all ranks in group-rank order (((x0 + x1) + x2) + ... , the same float operations as the
// local backend, so the bits are the same) and phase 2 sends every rank the summed chunks.
//
// Abort: the first Abort (or MPI error) seen by a process marks its world aborted and sends an
// abort notice to every other process of the world on `control`; every Progress probes for
// notices, and a notice aborts the receiving world with "rank R aborted: <message>".
#include "runtime/comm/mpi.h"

// The C API only (Open MPI and MPICH would otherwise pull in their C++ bindings).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <atomic>
#include <cctype>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"

namespace pipewright {

namespace mpi {

absl::Status ToStatus(int mpi_error, const char* expr, const char* file, int line) {
  if (mpi_error == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING + 1] = {};
  int len = 0;
  if (MPI_Error_string(mpi_error, text, &len) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "unknown MPI error");
  }
  int error_class = mpi_error;
  if (MPI_Error_class(mpi_error, &error_class) != MPI_SUCCESS) error_class = MPI_ERR_UNKNOWN;
  const std::string msg = absl::StrCat(expr, " at ", file, ":", line, ": ", text, " (MPI error ",
                                       mpi_error, ", class ", error_class, ")");
  switch (error_class) {
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_TAG:
    case MPI_ERR_COMM:
    case MPI_ERR_RANK:
    case MPI_ERR_ROOT:
    case MPI_ERR_GROUP:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_TRUNCATE:
    case MPI_ERR_INFO:
      return absl::InvalidArgumentError(msg);
    case MPI_ERR_NO_MEM:
      return absl::ResourceExhaustedError(msg);
#ifdef MPIX_ERR_PROC_FAILED
    case MPIX_ERR_PROC_FAILED:
      return absl::UnavailableError(msg);
#endif
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace mpi

namespace {

#define PW_MPI_STATUS(expr) ::pipewright::mpi::ToStatus((expr), #expr, __FILE__, __LINE__)
#define PW_MPI_RETURN_IF_ERROR(expr) PW_RETURN_IF_ERROR(PW_MPI_STATUS(expr))

constexpr uint32_t kMagic = 0x504d5750;  // "PWMP"
constexpr int kAbortTag = 0;             // on a world's control communicator
constexpr size_t kMaxAbortMessage = 2048;

enum class PacketKind : int32_t { kP2P = 1, kCollective = 2, kAbort = 3 };
enum class CollKind : int32_t { kAllReduce = 1, kBroadcast = 2, kBarrier = 3, kSplit = 4 };

const char* KindName(CollKind kind) {
  switch (kind) {
    case CollKind::kAllReduce:
      return "AllReduce";
    case CollKind::kBroadcast:
      return "Broadcast";
    case CollKind::kBarrier:
      return "Barrier";
    case CollKind::kSplit:
      return "Split";
  }
  return "collective";
}

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
  int32_t coll_kind = 0;      // CollKind
  int32_t root = 0;
  int32_t color = 0;
  int32_t key = 0;
  int32_t sender = 0;  // group rank (collectives) or world rank (abort notices)
  int32_t reserved = 0;
  char shape[56] = {};  // Tensor::ShapeString(), for error messages (truncated)
};
static_assert(sizeof(PacketHeader) == 128);
static_assert(std::is_trivially_copyable_v<PacketHeader>);

void SetShape(PacketHeader& h, const Tensor& t) {
  const std::string s = t.defined() ? t.ShapeString() : std::string("undefined");
  std::snprintf(h.shape, sizeof(h.shape), "%s", s.c_str());
}

std::string ShapeOf(const PacketHeader& h) {
  return std::string(h.shape, strnlen(h.shape, sizeof(h.shape)));
}

// Bytes owned by the backend (message buffers). Never moved while MPI may use them.
struct Buffer {
  std::unique_ptr<char[]> data;
  size_t size = 0;
  char* payload() { return data.get() + sizeof(PacketHeader); }
};

absl::StatusOr<std::shared_ptr<Buffer>> NewBuffer(size_t bytes) {
  auto b = std::make_shared<Buffer>();
  b->data.reset(new (std::nothrow) char[std::max<size_t>(bytes, 1)]);
  if (!b->data) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mpi backend: cannot allocate a message buffer of ", bytes, " bytes"));
  }
  b->size = bytes;
  return b;
}

// header | payload | error text
absl::StatusOr<std::shared_ptr<Buffer>> MakePacket(PacketHeader h, const void* payload,
                                                   size_t payload_bytes, absl::string_view error) {
  h.magic = kMagic;
  h.payload_bytes = static_cast<int64_t>(payload_bytes);
  h.error_bytes = static_cast<int64_t>(error.size());
  PW_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b,
                      NewBuffer(sizeof(PacketHeader) + payload_bytes + error.size()));
  std::memcpy(b->data.get(), &h, sizeof(h));
  if (payload_bytes > 0) std::memcpy(b->payload(), payload, payload_bytes);
  if (!error.empty()) std::memcpy(b->payload() + payload_bytes, error.data(), error.size());
  return b;
}

struct ParsedPacket {
  PacketHeader header;
  const char* payload = nullptr;
  std::string error;
};

absl::StatusOr<ParsedPacket> ParsePacket(const Buffer& b, absl::string_view what) {
  ParsedPacket p;
  if (b.size < sizeof(PacketHeader)) {
    return absl::InternalError(
        absl::StrCat(what, ": malformed message of ", b.size, " bytes (no pipewright header)"));
  }
  std::memcpy(&p.header, b.data.get(), sizeof(PacketHeader));
  const PacketHeader& h = p.header;
  if (h.magic != kMagic || h.payload_bytes < 0 || h.error_bytes < 0 ||
      sizeof(PacketHeader) + static_cast<size_t>(h.payload_bytes) +
              static_cast<size_t>(h.error_bytes) !=
          b.size) {
    return absl::InternalError(
        absl::StrCat(what, ": malformed message of ", b.size, " bytes (bad pipewright header)"));
  }
  p.payload = b.data.get() + sizeof(PacketHeader);
  p.error.assign(p.payload + h.payload_bytes, static_cast<size_t>(h.error_bytes));
  return p;
}

// `n` bytes as an MPI (count, datatype): MPI counts are int, so past `max_block` bytes a derived
// datatype of blocks (freed by the caller once the operation is posted).
struct BytesType {
  MPI_Datatype type = MPI_BYTE;
  int count = 0;
  bool derived = false;
};

absl::StatusOr<BytesType> MakeBytesType(size_t n, int64_t max_block) {
  if (n <= static_cast<size_t>(max_block)) return BytesType{MPI_BYTE, static_cast<int>(n), false};
  const size_t block = static_cast<size_t>(max_block);
  const size_t blocks = n / block, rem = n % block;
  if (blocks > static_cast<size_t>(INT_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mpi backend: message of ", n, " bytes is too large for MPI counts"));
  }
  MPI_Datatype one_block, all_blocks;
  PW_MPI_RETURN_IF_ERROR(MPI_Type_contiguous(static_cast<int>(block), MPI_BYTE, &one_block));
  PW_MPI_RETURN_IF_ERROR(MPI_Type_contiguous(static_cast<int>(blocks), one_block, &all_blocks));
  PW_MPI_RETURN_IF_ERROR(MPI_Type_free(&one_block));
  MPI_Datatype out = all_blocks;
  if (rem > 0) {
    int lens[2] = {1, static_cast<int>(rem)};
    MPI_Aint displs[2] = {0, static_cast<MPI_Aint>(blocks * block)};
    MPI_Datatype types[2] = {all_blocks, MPI_BYTE};
    PW_MPI_RETURN_IF_ERROR(MPI_Type_create_struct(2, lens, displs, types, &out));
    PW_MPI_RETURN_IF_ERROR(MPI_Type_free(&all_blocks));
  }
  PW_MPI_RETURN_IF_ERROR(MPI_Type_commit(&out));
  return BytesType{out, 1, true};
}

void FreeType(BytesType& t) {
  if (t.derived) MPI_Type_free(&t.type);
  t.derived = false;
}

std::string FormatSeconds(absl::Duration d) { return absl::StrCat(absl::ToDoubleSeconds(d), "s"); }

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

void Complete(Op& op, absl::Status status) {
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
  CollKind kind = CollKind::kBarrier;
  std::shared_ptr<Op> op;
  Tensor tensor;
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
  bool finalized = false;                      // MPI_Finalize was called by FinalizeMpi
  std::vector<std::shared_ptr<World>> worlds;  // open worlds
  std::thread progress;
  uint64_t progress_generation = 0;
  // Memory MPI may still use after a request was given up on (MPI_Request_free): kept forever.
  std::vector<std::shared_ptr<void>> graveyard;
};

ProcessState& Proc() {
  static ProcessState* state = new ProcessState;  // never destroyed: usable at exit
  return *state;
}

// ---- Abort ----

// Moves the pending direct receives that have an MPI request in flight (a header being received)
// to direct_inflight, where the request is tested to completion; the others hold no MPI state.
void ParkActiveReceives(Group& g) {
  for (auto& [key, q] : g.direct_pending) {
    for (std::shared_ptr<RecvOp>& r : q) {
      if (r->req != MPI_REQUEST_NULL) g.direct_inflight.push_back(r);
    }
  }
}

// Marks the world aborted with `status` (the first abort wins) and, for a local abort, tells every
// other process of the world. Unmatched receives are dropped (nothing of theirs is in MPI yet).
void AbortLocked(World& w, const absl::Status& status, bool notify) {
  if (w.aborted || w.closed) return;
  w.aborted = true;
  w.abort_status = status;
  for (const std::shared_ptr<Group>& g : w.groups) {
    ParkActiveReceives(*g);
    g->direct_pending.clear();
    g->overflow_pending.clear();
    g->overflow_unexpected.clear();
  }
  if (notify) {
    PacketHeader h;
    h.kind = static_cast<int32_t>(PacketKind::kAbort);
    h.code = static_cast<int32_t>(status.code());
    h.sender = w.rank;
    absl::string_view msg(status.message().data(), status.message().size());
    if (msg.size() > kMaxAbortMessage) msg = msg.substr(0, kMaxAbortMessage);
    absl::StatusOr<std::shared_ptr<Buffer>> packet = MakePacket(h, nullptr, 0, msg);
    if (packet.ok()) {
      for (int r = 0; r < w.size; ++r) {
        if (r == w.rank) continue;
        SendReq s{MPI_REQUEST_NULL, *packet};
        // Best effort: an abort has nowhere to report its own failure.
        if (MPI_Isend((*packet)->data.get(), static_cast<int>((*packet)->size), MPI_BYTE, r,
                      kAbortTag, w.control, &s.req) == MPI_SUCCESS) {
          w.sends.push_back(std::move(s));
        }
      }
    }
  }
  Proc().cv.SignalAll();
}

// Receives abort notices; the first one aborts the world (later ones are consumed and dropped).
absl::Status ProbeAbortNotices(World& w, bool* progressed) {
  while (true) {
    int flag = 0;
    MPI_Message msg;
    MPI_Status st;
    PW_MPI_RETURN_IF_ERROR(MPI_Improbe(MPI_ANY_SOURCE, kAbortTag, w.control, &flag, &msg, &st));
    if (!flag) return absl::OkStatus();
    *progressed = true;
    int count = 0;
    PW_MPI_RETURN_IF_ERROR(MPI_Get_count(&st, MPI_BYTE, &count));
    PW_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b, NewBuffer(static_cast<size_t>(count)));
    // A matched notice of a few bytes: there is nothing left to wait for.
    PW_MPI_RETURN_IF_ERROR(MPI_Mrecv(b->data.get(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE));
    if (w.aborted) continue;
    absl::StatusOr<ParsedPacket> p = ParsePacket(*b, "abort notice");
    absl::Status cause;
    if (!p.ok()) {
      cause = absl::AbortedError(
          absl::StrCat("rank ", st.MPI_SOURCE, " aborted (", p.status().message(), ")"));
    } else {
      absl::StatusCode code = static_cast<absl::StatusCode>(p->header.code);
      if (p->header.code <= 0 ||
          p->header.code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
        code = absl::StatusCode::kAborted;
      }
      cause = absl::Status(code, absl::StrCat("rank ", st.MPI_SOURCE, " aborted: ", p->error));
    }
    AbortLocked(w, cause, /*notify=*/false);
  }
}

// ---- Point to point ----

std::string MismatchMessage(const Op& op, const PacketHeader& h, const Tensor& t) {
  return absl::StrCat(op.label, ": ", op.description, ": message of ", h.payload_bytes, " bytes (",
                      ShapeOf(h), ") does not match the receive buffer of ", t.nbytes(), " bytes (",
                      t.ShapeString(), ")");
}

bool SameLayout(const PacketHeader& h, const Tensor& t) {
  return h.dtype == static_cast<int32_t>(t.dtype()) && h.numel == t.numel() &&
         h.payload_bytes == static_cast<int64_t>(t.nbytes());
}

// Completes a receive from a whole message held in `b`.
void DeliverStaged(RecvOp& r, const Buffer& b) {
  absl::StatusOr<ParsedPacket> p =
      ParsePacket(b, absl::StrCat(r.op->label, ": ", r.op->description));
  if (!p.ok()) {
    Complete(*r.op, p.status());
    return;
  }
  if (!SameLayout(p->header, r.tensor)) {
    Complete(*r.op, absl::InvalidArgumentError(MismatchMessage(*r.op, p->header, r.tensor)));
    return;
  }
  if (r.tensor.nbytes() > 0) std::memcpy(r.tensor.raw(), p->payload, r.tensor.nbytes());
  Complete(*r.op, absl::OkStatus());
}

absl::Status PostSend(Group& g, MPI_Comm comm, int dest, int tag, std::shared_ptr<Buffer> buf,
                      std::vector<SendReq>* sends) {
  PW_ASSIGN_OR_RETURN(BytesType t, MakeBytesType(buf->size, g.world->options.max_block_bytes));
  SendReq s{MPI_REQUEST_NULL, std::move(buf)};
  absl::Status st =
      PW_MPI_STATUS(MPI_Isend(s.buf->data.get(), t.count, t.type, dest, tag, comm, &s.req));
  FreeType(t);
  PW_RETURN_IF_ERROR(st);
  sends->push_back(std::move(s));
  return absl::OkStatus();
}

// A direct tag sends the header and then the payload (from the same buffer) as two messages, so
// the receiver can take the payload straight into its tensor; a larger tag sends one message.
absl::Status SendP2P(Group& g, int peer, int64_t tag, std::shared_ptr<Buffer> packet) {
  const int dest = g.mpi_ranks[peer];
  if (tag > g.max_direct_tag) return PostSend(g, g.p2p, dest, g.overflow_tag, packet, &g.sends);
  const int mpi_tag = static_cast<int>(tag);
  const size_t payload_bytes = packet->size - sizeof(PacketHeader);
  const int64_t max_block = g.world->options.max_block_bytes;
  for (int part = 0; part < (payload_bytes > 0 ? 2 : 1); ++part) {
    char* data = part == 0 ? packet->data.get() : packet->payload();
    PW_ASSIGN_OR_RETURN(BytesType t,
                        MakeBytesType(part == 0 ? sizeof(PacketHeader) : payload_bytes, max_block));
    SendReq s{MPI_REQUEST_NULL, packet};
    absl::Status st = PW_MPI_STATUS(MPI_Isend(data, t.count, t.type, dest, mpi_tag, g.p2p, &s.req));
    FreeType(t);
    PW_RETURN_IF_ERROR(st);
    g.sends.push_back(std::move(s));
  }
  return absl::OkStatus();
}

absl::Status TestSends(std::vector<SendReq>& sends, bool* progressed) {
  for (size_t i = 0; i < sends.size();) {
    int flag = 0;
    PW_MPI_RETURN_IF_ERROR(MPI_Test(&sends[i].req, &flag, MPI_STATUS_IGNORE));
    if (flag) {
      sends[i] = std::move(sends.back());
      sends.pop_back();
      *progressed = true;
    } else {
      ++i;
    }
  }
  return absl::OkStatus();
}

absl::Status ImrecvBytes(void* buf, size_t bytes, int64_t max_block, MPI_Message* msg,
                         MPI_Request* req) {
  PW_ASSIGN_OR_RETURN(BytesType t, MakeBytesType(bytes, max_block));
  absl::Status s = PW_MPI_STATUS(MPI_Imrecv(buf, t.count, t.type, msg, req));
  FreeType(t);
  return s;
}

// A received header: checks it and decides what its payload is for.
absl::Status CheckDirectHeader(const RecvOp& r) {
  const PacketHeader& h = r.header;
  if (h.magic != kMagic || h.kind != static_cast<int32_t>(PacketKind::kP2P) || h.tag != r.tag ||
      h.payload_bytes < 0) {
    return absl::InternalError(absl::StrCat(r.op->label, ": ", r.op->description,
                                            ": protocol error: malformed message header"));
  }
  return absl::OkStatus();
}

void FinishDirectRecv(RecvOp& r) {
  if (!SameLayout(r.header, r.tensor)) {
    Complete(*r.op, absl::InvalidArgumentError(MismatchMessage(*r.op, r.header, r.tensor)));
  } else {
    Complete(*r.op, absl::OkStatus());
  }
}

// Direct tags. Only the oldest receive of a (peer, tag) touches MPI, and it keeps that place
// until its payload is matched: the next message of the (peer, tag) after a header is that
// header's payload (MPI's non-overtaking order), never another header.
absl::Status ProgressDirect(Group& g, bool live, bool* progressed) {
  const int64_t max_block = g.world->options.max_block_bytes;
  if (live) {
    for (auto it = g.direct_pending.begin(); it != g.direct_pending.end();) {
      std::deque<std::shared_ptr<RecvOp>>& q = it->second;
      while (!q.empty()) {
        RecvOp& r = *q.front();
        const int source = g.mpi_ranks[r.peer], tag = static_cast<int>(r.tag);
        int flag = 0;
        MPI_Message msg;
        MPI_Status st;
        if (r.stage == RecvOp::Stage::kProbeHeader) {
          PW_MPI_RETURN_IF_ERROR(MPI_Improbe(source, tag, g.p2p, &flag, &msg, &st));
          if (!flag) break;
          MPI_Count count = 0;
          PW_MPI_RETURN_IF_ERROR(MPI_Get_elements_x(&st, MPI_BYTE, &count));
          if (count != static_cast<MPI_Count>(sizeof(PacketHeader))) {
            return absl::InternalError(absl::StrCat(r.op->label, ": ", r.op->description,
                                                    ": protocol error: a header of ", count,
                                                    " bytes"));
          }
          PW_RETURN_IF_ERROR(ImrecvBytes(&r.header, sizeof(PacketHeader), max_block, &msg, &r.req));
          r.stage = RecvOp::Stage::kHeader;
          *progressed = true;
        }
        if (r.stage == RecvOp::Stage::kHeader) {
          PW_MPI_RETURN_IF_ERROR(MPI_Test(&r.req, &flag, MPI_STATUS_IGNORE));
          if (!flag) break;
          PW_RETURN_IF_ERROR(CheckDirectHeader(r));
          *progressed = true;
          if (r.header.payload_bytes == 0) {  // no payload message follows
            FinishDirectRecv(r);
            q.pop_front();
            continue;
          }
          r.stage = RecvOp::Stage::kProbePayload;
        }
        // kProbePayload
        PW_MPI_RETURN_IF_ERROR(MPI_Improbe(source, tag, g.p2p, &flag, &msg, &st));
        if (!flag) break;
        MPI_Count count = 0;
        PW_MPI_RETURN_IF_ERROR(MPI_Get_elements_x(&st, MPI_BYTE, &count));
        if (count != static_cast<MPI_Count>(r.header.payload_bytes)) {
          return absl::InternalError(
              absl::StrCat(r.op->label, ": ", r.op->description, ": protocol error: a payload of ",
                           count, " bytes after a header announcing ", r.header.payload_bytes));
        }
        if (SameLayout(r.header, r.tensor)) {  // straight into the tensor
          PW_RETURN_IF_ERROR(
              ImrecvBytes(r.tensor.raw(), r.tensor.nbytes(), max_block, &msg, &r.req));
        } else {  // consumed, never written to the tensor
          PW_ASSIGN_OR_RETURN(r.discard, NewBuffer(static_cast<size_t>(count)));
          PW_RETURN_IF_ERROR(
              ImrecvBytes(r.discard->data.get(), r.discard->size, max_block, &msg, &r.req));
        }
        r.stage = RecvOp::Stage::kPayload;
        g.direct_inflight.push_back(std::move(q.front()));
        q.pop_front();
        *progressed = true;
      }
      it = q.empty() ? g.direct_pending.erase(it) : std::next(it);
    }
  }
  for (size_t i = 0; i < g.direct_inflight.size();) {
    RecvOp& r = *g.direct_inflight[i];
    int flag = 0;
    PW_MPI_RETURN_IF_ERROR(MPI_Test(&r.req, &flag, MPI_STATUS_IGNORE));
    if (!flag) {
      ++i;
      continue;
    }
    if (live && r.stage == RecvOp::Stage::kPayload) FinishDirectRecv(r);
    g.direct_inflight[i] = std::move(g.direct_inflight.back());
    g.direct_inflight.pop_back();
    *progressed = true;
  }
  return absl::OkStatus();
}

absl::Status ProgressOverflow(Group& g, bool live, bool* progressed) {
  if (live) {
    std::set<int> peers;
    for (const auto& [key, q] : g.overflow_pending) peers.insert(key.first);
    for (int peer : peers) {
      while (true) {
        int flag = 0;
        MPI_Message msg;
        MPI_Status st;
        PW_MPI_RETURN_IF_ERROR(
            MPI_Improbe(g.mpi_ranks[peer], g.overflow_tag, g.p2p, &flag, &msg, &st));
        if (!flag) break;
        MPI_Count count = 0;
        PW_MPI_RETURN_IF_ERROR(MPI_Get_elements_x(&st, MPI_BYTE, &count));
        StagedRecv s;
        PW_ASSIGN_OR_RETURN(s.buf, NewBuffer(static_cast<size_t>(count)));
        PW_ASSIGN_OR_RETURN(BytesType t,
                            MakeBytesType(s.buf->size, g.world->options.max_block_bytes));
        absl::Status posted =
            PW_MPI_STATUS(MPI_Imrecv(s.buf->data.get(), t.count, t.type, &msg, &s.req));
        FreeType(t);
        PW_RETURN_IF_ERROR(posted);
        g.overflow_inflight[peer].push_back(std::move(s));
        *progressed = true;
      }
    }
  }
  for (auto it = g.overflow_inflight.begin(); it != g.overflow_inflight.end();) {
    const int peer = it->first;
    std::deque<StagedRecv>& fifo = it->second;
    // Delivered in match order (= the peer's send order), so same-tag messages stay FIFO.
    while (!fifo.empty()) {
      int flag = 0;
      PW_MPI_RETURN_IF_ERROR(MPI_Test(&fifo.front().req, &flag, MPI_STATUS_IGNORE));
      if (!flag) break;
      std::shared_ptr<Buffer> b = std::move(fifo.front().buf);
      fifo.pop_front();
      *progressed = true;
      if (!live) continue;
      absl::StatusOr<ParsedPacket> p =
          ParsePacket(*b, absl::StrCat(g.label, ": message from rank ", peer));
      if (!p.ok()) return p.status();
      const P2PKey key{peer, p->header.tag};
      auto pending = g.overflow_pending.find(key);
      if (pending != g.overflow_pending.end()) {
        std::shared_ptr<RecvOp> r = std::move(pending->second.front());
        pending->second.pop_front();
        if (pending->second.empty()) g.overflow_pending.erase(pending);
        DeliverStaged(*r, *b);
      } else {
        g.overflow_unexpected[key].push_back(std::move(b));
      }
    }
    it = fifo.empty() ? g.overflow_inflight.erase(it) : std::next(it);
  }
  return absl::OkStatus();
}

// ---- Collectives ----

int CollTag(const Group& g, int64_t seq, int phase) {
  return static_cast<int>((seq % g.coll_tag_period) * 2 + (phase - 1));
}

// Elements [lo, hi) of rank r's AllReduce chunk.
std::pair<int64_t, int64_t> Chunk(int64_t numel, int ranks, int r) {
  const int64_t base = numel / ranks, rem = numel % ranks;
  const int64_t lo = r * base + std::min<int64_t>(r, rem);
  return {lo, lo + base + (r < rem ? 1 : 0)};
}

template <typename T>
void Accumulate(T* acc, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

// Signed overflow wraps (two's complement) instead of being undefined, as in the local backend.
void AccumulateI32(int32_t* acc, const int32_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    acc[i] = static_cast<int32_t>(static_cast<uint32_t>(acc[i]) + static_cast<uint32_t>(x[i]));
  }
}

void AccumulateAny(DType dtype, void* acc, const void* x, int64_t n) {
  switch (dtype) {
    case DType::kF32:
      Accumulate(static_cast<float*>(acc), static_cast<const float*>(x), n);
      break;
    case DType::kF64:
      Accumulate(static_cast<double*>(acc), static_cast<const double*>(x), n);
      break;
    case DType::kI32:
      AccumulateI32(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), n);
      break;
    default:
      PW_CHECK(false);  // rejected before
  }
}

// The verdict every rank computes from the same N headers: the first rank's own error, else the
// first disagreement with group rank 0, else OK.
absl::Status Verdict(const Coll& c, const std::vector<PacketHeader>& h,
                     const std::vector<std::string>& errors) {
  for (size_t r = 0; r < h.size(); ++r) {
    if (h[r].code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(h[r].code), errors[r]);
    }
  }
  const PacketHeader& first = h[0];
  const CollKind first_kind = static_cast<CollKind>(first.coll_kind);
  for (size_t r = 1; r < h.size(); ++r) {
    const CollKind kind = static_cast<CollKind>(h[r].coll_kind);
    if (kind != first_kind) {
      return absl::InvalidArgumentError(absl::StrCat("collective #", c.seq, ": rank ", r,
                                                     " called ", KindName(kind),
                                                     " but rank 0 called ", KindName(first_kind)));
    }
    if ((kind == CollKind::kAllReduce || kind == CollKind::kBroadcast) &&
        (h[r].dtype != first.dtype || h[r].numel != first.numel)) {
      return absl::InvalidArgumentError(absl::StrCat(KindName(kind), " (collective #", c.seq,
                                                     "): rank ", r, " passed ", ShapeOf(h[r]),
                                                     " but rank 0 passed ", ShapeOf(first)));
    }
    if (kind == CollKind::kBroadcast && h[r].root != first.root) {
      return absl::InvalidArgumentError(absl::StrCat("Broadcast (collective #", c.seq, "): rank ",
                                                     r, " passed root ", h[r].root,
                                                     " but rank 0 passed root ", first.root));
    }
  }
  return absl::OkStatus();
}

void StartPhase(Group& g, Coll& c, int phase) {
  c.phase = phase;
  c.bufs.assign(g.size, nullptr);
  c.reqs.assign(g.size, MPI_REQUEST_NULL);
  c.got.assign(g.size, 0);
  c.got[g.rank] = 1;
}

void FinishColl(Coll& c) {
  c.phase = 3;
  c.bufs.clear();
  c.tensor = Tensor();
  c.op->coll.reset();
}

absl::Status FinishPhase(Group& g, Coll& c) {
  const std::string what = absl::StrCat(c.op->label, ": ", c.op->description);
  const size_t es = c.tensor.defined() ? DTypeSize(c.tensor.dtype()) : 0;
  if (c.phase == 1) {
    std::vector<PacketHeader> h(g.size);
    std::vector<std::string> errors(g.size);
    std::vector<const char*> payload(g.size, nullptr);
    std::vector<int64_t> payload_bytes(g.size, 0);
    for (int r = 0; r < g.size; ++r) {
      if (r == g.rank) {
        h[r] = c.mine;
        errors[r] = c.my_error;
        continue;
      }
      PW_ASSIGN_OR_RETURN(ParsedPacket p, ParsePacket(*c.bufs[r], what));
      if (p.header.kind != static_cast<int32_t>(PacketKind::kCollective) || p.header.tag != c.seq ||
          p.header.sender != r) {
        return absl::InternalError(absl::StrCat(what, ": protocol error: rank ", r,
                                                "'s packet is for collective #", p.header.tag));
      }
      h[r] = p.header;
      errors[r] = std::move(p.error);
      payload[r] = p.payload;
      payload_bytes[r] = p.header.payload_bytes;
    }
    if (c.op->done) {  // this rank's own arguments were invalid: it failed at once
      FinishColl(c);
      return absl::OkStatus();
    }
    if (absl::Status v = Verdict(c, h, errors); !v.ok()) {
      Complete(*c.op, v);
      FinishColl(c);
      return absl::OkStatus();
    }
    switch (c.kind) {
      case CollKind::kBarrier:
        break;
      case CollKind::kSplit:
        c.colors.resize(g.size);
        c.keys.resize(g.size);
        for (int r = 0; r < g.size; ++r) {
          c.colors[r] = h[r].color;
          c.keys[r] = h[r].key;
        }
        break;
      case CollKind::kBroadcast:
        if (c.root != g.rank) {
          if (payload_bytes[c.root] != static_cast<int64_t>(c.tensor.nbytes())) {
            return absl::InternalError(absl::StrCat(what, ": protocol error: root sent ",
                                                    payload_bytes[c.root], " bytes"));
          }
          if (c.tensor.nbytes() > 0) {
            std::memcpy(c.tensor.raw(), payload[c.root], c.tensor.nbytes());
          }
        }
        break;
      case CollKind::kAllReduce: {
        // acc = x0; acc += x1; acc += x2; ... over this rank's chunk, in group-rank order.
        const auto [lo, hi] = Chunk(c.tensor.numel(), g.size, g.rank);
        const size_t bytes = static_cast<size_t>(hi - lo) * es;
        char* mine = static_cast<char*>(c.tensor.raw()) + lo * es;
        for (int r = 0; r < g.size; ++r) {
          if (r != g.rank && payload_bytes[r] != static_cast<int64_t>(bytes)) {
            return absl::InternalError(absl::StrCat(what, ": protocol error: rank ", r, " sent ",
                                                    payload_bytes[r], " bytes for a chunk of ",
                                                    bytes));
          }
        }
        PacketHeader out = c.mine;
        out.code = 0;
        PW_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> packet,
                            MakePacket(out, g.rank == 0 ? mine : payload[0], bytes, ""));
        char* acc = packet->payload();
        for (int r = 1; r < g.size; ++r) {
          AccumulateAny(c.tensor.dtype(), acc, r == g.rank ? mine : payload[r], hi - lo);
        }
        if (bytes > 0) std::memcpy(mine, acc, bytes);
        if (g.size == 1) break;
        for (int p = 0; p < g.size; ++p) {
          if (p == g.rank) continue;
          PW_RETURN_IF_ERROR(
              PostSend(g, g.coll, g.mpi_ranks[p], CollTag(g, c.seq, 2), packet, &g.sends));
        }
        StartPhase(g, c, 2);
        return absl::OkStatus();
      }
    }
    Complete(*c.op, absl::OkStatus());
    FinishColl(c);
    return absl::OkStatus();
  }
  // Phase 2 of AllReduce: every other rank's summed chunk.
  for (int r = 0; r < g.size; ++r) {
    if (r == g.rank) continue;
    PW_ASSIGN_OR_RETURN(ParsedPacket p, ParsePacket(*c.bufs[r], what));
    const auto [lo, hi] = Chunk(c.tensor.numel(), g.size, r);
    const size_t bytes = static_cast<size_t>(hi - lo) * es;
    if (p.header.tag != c.seq || p.header.payload_bytes != static_cast<int64_t>(bytes)) {
      return absl::InternalError(
          absl::StrCat(what, ": protocol error in rank ", r, "'s reduced chunk"));
    }
    if (bytes > 0) std::memcpy(static_cast<char*>(c.tensor.raw()) + lo * es, p.payload, bytes);
  }
  Complete(*c.op, absl::OkStatus());
  FinishColl(c);
  return absl::OkStatus();
}

absl::Status ProgressColls(Group& g, bool live, bool* progressed) {
  if (g.colls.empty()) return absl::OkStatus();
  const int64_t oldest = g.colls.front()->seq;
  for (const std::shared_ptr<Coll>& cp : g.colls) {
    Coll& c = *cp;
    if (c.phase == 3) continue;
    // A collective probes only while no older active one can own the same MPI tag.
    if (live && c.seq - oldest < g.coll_tag_period) {
      const int tag = CollTag(g, c.seq, c.phase);
      for (int r = 0; r < g.size; ++r) {
        if (c.got[r] || c.reqs[r] != MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Message msg;
        MPI_Status st;
        PW_MPI_RETURN_IF_ERROR(MPI_Improbe(g.mpi_ranks[r], tag, g.coll, &flag, &msg, &st));
        if (!flag) continue;
        MPI_Count count = 0;
        PW_MPI_RETURN_IF_ERROR(MPI_Get_elements_x(&st, MPI_BYTE, &count));
        PW_ASSIGN_OR_RETURN(c.bufs[r], NewBuffer(static_cast<size_t>(count)));
        PW_ASSIGN_OR_RETURN(BytesType t,
                            MakeBytesType(c.bufs[r]->size, g.world->options.max_block_bytes));
        absl::Status posted =
            PW_MPI_STATUS(MPI_Imrecv(c.bufs[r]->data.get(), t.count, t.type, &msg, &c.reqs[r]));
        FreeType(t);
        PW_RETURN_IF_ERROR(posted);
        *progressed = true;
      }
    }
    bool all = true;
    for (int r = 0; r < g.size; ++r) {
      if (c.reqs[r] != MPI_REQUEST_NULL) {
        int flag = 0;
        PW_MPI_RETURN_IF_ERROR(MPI_Test(&c.reqs[r], &flag, MPI_STATUS_IGNORE));
        if (flag) {
          c.got[r] = 1;
          *progressed = true;
        }
      }
      if (!c.got[r]) all = false;
    }
    if (!live) {
      bool in_flight = false;
      for (MPI_Request r : c.reqs) in_flight |= r != MPI_REQUEST_NULL;
      if (!in_flight) FinishColl(c);
      continue;
    }
    if (all) {
      PW_RETURN_IF_ERROR(FinishPhase(g, c));
      *progressed = true;
    }
  }
  for (auto it = g.colls.begin(); it != g.colls.end();) {
    it = (*it)->phase == 3 ? g.colls.erase(it) : std::next(it);
  }
  return absl::OkStatus();
}

// ---- Progress ----

absl::Status ProgressGroup(Group& g, bool* progressed) {
  const bool live = !g.world->aborted;
  PW_RETURN_IF_ERROR(TestSends(g.sends, progressed));
  PW_RETURN_IF_ERROR(ProgressDirect(g, live, progressed));
  PW_RETURN_IF_ERROR(ProgressOverflow(g, live, progressed));
  PW_RETURN_IF_ERROR(ProgressColls(g, live, progressed));
  return absl::OkStatus();
}

// Advances every open world of the process; an MPI error aborts its world. True when anything
// changed.
bool ProgressAllLocked() {
  ProcessState& p = Proc();
  bool progressed = false;
  const std::vector<std::shared_ptr<World>> worlds = p.worlds;
  for (const std::shared_ptr<World>& w : worlds) {
    if (w->closed) continue;
    absl::Status s = TestSends(w->sends, &progressed);
    if (s.ok()) s = ProbeAbortNotices(*w, &progressed);
    if (!s.ok()) AbortLocked(*w, s, /*notify=*/true);
    const std::vector<std::shared_ptr<Group>> groups = w->groups;
    for (const std::shared_ptr<Group>& g : groups) {
      if (g->closed) continue;
      s = ProgressGroup(*g, &progressed);
      if (!s.ok()) {
        AbortLocked(*w, s, /*notify=*/true);
        progressed = true;
      }
    }
  }
  return progressed;
}

enum class Activity {
  kIdle,      // nothing pending
  kWaiting,   // receives or collectives wait for messages that have not come
  kTransfer,  // MPI requests in flight: data moves only while someone calls into MPI
};

Activity ActivityLocked() {
  Activity a = Activity::kIdle;
  for (const std::shared_ptr<World>& w : Proc().worlds) {
    if (w->closed) continue;
    if (!w->sends.empty()) return Activity::kTransfer;
    for (const std::shared_ptr<Group>& g : w->groups) {
      if (g->closed) continue;
      if (!g->sends.empty() || !g->direct_inflight.empty() || !g->overflow_inflight.empty()) {
        return Activity::kTransfer;
      }
      for (const auto& [key, q] : g->direct_pending) {
        if (!q.empty() && q.front()->req != MPI_REQUEST_NULL) return Activity::kTransfer;
      }
      for (const std::shared_ptr<Coll>& c : g->colls) {
        for (MPI_Request r : c->reqs) {
          if (r != MPI_REQUEST_NULL) return Activity::kTransfer;
        }
      }
      if (!g->direct_pending.empty() || !g->overflow_pending.empty() || !g->colls.empty()) {
        a = Activity::kWaiting;
      }
    }
  }
  return a;
}

// The progress thread: keeps MPI moving while no one waits (without a single-copy transport a
// large message's data moves only while both sides' MPI libraries run; abort notices are picked
// up). While requests are in flight it polls every 20 us, backing off to 200 us while nothing
// completes (a send whose receiver has not come costs a few percent of a core, a transfer while
// the application computes still moves); it backs off to 1 ms while operations wait for messages
// that have not come, polls every 10 ms when idle, and wakes early on new work.
void ProgressLoop(uint64_t generation) {
#ifdef __linux__
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);  // 1 us: short sleeps stay short
#endif
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  absl::Duration sleep = absl::Microseconds(20);
  while (p.progress_generation == generation) {
    const bool progressed = ProgressAllLocked();
    if (progressed) p.cv.SignalAll();
    switch (ActivityLocked()) {
      case Activity::kTransfer:
        // A send waiting for its receiver shows no progress; moving data shows some.
        sleep = progressed ? absl::Microseconds(20)
                           : std::clamp(sleep * 2, absl::Microseconds(20), absl::Microseconds(200));
        break;
      case Activity::kWaiting:
        sleep = std::clamp(sleep * 2, absl::Microseconds(50), absl::Milliseconds(1));
        break;
      case Activity::kIdle:
        sleep = absl::Milliseconds(10);
        break;
    }
    p.cv.WaitWithTimeout(&p.mu, sleep);
  }
}

void StartProgressThreadLocked() {
  ProcessState& p = Proc();
  if (p.progress.joinable()) return;
  p.progress = std::thread(ProgressLoop, ++p.progress_generation);
}

// The caller joins the returned thread after releasing the mutex.
std::thread StopProgressThreadLocked() {
  ProcessState& p = Proc();
  if (!p.progress.joinable()) return std::thread();
  ++p.progress_generation;
  p.cv.SignalAll();
  return std::move(p.progress);
}

// ---- Teardown ----

// Gives up on `req` (still active): MPI may still use `keep`, so it is kept forever.
void Abandon(MPI_Request* req, std::shared_ptr<void> keep) {
  if (*req != MPI_REQUEST_NULL) MPI_Request_free(req);
  if (keep) Proc().graveyard.push_back(std::move(keep));
}

void CloseWorldLocked(World& w, std::thread* join) {
  ProcessState& p = Proc();
  w.closed = true;
  const absl::Time deadline = absl::Now() + std::min(w.options.drain_timeout, absl::Seconds(1));
  bool progressed = false;
  while (!w.sends.empty() && TestSends(w.sends, &progressed).ok() && !w.sends.empty() &&
         absl::Now() < deadline) {
    p.cv.WaitWithTimeout(&p.mu, absl::Milliseconds(1));
  }
  for (SendReq& s : w.sends) Abandon(&s.req, s.buf);
  w.sends.clear();
  if (w.control != MPI_COMM_NULL) MPI_Comm_free(&w.control);
  p.worlds.erase(std::remove_if(p.worlds.begin(), p.worlds.end(),
                                [&](const std::shared_ptr<World>& x) { return x.get() == &w; }),
                 p.worlds.end());
  if (p.worlds.empty()) *join = StopProgressThreadLocked();
}

// Closes a group: its pending operations fail with `code` and `reason`, its sends get up to
// drain_timeout to complete (none after an abort), requests that never complete are abandoned
// (their memory kept), and its MPI communicators are freed. The mutex is released while waiting.
void CloseGroupLocked(const std::shared_ptr<Group>& gp, absl::StatusCode code,
                      absl::string_view reason, std::thread* join) {
  Group& g = *gp;
  if (g.closed) return;
  ProcessState& p = Proc();
  g.closed = true;
  g.closed_status = absl::Status(code, absl::StrCat(g.label, ": ", reason));
  auto fail = [&](Op& op) {
    Complete(op, absl::Status(code, absl::StrCat(op.label, ": ", op.description, ": ", reason)));
  };
  ParkActiveReceives(g);
  for (auto* queues : {&g.direct_pending, &g.overflow_pending}) {
    for (auto& [key, q] : *queues) {
      for (auto& r : q) fail(*r->op);
    }
    queues->clear();
  }
  g.overflow_unexpected.clear();
  for (auto& r : g.direct_inflight) {
    fail(*r->op);
    MPI_Cancel(&r->req);
  }
  for (auto& [peer, fifo] : g.overflow_inflight) {
    for (StagedRecv& s : fifo) MPI_Cancel(&s.req);
  }
  for (auto& c : g.colls) {
    fail(*c->op);
    for (MPI_Request& r : c->reqs) {
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
    }
  }
  p.cv.SignalAll();

  // Drain: every request either completes (sends delivered, cancelled receives) or is abandoned.
  const absl::Time deadline =
      absl::Now() + (g.world->aborted ? absl::ZeroDuration() : g.world->options.drain_timeout);
  while (true) {
    bool progressed = false, error = false;
    error |= !TestSends(g.sends, &progressed).ok();
    auto test = [&](MPI_Request* r) {
      int flag = 0;
      if (*r != MPI_REQUEST_NULL && MPI_Test(r, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        error = true;
      }
    };
    bool left = !g.sends.empty();
    for (auto& r : g.direct_inflight) {
      test(&r->req);
      left |= r->req != MPI_REQUEST_NULL;
    }
    for (auto& [peer, fifo] : g.overflow_inflight) {
      for (StagedRecv& s : fifo) {
        test(&s.req);
        left |= s.req != MPI_REQUEST_NULL;
      }
    }
    for (auto& c : g.colls) {
      for (MPI_Request& r : c->reqs) {
        test(&r);
        left |= r != MPI_REQUEST_NULL;
      }
    }
    if (!left || error || absl::Now() >= deadline) break;
    p.cv.WaitWithTimeout(&p.mu, absl::Milliseconds(1));
  }
  for (SendReq& s : g.sends) Abandon(&s.req, s.buf);
  for (auto& r : g.direct_inflight) Abandon(&r->req, r);
  for (auto& [peer, fifo] : g.overflow_inflight) {
    for (StagedRecv& s : fifo) Abandon(&s.req, s.buf);
  }
  for (auto& c : g.colls) {
    for (size_t i = 0; i < c->reqs.size(); ++i) Abandon(&c->reqs[i], c->bufs[i]);
    c->tensor = Tensor();
  }
  g.sends.clear();
  g.direct_inflight.clear();
  g.overflow_inflight.clear();
  g.colls.clear();

  // A Split that gave up may still have MPI_Comm_idup in flight on these communicators: freeing
  // them then is erroneous, so they are kept (a leak, after a failure only).
  bool idup_pending = false;
  for (MPI_Request& r : g.pending_idups) {
    int flag = 0;
    if (r != MPI_REQUEST_NULL && MPI_Test(&r, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
      continue;
    }
    idup_pending = true;
  }
  if (!idup_pending) {
    if (g.p2p != MPI_COMM_NULL) MPI_Comm_free(&g.p2p);
    if (g.coll != MPI_COMM_NULL) MPI_Comm_free(&g.coll);
  }

  World& w = *g.world;
  w.groups.erase(std::remove(w.groups.begin(), w.groups.end(), gp), w.groups.end());
  if (w.groups.empty() && !w.closed) CloseWorldLocked(w, join);
  p.cv.SignalAll();
}

// ---- Work and Communicator ----

absl::Status WaitOp(Group& g, Op& op, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;  // saturates for InfiniteDuration()
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  absl::Duration backoff = absl::Microseconds(20);
  while (true) {
    if (op.done) return op.status;
    if (g.world->aborted) return g.world->abort_status;
    if (g.closed) return g.closed_status;
    if (ProgressAllLocked()) p.cv.SignalAll();
    if (op.done) return op.status;
    if (g.world->aborted) return g.world->abort_status;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      std::string msg =
          absl::StrCat(op.label, ": ", op.description, " timed out after ", FormatSeconds(timeout));
      if (std::shared_ptr<Coll> c = op.coll.lock(); c && c->phase != 3) {
        std::vector<int> missing;
        for (int r = 0; r < static_cast<int>(c->got.size()); ++r) {
          if (!c->got[r] && c->reqs[r] == MPI_REQUEST_NULL) missing.push_back(r);
        }
        if (!missing.empty()) {
          absl::StrAppend(&msg, "; waiting for ranks ", absl::StrJoin(missing, ", "));
        }
      }
      return absl::DeadlineExceededError(msg);
    }
    // Like MPI_Wait, spin (yielding the core) while data is moving, and for the first 50 us,
    // when an answer is likely to come soon; sleep with a growing backoff otherwise.
    if (now - start < absl::Microseconds(50) || ActivityLocked() == Activity::kTransfer) {
      p.mu.Unlock();
      std::this_thread::yield();
      p.mu.Lock();
      backoff = absl::Microseconds(20);
      continue;
    }
    p.cv.WaitWithTimeout(&p.mu, std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(1));
  }
}

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<Group> group, std::shared_ptr<Op> op)
      : group_(std::move(group)), op_(std::move(op)) {}

  absl::Status Wait(absl::Duration timeout) override { return WaitOp(*group_, *op_, timeout); }

  bool Done() override {
    ProcessState& p = Proc();
    absl::MutexLock lock(&p.mu);
    if (!op_->done && !group_->world->aborted && !group_->closed && ProgressAllLocked()) {
      p.cv.SignalAll();
    }
    return op_->done || group_->world->aborted || group_->closed;
  }

 private:
  std::shared_ptr<Group> group_;
  std::shared_ptr<Op> op_;
};

absl::Status CheckTensor(const Tensor& t, absl::string_view what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(what, ": undefined tensor"));
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the mpi backend needs host tensors, got a tensor on ", t.device().ToString()));
  }
  return absl::OkStatus();
}

void ConfigureTags(Group& g, int tag_ub, const MpiWorldOptions& options) {
  const int64_t direct_max = static_cast<int64_t>(tag_ub) - 1;
  g.max_direct_tag =
      options.max_direct_tag < 0 ? direct_max : std::min(options.max_direct_tag, direct_max);
  g.overflow_tag = static_cast<int>(g.max_direct_tag + 1);
  g.coll_tag_period = (static_cast<int64_t>(tag_ub) + 1) / 2;
}

absl::Status SetErrorsReturn(MPI_Comm comm) {
  return PW_MPI_STATUS(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<Group> group) : g_(std::move(group)) {}

  ~MpiCommunicator() override {
    std::thread join;
    {
      absl::MutexLock lock(&Proc().mu);
      CloseGroupLocked(g_, absl::StatusCode::kCancelled, "the communicator was destroyed", &join);
    }
    if (join.joinable()) join.join();
  }

  int rank() const override { return g_->rank; }
  int size() const override { return g_->size; }
  std::string backend() const override { return "mpi"; }

  std::unique_ptr<Work> Send(const Tensor& t, int peer, int64_t tag) override {
    std::shared_ptr<Op> op = NewOp(absl::StrCat("Send to rank ", peer, " (tag ", tag, ")"));
    absl::Status valid = CheckP2P(t, peer, tag, *op);
    std::shared_ptr<Buffer> packet;
    if (valid.ok()) {  // copy outside the lock
      PacketHeader h;
      h.kind = static_cast<int32_t>(PacketKind::kP2P);
      h.tag = tag;
      h.dtype = static_cast<int32_t>(t.dtype());
      h.numel = t.numel();
      SetShape(h, t);
      absl::StatusOr<std::shared_ptr<Buffer>> b = MakePacket(h, t.raw(), t.nbytes(), "");
      if (b.ok()) {
        packet = *std::move(b);
      } else {
        valid = absl::Status(b.status().code(), absl::StrCat(op->label, ": ", op->description, ": ",
                                                             b.status().message()));
      }
    }
    absl::MutexLock lock(&Proc().mu);
    if (absl::Status s = UsableLocked(); !s.ok()) {
      Complete(*op, s);
    } else if (!valid.ok()) {
      Complete(*op, valid);
    } else {
      absl::Status s = SendP2P(*g_, peer, tag, std::move(packet));
      if (!s.ok()) AbortLocked(*g_->world, s, /*notify=*/true);
      Complete(*op, s);
      Proc().cv.SignalAll();
    }
    return std::make_unique<MpiWork>(g_, std::move(op));
  }

  std::unique_ptr<Work> Recv(Tensor& t, int peer, int64_t tag) override {
    std::shared_ptr<Op> op = NewOp(absl::StrCat("Recv from rank ", peer, " (tag ", tag, ")"));
    absl::Status valid = CheckP2P(t, peer, tag, *op);
    absl::MutexLock lock(&Proc().mu);
    if (absl::Status s = UsableLocked(); !s.ok()) {
      Complete(*op, s);
    } else if (!valid.ok()) {
      Complete(*op, valid);
    } else {
      auto r = std::make_shared<RecvOp>();
      r->op = op;
      r->tensor = t;
      r->peer = peer;
      r->tag = tag;
      const P2PKey key{peer, tag};
      if (tag <= g_->max_direct_tag) {
        g_->direct_pending[key].push_back(std::move(r));
      } else if (auto it = g_->overflow_unexpected.find(key); it != g_->overflow_unexpected.end()) {
        std::shared_ptr<Buffer> b = std::move(it->second.front());
        it->second.pop_front();
        if (it->second.empty()) g_->overflow_unexpected.erase(it);
        DeliverStaged(*r, *b);
      } else {
        g_->overflow_pending[key].push_back(std::move(r));
      }
      ProgressAllLocked();
      Proc().cv.SignalAll();
    }
    return std::make_unique<MpiWork>(g_, std::move(op));
  }

  std::unique_ptr<Work> AllReduce(Tensor& t) override {
    return Join(CollKind::kAllReduce, t, 0, 0, 0, nullptr);
  }

  std::unique_ptr<Work> Broadcast(Tensor& t, int root) override {
    return Join(CollKind::kBroadcast, t, root, 0, 0, nullptr);
  }

  std::unique_ptr<Work> Barrier() override {
    return Join(CollKind::kBarrier, Tensor(), 0, 0, 0, nullptr);
  }

  void Abort(const absl::Status& status) override {
    absl::MutexLock lock(&Proc().mu);
    if (g_->closed) return;
    AbortLocked(*g_->world, status.ok() ? absl::AbortedError("aborted") : status, /*notify=*/true);
  }

  absl::Status abort_status() const override {
    absl::MutexLock lock(&Proc().mu);
    World& w = *g_->world;
    if (!w.aborted && !w.closed) {
      bool progressed = false;
      absl::Status s = ProbeAbortNotices(w, &progressed);
      if (!s.ok()) AbortLocked(w, s, /*notify=*/true);
    }
    return w.aborted ? w.abort_status : absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    {
      absl::MutexLock lock(&Proc().mu);
      if (absl::Status s = UsableLocked(); !s.ok()) return s;
      if (g_->split_broken) {
        return absl::FailedPreconditionError(
            absl::StrCat(g_->label,
                         ": Split: an earlier Split of this communicator failed midway, so the "
                         "ranks' communicator duplications are out of step; it cannot be split "
                         "again"));
      }
    }
    std::shared_ptr<Coll> coll;
    std::unique_ptr<Work> work = Join(CollKind::kSplit, Tensor(), 0, color, key, &coll);
    absl::Status s = work->Wait(timeout);
    absl::MutexLock lock(&Proc().mu);
    if (!s.ok()) {
      if (s.code() == absl::StatusCode::kDeadlineExceeded) g_->split_broken = true;
      return s;
    }
    // Every rank is in this Split: duplicate the parent's communicators (non-blocking, so the
    // deadline still holds if a rank gave up meanwhile).
    MPI_Comm dup[2] = {MPI_COMM_NULL, MPI_COMM_NULL};
    MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    s = PW_MPI_STATUS(MPI_Comm_idup(g_->p2p, &dup[0], &reqs[0]));
    if (s.ok()) s = PW_MPI_STATUS(MPI_Comm_idup(g_->coll, &dup[1], &reqs[1]));
    absl::Duration backoff = absl::Microseconds(10);
    while (s.ok()) {
      int flag = 0;
      s = PW_MPI_STATUS(MPI_Testall(2, reqs, &flag, MPI_STATUSES_IGNORE));
      if (!s.ok() || flag) break;
      if (ProgressAllLocked()) Proc().cv.SignalAll();
      if (g_->world->aborted) {
        s = g_->world->abort_status;
        break;
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        s = absl::DeadlineExceededError(absl::StrCat(
            g_->label, ": Split (collective #", coll->seq, ") timed out after ",
            FormatSeconds(timeout), " in MPI_Comm_idup (a rank left the Split early)"));
        break;
      }
      Proc().cv.WaitWithTimeout(&Proc().mu, std::min(backoff, deadline - now));
      backoff = std::min(backoff * 2, absl::Milliseconds(1));
    }
    if (!s.ok()) {
      g_->split_broken = true;
      for (MPI_Request r : reqs) {
        if (r != MPI_REQUEST_NULL) g_->pending_idups.push_back(r);
      }
      if (s.code() != absl::StatusCode::kDeadlineExceeded && !g_->world->aborted) {
        AbortLocked(*g_->world, s, /*notify=*/true);
      }
      return s;
    }
    if (color < 0) {
      MPI_Comm_free(&dup[0]);
      MPI_Comm_free(&dup[1]);
      return std::unique_ptr<Communicator>();
    }
    std::vector<std::pair<int, int>> members;  // (key, parent rank)
    for (int r = 0; r < g_->size; ++r) {
      if (coll->colors[r] == color) members.push_back({coll->keys[r], r});
    }
    std::sort(members.begin(), members.end());
    World& w = *g_->world;
    auto ng = std::make_shared<Group>();
    ng->world = g_->world;
    ng->id = w.next_group_id++;
    ng->size = static_cast<int>(members.size());
    for (int i = 0; i < ng->size; ++i) {
      if (members[i].second == g_->rank) ng->rank = i;
      ng->mpi_ranks.push_back(g_->mpi_ranks[members[i].second]);
    }
    ng->p2p = dup[0];
    ng->coll = dup[1];
    ng->max_direct_tag = g_->max_direct_tag;
    ng->overflow_tag = g_->overflow_tag;
    ng->coll_tag_period = g_->coll_tag_period;
    ng->label = absl::StrCat("rank ", ng->rank, " (world rank ", w.rank, ", group ", ng->id, ")");
    s = SetErrorsReturn(ng->p2p);
    if (s.ok()) s = SetErrorsReturn(ng->coll);
    if (!s.ok()) {
      MPI_Comm_free(&ng->p2p);
      MPI_Comm_free(&ng->coll);
      AbortLocked(w, s, /*notify=*/true);
      return s;
    }
    w.groups.push_back(ng);
    return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(std::move(ng)));
  }

 private:
  std::shared_ptr<Op> NewOp(std::string description) const {
    auto op = std::make_shared<Op>();
    op->label = g_->label;
    op->description = std::move(description);
    return op;
  }

  absl::Status UsableLocked() const {
    if (g_->closed) return g_->closed_status;
    if (g_->world->aborted) return g_->world->abort_status;
    return absl::OkStatus();
  }

  absl::Status CheckP2P(const Tensor& t, int peer, int64_t tag, const Op& op) const {
    if (peer < 0 || peer >= g_->size) {
      return absl::InvalidArgumentError(absl::StrCat(op.label, ": ", op.description, ": peer ",
                                                     peer, " is out of range [0, ", g_->size, ")"));
    }
    if (tag < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(op.label, ": ", op.description, ": negative tag ", tag));
    }
    return CheckTensor(t, absl::StrCat(op.label, ": ", op.description));
  }

  absl::Status CheckArrival(CollKind kind, const Tensor& t, int root, const Op& op) const {
    const std::string what = absl::StrCat(op.label, ": ", op.description);
    switch (kind) {
      case CollKind::kAllReduce: {
        PW_RETURN_IF_ERROR(CheckTensor(t, what));
        const DType d = t.dtype();
        if (d != DType::kF32 && d != DType::kF64 && d != DType::kI32) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": AllReduce supports f32, f64 and i32, got ", DTypeName(d)));
        }
        return absl::OkStatus();
      }
      case CollKind::kBroadcast:
        PW_RETURN_IF_ERROR(CheckTensor(t, what));
        if (root < 0 || root >= g_->size) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": root ", root, " is out of range [0, ", g_->size, ")"));
        }
        return absl::OkStatus();
      case CollKind::kBarrier:
      case CollKind::kSplit:
        return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  // Starts collective #seq: builds and sends the phase-1 packets and registers the state.
  std::unique_ptr<Work> Join(CollKind kind, const Tensor& t, int root, int color, int key,
                             std::shared_ptr<Coll>* coll_out) {
    const int64_t seq = next_seq_++;
    std::shared_ptr<Op> op = NewOp(absl::StrCat(KindName(kind), " (collective #", seq, ")"));
    auto c = std::make_shared<Coll>();
    c->seq = seq;
    c->kind = kind;
    c->op = op;
    c->root = root;
    if (coll_out) *coll_out = c;
    const absl::Status valid = CheckArrival(kind, t, root, *op);
    if (valid.ok()) c->tensor = t;

    PacketHeader& h = c->mine;
    h.kind = static_cast<int32_t>(PacketKind::kCollective);
    h.tag = seq;
    h.coll_kind = static_cast<int32_t>(kind);
    h.root = root;
    h.color = color;
    h.key = key;
    h.sender = g_->rank;
    h.code = static_cast<int32_t>(valid.code());
    if (t.defined()) {
      h.dtype = static_cast<int32_t>(t.dtype());
      h.numel = t.numel();
    }
    SetShape(h, t);
    c->my_error = std::string(valid.message());

    // Phase-1 packets, built outside the lock: one per peer (AllReduce chunks) or one for all.
    std::vector<std::shared_ptr<Buffer>> packets(g_->size);
    absl::Status built;
    if (valid.ok() && kind == CollKind::kAllReduce) {
      const size_t es = DTypeSize(t.dtype());
      for (int p = 0; p < g_->size && built.ok(); ++p) {
        if (p == g_->rank) continue;
        const auto [lo, hi] = Chunk(t.numel(), g_->size, p);
        absl::StatusOr<std::shared_ptr<Buffer>> b = MakePacket(
            h, static_cast<const char*>(t.raw()) + lo * es, static_cast<size_t>(hi - lo) * es, "");
        if (b.ok()) packets[p] = *std::move(b);
        built = b.status();
      }
    } else {
      const bool data = valid.ok() && kind == CollKind::kBroadcast && root == g_->rank;
      absl::StatusOr<std::shared_ptr<Buffer>> b =
          MakePacket(h, data ? t.raw() : nullptr, data ? t.nbytes() : 0, c->my_error);
      if (b.ok()) {
        for (int p = 0; p < g_->size; ++p) packets[p] = *b;
      }
      built = b.status();
    }

    absl::MutexLock lock(&Proc().mu);
    if (absl::Status s = UsableLocked(); !s.ok()) {
      Complete(*op, s);
      return std::make_unique<MpiWork>(g_, std::move(op));
    }
    absl::Status s = built;
    for (int p = 0; p < g_->size && s.ok(); ++p) {
      if (p == g_->rank) continue;
      s = PostSend(*g_, g_->coll, g_->mpi_ranks[p], CollTag(*g_, seq, 1), packets[p], &g_->sends);
    }
    if (!s.ok()) {
      AbortLocked(*g_->world, s, /*notify=*/true);
      Complete(*op, s);
      return std::make_unique<MpiWork>(g_, std::move(op));
    }
    if (!valid.ok()) Complete(*op, valid);  // fails at once; its peers learn it from the packet
    StartPhase(*g_, *c, 1);
    op->coll = c;
    g_->colls.push_back(std::move(c));
    ProgressAllLocked();
    Proc().cv.SignalAll();  // the progress thread polls faster while work is outstanding
    return std::make_unique<MpiWork>(g_, std::move(op));
  }

  std::shared_ptr<Group> g_;
  std::atomic<int64_t> next_seq_{0};
};

const char* ThreadLevelName(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

bool EnvSet(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

}  // namespace

bool LaunchedByMpi() {
  if (const char* v = std::getenv("PIPEWRIGHT_MPI"); v != nullptr && v[0] != '\0') {
    std::string s(v);
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (s == "0" || s == "off" || s == "false" || s == "no") return false;
    if (s == "1" || s == "on" || s == "true" || s == "yes") return true;
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) return true;
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}) {
    if (EnvSet(name)) return true;
  }
  return false;
}

absl::StatusOr<MpiProcess> InitMpi() {
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  if (p.have_info) return p.info;
  if (!p.init_error.ok()) return p.init_error;
  int initialized = 0, finalized = 0;
  PW_MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
  PW_MPI_RETURN_IF_ERROR(MPI_Finalized(&finalized));
  if (finalized || p.finalized) {
    return absl::FailedPreconditionError(
        "InitMpi: MPI was finalized; it cannot be initialized again");
  }
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    if (!LaunchedByMpi()) {
      return absl::FailedPreconditionError(
          "InitMpi: this process was not started by an MPI launcher (none of "
          "OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK, PMI_SIZE, MV2_COMM_WORLD_SIZE is set); run "
          "it under mpirun/mpiexec or srun --mpi=pmix, or set PIPEWRIGHT_MPI=1 to start a "
          "single-process MPI world");
    }
    PW_MPI_RETURN_IF_ERROR(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    p.we_initialized = true;
    std::atexit([] { FinalizeMpi(); });
    PW_RETURN_IF_ERROR(SetErrorsReturn(MPI_COMM_WORLD));
  } else {
    PW_MPI_RETURN_IF_ERROR(MPI_Query_thread(&provided));
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    p.init_error = absl::FailedPreconditionError(absl::StrCat(
        "InitMpi: MPI provides only ", ThreadLevelName(provided),
        "; the mpi backend calls MPI from the thread that waits on an operation and from its "
        "progress thread (one at a time, under a lock), which needs at least "
        "MPI_THREAD_SERIALIZED (MPI_THREAD_MULTIPLE was requested)"));
    return p.init_error;
  }
  MpiProcess info;
  info.thread_multiple = provided >= MPI_THREAD_MULTIPLE;
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_rank(MPI_COMM_WORLD, &info.rank));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_size(MPI_COMM_WORLD, &info.size));
  MPI_Comm node = MPI_COMM_NULL;
  PW_MPI_RETURN_IF_ERROR(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, info.rank, MPI_INFO_NULL, &node));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_rank(node, &info.local_rank));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_size(node, &info.local_size));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_free(&node));
  char name[MPI_MAX_PROCESSOR_NAME + 1] = {};
  int len = 0;
  PW_MPI_RETURN_IF_ERROR(MPI_Get_processor_name(name, &len));
  info.hostname.assign(name, static_cast<size_t>(std::max(len, 0)));
  p.info = info;
  p.have_info = true;
  return info;
}

void FinalizeMpi() {
  ProcessState& p = Proc();
  std::thread join;
  {
    absl::MutexLock lock(&p.mu);
    const std::vector<std::shared_ptr<World>> worlds = p.worlds;
    for (const std::shared_ptr<World>& w : worlds) {
      const std::vector<std::shared_ptr<Group>> groups = w->groups;
      for (const std::shared_ptr<Group>& g : groups) {
        std::thread t;
        CloseGroupLocked(g, absl::StatusCode::kFailedPrecondition,
                         "MPI was finalized (FinalizeMpi)", &t);
        if (t.joinable()) join = std::move(t);
      }
    }
    if (std::thread t = StopProgressThreadLocked(); t.joinable()) join = std::move(t);
  }
  if (join.joinable()) join.join();
  absl::MutexLock lock(&p.mu);
  if (p.we_initialized && !p.finalized) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
    p.finalized = true;
    p.have_info = false;
  }
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(const MpiWorldOptions& options) {
  PW_ASSIGN_OR_RETURN(MpiProcess proc, InitMpi());
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  if (p.finalized) return absl::FailedPreconditionError("CreateMpiWorld: MPI was finalized");
  int* tag_ub_attr = nullptr;
  int flag = 0;
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub_attr, &flag));
  const int tag_ub = flag && tag_ub_attr != nullptr ? *tag_ub_attr : 32767;  // the MPI minimum

  auto w = std::make_shared<World>();
  w->rank = proc.rank;
  w->size = proc.size;
  w->options = options;
  w->options.max_block_bytes = std::clamp<int64_t>(options.max_block_bytes, 1, INT_MAX);
  if (w->options.drain_timeout < absl::ZeroDuration())
    w->options.drain_timeout = absl::ZeroDuration();
  auto g = std::make_shared<Group>();
  g->world = w;
  g->id = 0;
  g->rank = proc.rank;
  g->size = proc.size;
  for (int r = 0; r < proc.size; ++r) g->mpi_ranks.push_back(r);
  g->label = absl::StrCat("rank ", proc.rank);
  ConfigureTags(*g, tag_ub, options);
  // Collective and blocking: every process creates its world together.
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &w->control));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &g->p2p));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_dup(MPI_COMM_WORLD, &g->coll));
  for (MPI_Comm c : {w->control, g->p2p, g->coll}) PW_RETURN_IF_ERROR(SetErrorsReturn(c));
  w->groups.push_back(g);
  p.worlds.push_back(w);
  StartProgressThreadLocked();
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(std::move(g)));
}

}  // namespace pipewright
