// ExactSum (exact_sum.h).
//
// Note [Exact norm]. The global gradient norm decides clipping, and the clip factor multiplies
// every update, so every way of running the same step must compute it to the same bits. A
// replicated optimizer has every parameter's summed gradient on one rank of its stage; a sharded
// one (ZeRO) has each rank hold an element range of a flat buffer, cutting tensors anywhere. A
// floating-point sum regrouped by those cuts would round differently. So the norm is defined by
// pieces that every layout computes alike: each tensor is cut into chunks of kNormChunk elements
// from its first element, each chunk's sum of squares is one double (the same kernel on the same
// elements, whoever runs it), and the chunks are added exactly — in a fixed-point accumulator
// wide enough for any of them — and rounded once. Shards are cut on chunk boundaries
// (FlatLayout), each chunk is counted by exactly one rank, and the ranks' accumulators are summed
// in the step agreement's f64 all-reduce as 32-bit limbs, which no sum of fewer than 2^21 ranks
// can round. The result depends on the chunks only: the same at any pp, dp, ZeRO stage or
// backend, and run to run.
#include "runtime/data_parallel/exact_sum.h"

#include <cmath>
#include <limits>

namespace pipewright::internal {

void ExactSum::Add(double x) {
  if (std::isnan(x)) {
    nan_ += 1;
    return;
  }
  if (std::isinf(x) || x >= 0x1p300) {
    inf_ += 1;
    return;
  }
  if (!(x > 0)) return;  // zero (negative inputs are outside the contract)
  int e = 0;
  const double m = std::frexp(x, &e);                        // x = m 2^e, m in [0.5, 1)
  uint64_t mant = static_cast<uint64_t>(std::ldexp(m, 53));  // exact: x = mant 2^(e - 53)
  int pos = e - 53 - kLowExp;
  if (pos < 0) {
    if (pos <= -64) return;
    mant >>= -pos;
    pos = 0;
  }
  const int limb = pos / 32;
  const unsigned __int128 v = static_cast<unsigned __int128>(mant) << (pos % 32);
  limbs_[limb] += static_cast<uint64_t>(v & 0xffffffffu);
  if (limb + 1 < kLimbs) limbs_[limb + 1] += static_cast<uint64_t>((v >> 32) & 0xffffffffu);
  if (limb + 2 < kLimbs) limbs_[limb + 2] += static_cast<uint64_t>(v >> 64);
  if (++adds_ >= (int64_t{1} << 31)) Normalize();
}

void ExactSum::Normalize() {
  uint64_t carry = 0;
  for (uint64_t& l : limbs_) {
    const uint64_t v = l + carry;  // l < 2^63 and carry < 2^32: no wrap
    l = v & 0xffffffffu;
    carry = v >> 32;
  }
  if (carry != 0) inf_ += 1;
  adds_ = 0;
}

void ExactSum::ToSlots(double* out) {
  Normalize();
  for (int i = 0; i < kLimbs; ++i) out[i] = static_cast<double>(limbs_[i]);
  out[kLimbs] = inf_;
  out[kLimbs + 1] = nan_;
}

ExactSum ExactSum::FromSlots(const double* in) {
  ExactSum s;
  for (int i = 0; i < kLimbs; ++i) s.limbs_[i] = static_cast<uint64_t>(in[i]);
  s.inf_ = in[kLimbs];
  s.nan_ = in[kLimbs + 1];
  return s;
}

double ExactSum::Round() {
  Normalize();
  if (nan_ > 0) return std::numeric_limits<double>::quiet_NaN();
  if (inf_ > 0) return std::numeric_limits<double>::infinity();
  int top = kLimbs - 1;
  while (top >= 0 && limbs_[top] == 0) --top;
  if (top < 0) return 0.0;
  // The top three limbs (at least 65 significant bits), with every lower bit folded into the
  // lowest one as a sticky bit, convert with one correct rounding.
  const int low = top >= 2 ? top - 2 : 0;
  unsigned __int128 v = 0;
  for (int i = top; i >= low; --i) v = (v << 32) | limbs_[i];
  bool sticky = false;
  for (int i = 0; i < low; ++i) sticky = sticky || limbs_[i] != 0;
  if (sticky) v |= 1;
  return std::ldexp(static_cast<double>(v), 32 * low + kLowExp);
}

absl::Status AddChunkSquares(const ops::Exec& e, const Tensor& t, int64_t begin, int64_t end,
                             ExactSum* sum) {
  if (begin < 0 || end > t.numel() || begin > end || begin % kNormChunk != 0) {
    return absl::InvalidArgumentError("chunk squares: range outside the tensor or not on a chunk");
  }
  if (begin == end) return absl::OkStatus();
  PW_ASSIGN_OR_RETURN(const Tensor piece, t.View(begin, {end - begin}));
  std::vector<double> partials;
  PW_RETURN_IF_ERROR(ops::SquareSumsByChunk(e, piece, kNormChunk, &partials));
  for (double p : partials) sum->Add(p);
  return absl::OkStatus();
}

}  // namespace pipewright::internal
