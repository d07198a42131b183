// Incremental decoding's attention: a few new query rows of one sequence against the keys and
// values of every position so far, kept in a cache (Note [Incremental decoding] in
// pipewright/layer.h).
//
// Note [Decoding attention]. A decoding step has one query row per head against up to T keys:
// a matrix-vector product, not the tiles of the training kernel (attention.cc), which would pad
// the one query to a tile of 128 and pack all the keys and values every step. Per (head, query)
// the kernel makes two passes over the cached rows: scores s_j = (q / sqrt(D)) . k_j for the
// visible keys j <= position (q scaled first, as attention.cc scales it), their max m and
// e_j = exp(s_j - m) (FastExpLanes, the training kernel's exp), then out = sum_j e_j v_j / sum_j
// e_j. The dot products run over the head dim in vectors of the ISA's width (vec.h), the
// exponentials over the keys, the output over the head dim again. The values are those of the
// training kernel's online softmax up to the order of the sums (it adds per key tile and
// rescales), so a decoded row agrees with the full forward's to fp32 rounding, not bit for bit.
// Heads do not share anything: a call computes heads [begin, end), and callers split the heads
// over threads, each part with its own scratch.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/vec.h"

namespace pipewright::cpu {
namespace {

constexpr int kAlign = 16;  // the widest ISA's lanes: scratch runs are whole vectors of any ISA

constexpr int RoundUp(int x, int m) { return (x + m - 1) / m * m; }

struct DecodeCall {
  const float* q;
  int ldq;
  const float* kv;
  int ldkv;
  float* out;
  int ldo;
  int start, n, C, H, begin, end;
  float* scratch;
};

struct AttentionDecodeKernel {
  template <int W>
  PW_KERNEL_BODY void Run(DecodeCall a) {
    using V = typename simd::Vec<W>::F;
    const int D = a.C / a.H;
    const int Dp = RoundUp(D, kAlign);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    float* qs = a.scratch;  // [Dp]: the query row times scale, zeros past D
    float* s = qs + Dp;     // [keys rounded up to kAlign]: scores, then exponentials
    for (int h = a.begin; h < a.end; ++h) {
      const size_t col = static_cast<size_t>(h) * D;
      for (int i = 0; i < a.n; ++i) {
        const int keys = a.start + i + 1;  // the query at position start + i sees keys 0..it
        const float* q = a.q + static_cast<size_t>(i) * a.ldq + col;
        for (int d = 0; d < Dp; d += W) {
          const int k = std::clamp(D - d, 0, W);
          simd::Store<W>(qs + d, k == 0 ? V{} : scale * simd::LoadN<W>(q + d, k));
        }
        float mx = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < keys; ++j) {
          const float* kr = a.kv + static_cast<size_t>(j) * a.ldkv + col;
          V acc{};
          for (int d = 0; d < D; d += W) {
            acc += simd::Load<W>(qs + d) * simd::LoadN<W>(kr + d, std::min(W, D - d));
          }
          s[j] = simd::ReduceAdd<W>(acc);
          mx = s[j] > mx ? s[j] : mx;
        }
        V sum{};
        simd::ForEach<W>(keys, [&](size_t j, int k) PW_LAMBDA {
          const V e = simd::KeepFirst<W>(FastExpLanes(simd::LoadN<W>(s + j, k) - mx), k);
          simd::Store<W>(s + j, e);  // the scratch run is padded: a partial vector fits
          sum += e;
        });
        const float inv = 1.0f / simd::ReduceAdd<W>(sum);
        float* o = a.out + static_cast<size_t>(i) * a.ldo + col;
        const float* v = a.kv + a.C + col;
        for (int d = 0; d < D; d += W) {
          const int k = std::min(W, D - d);
          V acc{};
          for (int j = 0; j < keys; ++j) {
            acc += s[j] * simd::LoadN<W>(v + static_cast<size_t>(j) * a.ldkv + d, k);
          }
          simd::StoreN<W>(o + d, acc * inv, k);
        }
      }
    }
  }
};

}  // namespace

size_t AttentionDecodeScratchFloats(int keys, int C, int H) {
  return static_cast<size_t>(RoundUp(C / H, kAlign)) + RoundUp(std::max(keys, 1), kAlign);
}

void AttentionDecode(const float* q, int ldq, const float* kv, int ldkv, float* out, int ldo,
                     int start, int n, int C, int H, int begin, int end, float* scratch, Isa isa) {
  simd::Dispatch<AttentionDecodeKernel>(
      isa, DecodeCall{q, ldq, kv, ldkv, out, ldo, start, n, C, H, begin, end, scratch});
}

}  // namespace pipewright::cpu
