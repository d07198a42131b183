#include "runtime/comm/comm_core.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"

namespace pipewright::comm_internal {

const char* KindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "AllReduce";
    case CollectiveKind::kBroadcast:
      return "Broadcast";
    case CollectiveKind::kBarrier:
      return "Barrier";
    case CollectiveKind::kSplit:
      return "Split";
    case CollectiveKind::kAllGather:
      return "AllGather";
    case CollectiveKind::kReduceScatter:
      return "ReduceScatter";
  }
  return "collective";
}

std::string CollectiveDescription(CollectiveKind kind, int64_t seq) {
  return absl::StrCat(KindName(kind), " (collective #", seq, ")");
}

std::string SendDescription(int peer, int64_t tag) {
  return absl::StrCat("Send to rank ", peer, " (tag ", tag, ")");
}

std::string RecvDescription(int peer, int64_t tag) {
  return absl::StrCat("Recv from rank ", peer, " (tag ", tag, ")");
}

std::string FormatSeconds(absl::Duration d) { return absl::StrCat(absl::ToDoubleSeconds(d), "s"); }

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

absl::Status CheckPeerAndTag(int peer, int64_t tag, int size) {
  if (peer < 0 || peer >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer, " is out of range [0, ", size, ")"));
  }
  if (tag < 0) return absl::InvalidArgumentError(absl::StrCat("negative tag ", tag));
  return absl::OkStatus();
}

