// What the communicator backends (local.cc, mpi_*.cc, nccl.cc) share: the collective kinds and
// their names, argument checks and their error texts, the rank-order sum, and timeout messages.
// Runtime-internal: nothing outside runtime/comm/ includes it.
//
// Note [rank-order sum]. AllReduce and ReduceScatter on the local and MPI backends are
// bit-identical because both compute every element as ((x0 + x1) + x2) + ... in group-rank
// order, with the same float operations, through RankOrderSum below (the MPI backend over one
// chunk of the tensor per rank, the local backend over the whole tensor or, for ReduceScatter,
// over each rank's chunk). An element's sum does not depend on which chunk it is summed in, so
// ReduceScatter's chunk r is AllReduce's elements [r * n, (r + 1) * n) bit for bit. Changing the
// order, fusing, vectorising with reassociation or widening the accumulator changes the bits and
// breaks the tests that compare the backends (comm_test, mpi_comm_test).
#ifndef PIPEWRIGHT_RUNTIME_COMM_COMM_CORE_H_
#define PIPEWRIGHT_RUNTIME_COMM_COMM_CORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/tensor.h"

namespace pipewright::comm_internal {

// The collectives. The values travel in the MPI backend's packet headers: never renumber.
enum class CollectiveKind : int32_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kBarrier = 3,
  kSplit = 4,
  kAllGather = 5,
  kReduceScatter = 6,
};

// "AllReduce", "AllGather", ...
const char* KindName(CollectiveKind kind);
// "AllGather (collective #3)": how an operation names itself in errors.
std::string CollectiveDescription(CollectiveKind kind, int64_t seq);
// "Send to rank 1 (tag 3)", "Recv from rank 0 (tag 17)".
std::string SendDescription(int peer, int64_t tag);
std::string RecvDescription(int peer, int64_t tag);

// "0.05s".
std::string FormatSeconds(absl::Duration d);

// `s` with `what: ` in front of its message (same code); OK stays OK.
absl::Status Annotate(const absl::Status& s, absl::string_view what);

// ---- Argument checks (no prefix unless they take `what`) ----

// "peer 2 is out of range [0, 2)", "negative tag -3".
absl::Status CheckPeerAndTag(int peer, int64_t tag, int size);
// "root 3 is out of range [0, 3)".
absl::Status CheckRoot(int root, int size);
// "AllReduce supports f32, f64 and i32, got bf16" (`kind`, the reducing collective, is named).
absl::Status CheckReduceDType(DType dtype, CollectiveKind kind);
// AllGather's `out` has in's dtype and size * in.numel() elements; else "the output [5] f32 must
// have 6 elements of f32 (2 ranks x the input [3] f32)".
absl::Status CheckGatherLayout(const Tensor& in, const Tensor& out, int size);
// ReduceScatter's `in` has out's dtype and size * out.numel() elements; else "the input [5] f32
// must have 6 elements of f32 (2 ranks x the output [3] f32)".
absl::Status CheckScatterLayout(const Tensor& in, const Tensor& out, int size);

// `t` is defined and on a memory the backend accepts (capabilities host_memory/device_memory):
// "what: undefined tensor", "what: the mpi backend needs host tensors, got a tensor on cuda:0".
absl::Status CheckTensor(const Tensor& t, absl::string_view what, CommBackend backend,
                         const CommCapabilities& caps);
// A Send's or Recv's arguments, prefixed with `what`.
absl::Status CheckP2P(const Tensor& t, int peer, int64_t tag, int size, absl::string_view what,
                      CommBackend backend, const CommCapabilities& caps);

// One rank's arguments to a collective (the tensors unused by `kind` may be undefined).
struct CollectiveArgs {
  Tensor tensor;  // AllReduce, Broadcast: the buffer; AllGather, ReduceScatter: `in`
  Tensor out;     // AllGather, ReduceScatter
  int root = 0;   // Broadcast
};
// A rank's own arguments to a collective, checked on their own and prefixed with `what`.
absl::Status CheckCollective(CollectiveKind kind, const CollectiveArgs& args, int size,
                             absl::string_view what, CommBackend backend,
                             const CommCapabilities& caps);

// What the other ranks must agree on: a rank's collective call as its peers see it.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kBarrier;
  int32_t dtype = -1;  // DType of the tensor (AllGather, ReduceScatter: of `in`), -1 without one
  int64_t numel = 0;
  std::string shape;  // "[4] f32", for messages
  int root = 0;
};
CollectiveCall CallOf(CollectiveKind kind, const Tensor& t, int root);
// OK when `call` (made by `who`, e.g. "rank 1") agrees with `first` (made by `first_who`) for
// collective #seq: same kind; same dtype and element count (of `in`) for AllReduce, Broadcast,
// AllGather and ReduceScatter; same root for Broadcast. Else InvalidArgument naming both, e.g.
// "AllReduce (collective #3): rank 1 passed [5] f32 but rank 0 passed [4] f32".
absl::Status CheckAgreement(int64_t seq, const CollectiveCall& call, absl::string_view who,
                            const CollectiveCall& first, absl::string_view first_who);

// ---- The rank-order sum (Note [rank-order sum]) ----

template <typename T>
void Accumulate(T* acc, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}
// Signed overflow wraps (two's complement) instead of being undefined.
void AccumulateI32(int32_t* acc, const int32_t* x, int64_t n);
// acc += x for f32, f64 or i32 (anything else is an internal error: checked on arrival).
void AccumulateAny(DType dtype, void* acc, const void* x, int64_t n);
// acc = ((inputs[0] + inputs[1]) + inputs[2]) + ..., element-wise over n elements. inputs[0] may
// be acc itself (it then already holds the first term); no other input may overlap acc.
void RankOrderSum(DType dtype, void* acc, const std::vector<const void*>& inputs, int64_t n);
// Whether [p, p + bytes) overlaps [o, o + other_bytes) for any non-null o of `others` (an in-place
// reduce-scatter's output is a view of its input).
bool OverlapsAny(const void* p, size_t bytes, const std::vector<const void*>& others,
                 size_t other_bytes);

// ---- Deadlines ----

// "what timed out after 0.2s" + detail, as DeadlineExceeded.
absl::Status TimedOut(absl::string_view what, absl::Duration timeout, absl::string_view detail);
// "; waiting for ranks 1, 3" (empty when nobody is missing): the detail of a collective's timeout.
std::string WaitingForRanks(const std::vector<int>& missing);

}  // namespace pipewright::comm_internal

#endif  // PIPEWRIGHT_RUNTIME_COMM_COMM_CORE_H_
