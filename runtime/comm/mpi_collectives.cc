// The MPI backend's collectives (mpi_internal.h). Collective #k of a group travels with the MPI
// tags CollTag(k, phase) on the group's collective communicator. Phase 1: every rank sends every
// other rank a header (its kind, layout, root, color/key or its own argument error) and the data
// that rank needs; every rank reaches the same verdict from the same N headers (Verdict). Barrier
// and Split end there; Broadcast copies the root's payload; AllGather places every rank's input
// at its offset of the output; ReduceScatter sums this rank's chunk over all ranks in rank order
// (Note [rank-order sum] in comm_core.h) into the output; AllReduce sums this rank's chunk the
// same way and phase 2 sends the summed chunks to everyone.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"
#include "runtime/comm/comm_core.h"
#include "runtime/comm/mpi_internal.h"

namespace pipewright::mpi_internal {
namespace {

// Elements [lo, hi) of the input that rank r sums: ReduceScatter's chunks are the caller's
// (out.numel() elements each); AllReduce splits its tensor as evenly as it can.
std::pair<int64_t, int64_t> Chunk(const Coll& c, int ranks, int r) {
  if (c.kind == CollectiveKind::kReduceScatter) {
    const int64_t n = c.out.numel();
    return {r * n, (r + 1) * n};
  }
  const int64_t numel = c.tensor.numel();
  const int64_t base = numel / ranks, rem = numel % ranks;
  const int64_t lo = r * base + std::min<int64_t>(r, rem);
  return {lo, lo + base + (r < rem ? 1 : 0)};
}

// OK when every peer's phase-1 payload has `bytes` bytes (`what_for`: "an input", "a chunk").
absl::Status CheckPayloadBytes(const Group& g, const std::vector<int64_t>& payload_bytes,
                               size_t bytes, const std::string& what, const char* what_for) {
  for (int r = 0; r < g.size; ++r) {
    if (r != g.rank && payload_bytes[r] != static_cast<int64_t>(bytes)) {
      return absl::InternalError(absl::StrCat(what, ": protocol error: rank ", r, " sent ",
                                              payload_bytes[r], " bytes for ", what_for, " of ",
                                              bytes));
    }
  }
  return absl::OkStatus();
}

// A rank's call as its header tells it.
comm_internal::CollectiveCall CallOf(const PacketHeader& h) {
  comm_internal::CollectiveCall call;
  call.kind = static_cast<CollectiveKind>(h.coll_kind);
  call.dtype = h.dtype;
  call.numel = h.numel;
  call.shape = ShapeOf(h);
  call.root = h.root;
  return call;
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
  const comm_internal::CollectiveCall first = CallOf(h[0]);
  for (size_t r = 1; r < h.size(); ++r) {
    PW_RETURN_IF_ERROR(comm_internal::CheckAgreement(c.seq, CallOf(h[r]), absl::StrCat("rank ", r),
                                                     first, "rank 0"));
  }
  return absl::OkStatus();
}

void FinishColl(Coll& c) {
  c.phase = 3;
  c.bufs.clear();
  c.tensor = Tensor();
  c.out = Tensor();
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
      case CollectiveKind::kBarrier:
        break;
      case CollectiveKind::kSplit:
        c.colors.resize(g.size);
        c.keys.resize(g.size);
        for (int r = 0; r < g.size; ++r) {
          c.colors[r] = h[r].color;
          c.keys[r] = h[r].key;
        }
        break;
      case CollectiveKind::kBroadcast:
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
      case CollectiveKind::kAllGather: {
        // Rank r's input at [r * bytes, (r + 1) * bytes) of the output, this rank's own first.
        const size_t bytes = c.tensor.nbytes();
        char* out = static_cast<char*>(c.out.raw());
        PW_RETURN_IF_ERROR(CheckPayloadBytes(g, payload_bytes, bytes, what, "an input"));
        if (bytes > 0 && out + g.rank * bytes != c.tensor.raw()) {
          std::memmove(out + g.rank * bytes, c.tensor.raw(), bytes);
        }
        for (int r = 0; r < g.size; ++r) {
          if (r != g.rank && bytes > 0) std::memcpy(out + r * bytes, payload[r], bytes);
        }
        break;
      }
      case CollectiveKind::kReduceScatter: {
        // Note [rank-order sum] over this rank's chunk, straight into `out`, or through a
        // temporary when `out` overlaps this rank's chunk of `in` (in place).
        const auto [lo, hi] = Chunk(c, g.size, g.rank);
        const size_t bytes = static_cast<size_t>(hi - lo) * es;
        PW_RETURN_IF_ERROR(CheckPayloadBytes(g, payload_bytes, bytes, what, "a chunk"));
        const char* mine = static_cast<const char*>(c.tensor.raw()) + lo * es;
        std::vector<const void*> terms(g.size);
        for (int r = 0; r < g.size; ++r) terms[r] = r == g.rank ? mine : payload[r];
        if (g.size > 1 && comm_internal::OverlapsAny(c.out.raw(), bytes, terms, bytes)) {
          std::vector<char> tmp(bytes);
          comm_internal::RankOrderSum(c.tensor.dtype(), tmp.data(), terms, hi - lo);
          if (bytes > 0) std::memcpy(c.out.raw(), tmp.data(), bytes);
        } else {
          comm_internal::RankOrderSum(c.tensor.dtype(), c.out.raw(), terms, hi - lo);
        }
        break;
      }
      case CollectiveKind::kAllReduce: {
        // Note [rank-order sum] over this rank's chunk: acc = x0; acc += x1; acc += x2; ...
        const auto [lo, hi] = Chunk(c, g.size, g.rank);
        const size_t bytes = static_cast<size_t>(hi - lo) * es;
        char* mine = static_cast<char*>(c.tensor.raw()) + lo * es;
        PW_RETURN_IF_ERROR(CheckPayloadBytes(g, payload_bytes, bytes, what, "a chunk"));
        PacketHeader out = c.mine;
        out.code = 0;
        PW_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> packet,
                            MakePacket(out, g.rank == 0 ? mine : payload[0], bytes, ""));
        char* acc = packet->payload();  // holds x0 already
        std::vector<const void*> terms(g.size);
        for (int r = 0; r < g.size; ++r) terms[r] = r == 0 ? acc : r == g.rank ? mine : payload[r];
        comm_internal::RankOrderSum(c.tensor.dtype(), acc, terms, hi - lo);
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
    const auto [lo, hi] = Chunk(c, g.size, r);
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

}  // namespace

int CollTag(const Group& g, int64_t seq, int phase) {
  return static_cast<int>((seq % g.coll_tag_period) * 2 + (phase - 1));
}

void StartPhase(Group& g, Coll& c, int phase) {
  c.phase = phase;
  c.bufs.assign(g.size, nullptr);
  c.reqs.assign(g.size, MPI_REQUEST_NULL);
  c.got.assign(g.size, 0);
  c.got[g.rank] = 1;
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

absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> Phase1Packets(const Group& g, const Coll& c,
                                                                   const Tensor& t, bool valid) {
  std::vector<std::shared_ptr<Buffer>> packets(g.size);
  if (valid && (c.kind == CollectiveKind::kAllReduce || c.kind == CollectiveKind::kReduceScatter)) {
    // Peer p's chunk of the input, which p sums.
    const size_t es = DTypeSize(t.dtype());
    for (int p = 0; p < g.size; ++p) {
      if (p == g.rank) continue;
      const auto [lo, hi] = Chunk(c, g.size, p);
      PW_ASSIGN_OR_RETURN(packets[p],
                          MakePacket(c.mine, static_cast<const char*>(t.raw()) + lo * es,
                                     static_cast<size_t>(hi - lo) * es, ""));
    }
    return packets;
  }
  const bool data = valid && ((c.kind == CollectiveKind::kBroadcast && c.root == g.rank) ||
                              c.kind == CollectiveKind::kAllGather);
  PW_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b, MakePacket(c.mine, data ? t.raw() : nullptr,
                                                            data ? t.nbytes() : 0, c.my_error));
  for (int p = 0; p < g.size; ++p) packets[p] = b;
  return packets;
}

}  // namespace pipewright::mpi_internal
