// What the ops' implementations share (internal; runtime/ops/ops.cc, llama_ops.cc): the CUDA
// switch, the argument check and the split of a kernel's outputs over the rank's threads.
#ifndef PIPEWRIGHT_RUNTIME_OPS_OPS_INTERNAL_H_
#define PIPEWRIGHT_RUNTIME_OPS_OPS_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/parallel.h"

namespace pipewright::ops {

#if PIPEWRIGHT_WITH_CUDA
inline constexpr bool kWithCuda = true;
#else
inline constexpr bool kWithCuda = false;
#endif

inline absl::Status Need(bool ok, const char* op, const std::string& what) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// Note [CPU ops on the rank's threads]. The CPU branch splits each kernel's independent outputs
// over the calling rank's threads (kernels/cpu/parallel.h; the engine makes them current): rows
// of the row kernels (LayerNorm, bias + GELU, cross-entropy), flat ranges of the elementwise
// ones and the optimizers, (batch, head) pairs of attention, sequences of the embedding, and
// blocks of C in cpu::Gemm itself. An element's bits do not depend on the range a kernel call
// covers (Note [Same bits for every chunking] in kernels/cpu/vec.h), so results do not depend on
// the thread count. Sums over rows (the bias and LayerNorm weight gradients, the fused bias +
// GELU backward's) are cut by columns: each column still adds its rows in row order on one
// thread. What stays on one thread: the embedding's scatter-add and the gradient norm's sum of
// squares; the cross-entropy total adds per-row losses in row order like the kernel.
inline constexpr int64_t kMinChunk = 16384;  // floats per part at least: ~10 us of work

// fn(begin, count) over the parts of [0, n), each at least `grain` indices (ParallelFor).
template <typename Fn>
inline void OnThreads(int64_t n, int64_t grain, Fn fn) {
  cpu::ParallelFor(n, grain, [&](int64_t begin, int64_t end) { fn(begin, end - begin); });
}

// Rows per part for rows of `cols` floats.
inline int64_t RowGrain(int64_t cols) {
  return std::max<int64_t>(1, kMinChunk / std::max<int64_t>(1, cols));
}

// Columns per part for the column sums over `rows` rows: whole vectors (16 floats), at least
// kMinChunk floats of work. A column's sum is the same whichever columns a call covers.
inline int64_t ColumnGrain(int64_t rows) {
  constexpr int64_t kAlign = 16;
  const int64_t cols = kMinChunk / std::max<int64_t>(1, rows);
  return std::max<int64_t>(kAlign, (cols + kAlign - 1) / kAlign * kAlign);
}

}  // namespace pipewright::ops

#endif  // PIPEWRIGHT_RUNTIME_OPS_OPS_INTERNAL_H_
