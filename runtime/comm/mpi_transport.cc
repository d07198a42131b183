// The MPI backend's transport (mpi_internal.h): the packets every message is made of and the
// buffers that own them, derived datatypes for messages past MPI's int counts, point-to-point
// messages (direct tags as header + payload, larger tags dispatched by the header), and the abort
// notices on a world's control communicator. Everything here runs under ProcessState::mu.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iterator>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"
#include "runtime/comm/mpi_internal.h"

namespace pipewright::mpi_internal {
namespace {

std::string MismatchMessage(const Op& op, const PacketHeader& h, const Tensor& t) {
  return absl::StrCat(op.label, ": ", op.description, ": message of ", h.payload_bytes, " bytes (",
                      ShapeOf(h), ") does not match the receive buffer of ", t.nbytes(), " bytes (",
                      t.ShapeString(), ")");
}

bool SameLayout(const PacketHeader& h, const Tensor& t) {
  return h.dtype == static_cast<int32_t>(t.dtype()) && h.numel == t.numel() &&
         h.payload_bytes == static_cast<int64_t>(t.nbytes());
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

}  // namespace

void SetShape(PacketHeader& h, const Tensor& t) {
  const std::string s = t.defined() ? t.ShapeString() : std::string("undefined");
  std::snprintf(h.shape, sizeof(h.shape), "%s", s.c_str());
}

std::string ShapeOf(const PacketHeader& h) {
  return std::string(h.shape, strnlen(h.shape, sizeof(h.shape)));
}

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

// ---- Abort notices ----

void ParkActiveReceives(Group& g) {
  for (auto& [key, q] : g.direct_pending) {
    for (std::shared_ptr<RecvOp>& r : q) {
      if (r->req != MPI_REQUEST_NULL) g.direct_inflight.push_back(r);
    }
  }
}

void AbortLocked(World& w, const absl::Status& status, bool notify) {
  if (w.aborted || w.closed) return;
  w.aborted = true;
  w.abort_status = status;
  // The process failed: at exit it must not wait on its peers without bound (FinalizeMpi).
  if (Proc().failure_exit_code == 0) Proc().failure_exit_code = 1;
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
    MarkRelayedAbort(&cause);
    AbortLocked(w, cause, /*notify=*/false);
  }
}

// ---- Point to point ----

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

}  // namespace pipewright::mpi_internal
