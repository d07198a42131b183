// An exact, order-independent sum of non-negative doubles, for the squared gradient norm
// (Note [Exact norm] in exact_sum.cc).
#ifndef PIPEWRIGHT_RUNTIME_DATA_PARALLEL_EXACT_SUM_H_
#define PIPEWRIGHT_RUNTIME_DATA_PARALLEL_EXACT_SUM_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "pipewright/ops.h"
#include "pipewright/tensor.h"

namespace pipewright::internal {

// The elements a gradient's squared norm is summed over in one piece (Note [Exact norm]): chunks
// of this many elements from each tensor's first, so that the pieces do not depend on how the
// tensor is split between ranks, as long as every split falls on a chunk boundary.
inline constexpr int64_t kNormChunk = 2048;

class ExactSum {
 public:
  // Fixed-point limbs of 32 bits: bit 0 of limb 0 weighs 2^kLowExp.
  static constexpr int kLimbs = 22;
  static constexpr int kLowExp = -384;
  // Slots of a serialized sum: the limbs, then the counts of infinities and NaNs.
  static constexpr int kSlots = kLimbs + 2;

  // Adds x (>= 0, or +inf/NaN): exactly for every x in [2^-331, 2^300) (every square of a float
  // and every sum of up to 2^31 of them); the bits of a smaller x under 2^-384 are dropped, and a
  // larger one counts as an infinity.
  void Add(double x);
  // This sum as kSlots doubles, every one an integer below 2^32 (limbs) or a count, so that the
  // slots of many sums can be added by an ordinary f64 all-reduce without rounding (below 2^21
  // ranks) and read back with FromSlots: the result is the exact sum of all of them.
  void ToSlots(double* out);
  static ExactSum FromSlots(const double* in);
  // The sum rounded once to the nearest double (ties to even); +inf if an infinity was added, or
  // the sum overflowed, and NaN if a NaN was.
  double Round();

 private:
  void Normalize();  // carries: every limb below 2^32 (an overflow of the top limb: inf_)

  std::array<uint64_t, kLimbs> limbs_{};
  int64_t adds_ = 0;  // since the last Normalize (each add puts < 2^32 in a limb)
  double inf_ = 0, nan_ = 0;
};

// Adds to `sum` the squares of t's elements [begin, end), chunk by chunk (kNormChunk elements
// counted from the tensor's element 0; `begin` must be a chunk boundary): each chunk's sum of
// squares in double (ops::SquareSumsByChunk) is one term. Runs on `e`'s device.
absl::Status AddChunkSquares(const ops::Exec& e, const Tensor& t, int64_t begin, int64_t end,
                             ExactSum* sum);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_DATA_PARALLEL_EXACT_SUM_H_