absl::Status CheckRoot(int root, int size) {
  if (root < 0 || root >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("root ", root, " is out of range [0, ", size, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckReduceDType(DType dtype, CollectiveKind kind) {
  if (dtype != DType::kF32 && dtype != DType::kF64 && dtype != DType::kI32) {
    return absl::InvalidArgumentError(
        absl::StrCat(KindName(kind), " supports f32, f64 and i32, got ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

namespace {

// `whole` ("the output" of AllGather, "the input" of ReduceScatter) has part's dtype and
// size * part.numel() elements.
absl::Status CheckSizeTimesLayout(const Tensor& whole, absl::string_view whole_name,
                                  const Tensor& part, absl::string_view part_name, int size) {
  if (whole.dtype() != part.dtype() || whole.numel() != size * part.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        whole_name, " ", whole.ShapeString(), " must have ", size * part.numel(), " elements of ",
        DTypeName(part.dtype()), " (", size, " ranks x ", part_name, " ", part.ShapeString(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckGatherLayout(const Tensor& in, const Tensor& out, int size) {
  return CheckSizeTimesLayout(out, "the output", in, "the input", size);
}

absl::Status CheckScatterLayout(const Tensor& in, const Tensor& out, int size) {
  return CheckSizeTimesLayout(in, "the input", out, "the output", size);
}

absl::Status CheckTensor(const Tensor& t, absl::string_view what, CommBackend backend,
                         const CommCapabilities& caps) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(what, ": undefined tensor"));
  const bool on_host = t.device().is_cpu();
  if (on_host ? !caps.host_memory : !caps.device_memory) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the ", CommBackendName(backend), " backend needs ", on_host ? "device" : "host",
        " tensors, got a tensor on ", t.device().ToString()));
  }
  return absl::OkStatus();
}

absl::Status CheckP2P(const Tensor& t, int peer, int64_t tag, int size, absl::string_view what,
                      CommBackend backend, const CommCapabilities& caps) {
  PW_RETURN_IF_ERROR(Annotate(CheckPeerAndTag(peer, tag, size), what));
  return CheckTensor(t, what, backend, caps);
}

absl::Status CheckCollective(CollectiveKind kind, const CollectiveArgs& args, int size,
                             absl::string_view what, CommBackend backend,
                             const CommCapabilities& caps) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      PW_RETURN_IF_ERROR(CheckTensor(args.tensor, what, backend, caps));
      return Annotate(CheckReduceDType(args.tensor.dtype(), CollectiveKind::kAllReduce), what);
    case CollectiveKind::kBroadcast:
      PW_RETURN_IF_ERROR(CheckTensor(args.tensor, what, backend, caps));
      return Annotate(CheckRoot(args.root, size), what);
    case CollectiveKind::kAllGather:
      PW_RETURN_IF_ERROR(CheckTensor(args.tensor, absl::StrCat(what, " (input)"), backend, caps));
      PW_RETURN_IF_ERROR(CheckTensor(args.out, absl::StrCat(what, " (output)"), backend, caps));
      return Annotate(CheckGatherLayout(args.tensor, args.out, size), what);
    case CollectiveKind::kReduceScatter:
      PW_RETURN_IF_ERROR(CheckTensor(args.tensor, absl::StrCat(what, " (input)"), backend, caps));
      PW_RETURN_IF_ERROR(CheckTensor(args.out, absl::StrCat(what, " (output)"), backend, caps));
      PW_RETURN_IF_ERROR(
          Annotate(CheckReduceDType(args.tensor.dtype(), CollectiveKind::kReduceScatter), what));
      return Annotate(CheckScatterLayout(args.tensor, args.out, size), what);
    case CollectiveKind::kBarrier:
    case CollectiveKind::kSplit:
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

CollectiveCall CallOf(CollectiveKind kind, const Tensor& t, int root) {
  CollectiveCall c;
  c.kind = kind;
  c.root = root;
  if (t.defined()) {
    c.dtype = static_cast<int32_t>(t.dtype());
    c.numel = t.numel();
    c.shape = t.ShapeString();
  } else {
    c.shape = "undefined";
  }
  return c;
}

absl::Status CheckAgreement(int64_t seq, const CollectiveCall& call, absl::string_view who,
                            const CollectiveCall& first, absl::string_view first_who) {
  if (call.kind != first.kind) {
    return absl::InvalidArgumentError(absl::StrCat("collective #", seq, ": ", who, " called ",
                                                   KindName(call.kind), " but ", first_who,
                                                   " called ", KindName(first.kind)));
  }
  const bool has_tensor =
      call.kind == CollectiveKind::kAllReduce || call.kind == CollectiveKind::kBroadcast ||
      call.kind == CollectiveKind::kAllGather || call.kind == CollectiveKind::kReduceScatter;
  if (has_tensor && (call.dtype != first.dtype || call.numel != first.numel)) {
    return absl::InvalidArgumentError(absl::StrCat(CollectiveDescription(call.kind, seq), ": ", who,
                                                   " passed ", call.shape, " but ", first_who,
                                                   " passed ", first.shape));
  }
  if (call.kind == CollectiveKind::kBroadcast && call.root != first.root) {
    return absl::InvalidArgumentError(absl::StrCat("Broadcast (collective #", seq, "): ", who,
                                                   " passed root ", call.root, " but ", first_who,
                                                   " passed root ", first.root));
  }
  return absl::OkStatus();
}

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
      PW_CHECK(false);  // rejected on arrival (CheckReduceDType)
  }
}

void RankOrderSum(DType dtype, void* acc, const std::vector<const void*>& inputs, int64_t n) {
  PW_CHECK(!inputs.empty());
  if (n <= 0) return;
  // acc = x0; acc += x1; acc += x2; ...: per element ((x0 + x1) + x2) + ...
  if (inputs[0] != acc) std::memcpy(acc, inputs[0], static_cast<size_t>(n) * DTypeSize(dtype));
  for (size_t r = 1; r < inputs.size(); ++r) AccumulateAny(dtype, acc, inputs[r], n);
}

bool OverlapsAny(const void* p, size_t bytes, const std::vector<const void*>& others,
                 size_t other_bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const void* o : others) {
    const auto b = reinterpret_cast<uintptr_t>(o);
    if (o != nullptr && a < b + other_bytes && b < a + bytes) return true;
  }
  return false;
}

absl::Status TimedOut(absl::string_view what, absl::Duration timeout, absl::string_view detail) {
  return absl::DeadlineExceededError(
      absl::StrCat(what, " timed out after ", FormatSeconds(timeout), detail));
}

std::string WaitingForRanks(const std::vector<int>& missing) {
  if (missing.empty()) return "";
  return absl::StrCat("; waiting for ranks ", absl::StrJoin(missing, ", "));
}

}  // namespace pipewright::comm_internal
