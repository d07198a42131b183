// Fused causal attention (see attention.cuh).
//
// Note [attention tiling]
// All kernels use 128 threads viewed as an 8 x 16 grid (ty = tid / 16, tx = tid % 16). A tile
// row of Q, K, V or dO (one token of one head) lives in shared memory padded to kMaxD + 1
// floats, so that 16 threads reading 16 different rows at the same d hit 16 different banks.
// Columns d in [D, kMaxD) are zero-filled, which lets every dot product run to the
// compile-time kMaxD; per-thread accumulators cover d = tx + 16 * jj, jj < kMaxD / 16.
//
//  forward   block = (64 queries, head, batch); loops over 32-key tiles up to the diagonal.
//            S = scale Q K^T (thread: 8 rows x 2 cols) -> shared; online softmax (2 threads
//            per row) keeps running max m and sum l per row; O = O * exp(m_old - m_new) + P V
//            (thread: 8 rows x kMaxD/16 cols, in registers). Finally O / l and lse = m + log l.
//  backward  delta_i = dO_i . O_i (one warp per row), then
//            dK/dV: block = (32 keys, head, batch), loops over 32-query tiles from the
//                   diagonal to T: P = exp(scale q.k - lse), dS = P (dO.v - delta);
//                   dV += P^T dO, dK += dS^T Q (thread: 4 keys x kMaxD/16 cols).
//            dQ:    block = (32 queries, head, batch), loops over 32-key tiles up to the
//                   diagonal: dQ += dS K (thread: 4 queries x kMaxD/16 cols).
//            The scale of dS is applied once when dK and dQ are stored.
// Masked scores are -inf; a running max of -inf (only for padding rows past T) is replaced by 0
// before exponentiating so no inf - inf NaN appears.
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cmath>

#include "absl/strings/str_format.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/kernel_util.cuh"

namespace pipewright::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kFwdQ = 64;     // queries per forward block
constexpr int kFwdK = 32;     // keys per forward tile
constexpr int kBwdTile = 32;  // keys per dK/dV block and queries per dQ block (and their loops)

template <int kMaxD>
struct Dims {
  static_assert(kMaxD % 16 == 0 && kMaxD <= kAttentionMaxHeadDim, "head dim tile");
  static constexpr int kRow = kMaxD + 1;  // padded row stride of Q/K/V/dO tiles
  static constexpr int kPerThread = kMaxD / 16;
  static constexpr int kScoreRow = 33;  // padded row stride of 32-column score tiles
  // Forward shared memory (floats): Q[64], K[32], V[32], S[64 x 33], m/l/corr[64].
  static constexpr int kFwdFloats = kFwdQ * kRow + 2 * kFwdK * kRow + kFwdQ * kScoreRow + 3 * kFwdQ;
  // dK/dV: K, V, Q, dO [32 rows], P and dS [32 x 33], lse and delta [32].
  static constexpr int kDkdvFloats = 4 * kBwdTile * kRow + 2 * kBwdTile * kScoreRow + 2 * kBwdTile;
  // dQ: Q, dO, K, V [32 rows], dS [32 x 33], lse and delta [32].
  static constexpr int kDqFloats = 4 * kBwdTile * kRow + kBwdTile * kScoreRow + 2 * kBwdTile;
};

// Copies `rows` tokens starting at t0 of one head's slice (`src` points at column offset of the
// head inside row 0 of the batch; row stride ld) into a padded tile, zero past T and past D.
template <int kMaxD>
__device__ __forceinline__ void LoadTile(float* dst, const float* src, size_t ld, int t0, int rows,
                                         int T, int D) {
  for (int idx = threadIdx.x; idx < rows * kMaxD; idx += kThreads) {
    const int r = idx / kMaxD, d = idx % kMaxD;
    const int t = t0 + r;
    dst[r * Dims<kMaxD>::kRow + d] = (t < T && d < D) ? src[static_cast<size_t>(t) * ld + d] : 0.0f;
  }
}

template <int kMaxD>
__global__ void __launch_bounds__(kThreads)
    AttentionForwardKernel(const float* qkv, float* out, float* lse, int T, int C, int H,
                           float scale) {
  using Dm = Dims<kMaxD>;
  constexpr int kRow = Dm::kRow, kPer = Dm::kPerThread, kS = Dm::kScoreRow;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* k_s = q_s + kFwdQ * kRow;
  float* v_s = k_s + kFwdK * kRow;
  float* s_s = v_s + kFwdK * kRow;
  float* m_s = s_s + kFwdQ * kS;
  float* l_s = m_s + kFwdQ;
  float* corr_s = l_s + kFwdQ;

  const int D = C / H;
  const int tile = gridDim.x - 1 - blockIdx.x;  // longest (latest) query tiles start first
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = tile * kFwdQ;
  const size_t ld = 3 * static_cast<size_t>(C);
  const float* q_base = qkv + static_cast<size_t>(b) * T * ld + static_cast<size_t>(h) * D;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;

  LoadTile<kMaxD>(q_s, q_base, ld, q0, kFwdQ, T, D);
  for (int r = tid; r < kFwdQ; r += kThreads) {
    m_s[r] = -CUDART_INF_F;
    l_s[r] = 0.0f;
  }

  float acc[8][kPer];
#pragma unroll
  for (int rr = 0; rr < 8; ++rr) {
#pragma unroll
    for (int jj = 0; jj < kPer; ++jj) acc[rr][jj] = 0.0f;
  }

  const int q_end = min(q0 + kFwdQ, T);
  const int num_tiles = (q_end + kFwdK - 1) / kFwdK;
  for (int kt = 0; kt < num_tiles; ++kt) {
    const int k0 = kt * kFwdK;
    __syncthreads();  // the previous tile's K/V/S reads are done (first pass: Q, m, l visible)
    LoadTile<kMaxD>(k_s, q_base + C, ld, k0, kFwdK, T, D);
    LoadTile<kMaxD>(v_s, q_base + 2 * C, ld, k0, kFwdK, T, D);
    __syncthreads();

    // S = scale * Q K^T for rows ty*8 + rr, columns tx + 16*cc.
    float s[8][2];
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) s[rr][0] = s[rr][1] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < kMaxD; ++d) {
      const float k0v = k_s[tx * kRow + d];
      const float k1v = k_s[(tx + 16) * kRow + d];
#pragma unroll
      for (int rr = 0; rr < 8; ++rr) {
        const float qv = q_s[(ty * 8 + rr) * kRow + d];
        s[rr][0] += qv * k0v;
        s[rr][1] += qv * k1v;
      }
    }
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
      const int i = q0 + ty * 8 + rr;
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int j = k0 + tx + 16 * cc;
        s_s[(ty * 8 + rr) * kS + tx + 16 * cc] =
            (j <= i && j < T) ? s[rr][cc] * scale : -CUDART_INF_F;
      }
    }
    __syncthreads();

    // Online softmax: two threads (adjacent lanes) per row, 16 columns each.
    {
      const int row = tid >> 1, half = tid & 1;
      float* srow = s_s + row * kS + half * 16;
      float mx = -CUDART_INF_F;
#pragma unroll
      for (int c = 0; c < 16; ++c) mx = fmaxf(mx, srow[c]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_old = m_s[row];
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -CUDART_INF_F ? 0.0f : m_new;
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        const float p = expf(srow[c] - m_use);
        srow[c] = p;
        sum += p;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      __syncwarp();  // both lanes have read m_s[row] before lane `half == 0` rewrites it
      if (half == 0) {
        const float corr = expf(m_old - m_use);
        corr_s[row] = corr;
        l_s[row] = l_s[row] * corr + sum;
        m_s[row] = m_new;
      }
    }
    __syncthreads();

    // O = O * corr + P V.
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
      const float corr = corr_s[ty * 8 + rr];
#pragma unroll
      for (int jj = 0; jj < kPer; ++jj) acc[rr][jj] *= corr;
    }
#pragma unroll 4
    for (int j = 0; j < kFwdK; ++j) {
      float vv[kPer];
#pragma unroll
      for (int jj = 0; jj < kPer; ++jj) vv[jj] = v_s[j * kRow + tx + 16 * jj];
#pragma unroll
      for (int rr = 0; rr < 8; ++rr) {
        const float p = s_s[(ty * 8 + rr) * kS + j];
#pragma unroll
        for (int jj = 0; jj < kPer; ++jj) acc[rr][jj] += p * vv[jj];
      }
    }
  }
  __syncthreads();  // final l_s / m_s visible to every thread

  float* out_base = out + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * D;
#pragma unroll
  for (int rr = 0; rr < 8; ++rr) {
    const int row = ty * 8 + rr;
    const int i = q0 + row;
    if (i < T) {
      const float inv_l = 1.0f / l_s[row];
#pragma unroll
      for (int jj = 0; jj < kPer; ++jj) {
        const int d = tx + 16 * jj;
        if (d < D) out_base[static_cast<size_t>(i) * C + d] = acc[rr][jj] * inv_l;
      }
    }
  }
  float* lse_base = lse + (static_cast<size_t>(b) * H + h) * T;
  for (int r = tid; r < kFwdQ; r += kThreads) {
    const int i = q0 + r;
    if (i < T) lse_base[i] = m_s[r] + logf(l_s[r]);
  }
}

// delta[b, h, i] = sum_d dout[b, i, h*D + d] * out[b, i, h*D + d]; one warp per (b, h, i).
__global__ void AttentionDeltaKernel(const float* dout, const float* out, float* delta, int B,
                                     int T, int C, int H) {
  const int D = C / H;
  const size_t warp = (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  const size_t total = static_cast<size_t>(B) * H * T;
  if (warp >= total) return;  // whole warps exit together
  const int i = static_cast<int>(warp % T);
  const size_t bh = warp / T;
  const int h = static_cast<int>(bh % H);
  const size_t b = bh / H;
  const size_t off = (b * T + i) * C + static_cast<size_t>(h) * D;
  float sum = 0.0f;
  for (int d = lane; d < D; d += 32) sum += dout[off + d] * out[off + d];
  sum = internal::WarpSum(sum);
  if (lane == 0) delta[warp] = sum;
}

template <int kMaxD>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardKvKernel(const float* dout, const float* qkv, const float* lse,
                              const float* delta, float* dqkv, int T, int C, int H, float scale) {
  using Dm = Dims<kMaxD>;
  constexpr int kRow = Dm::kRow, kPer = Dm::kPerThread, kS = Dm::kScoreRow;
  extern __shared__ float smem[];
  float* k_s = smem;
  float* v_s = k_s + kBwdTile * kRow;
  float* q_s = v_s + kBwdTile * kRow;
  float* do_s = q_s + kBwdTile * kRow;
  float* p_s = do_s + kBwdTile * kRow;  // [key][query]
  float* ds_s = p_s + kBwdTile * kS;    // [key][query]
  float* lse_s = ds_s + kBwdTile * kS;
  float* delta_s = lse_s + kBwdTile;

  const int D = C / H;
  const int h = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * kBwdTile;  // low key tiles see the most queries: they start first
  const size_t ld = 3 * static_cast<size_t>(C);
  const size_t head = static_cast<size_t>(h) * D;
  const float* q_base = qkv + static_cast<size_t>(b) * T * ld + head;
  const float* do_base = dout + static_cast<size_t>(b) * T * C + head;
  const float* lse_base = lse + (static_cast<size_t>(b) * H + h) * T;
  const float* delta_base = delta + (static_cast<size_t>(b) * H + h) * T;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;

  LoadTile<kMaxD>(k_s, q_base + C, ld, k0, kBwdTile, T, D);
  LoadTile<kMaxD>(v_s, q_base + 2 * C, ld, k0, kBwdTile, T, D);

  float dk[4][kPer], dv[4][kPer];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int jj = 0; jj < kPer; ++jj) dk[kk][jj] = dv[kk][jj] = 0.0f;
  }

  // Queries i >= k0 only (causal); kBwdTile-aligned, so the first tile is the diagonal one.
  for (int q0 = k0; q0 < T; q0 += kBwdTile) {
    __syncthreads();  // previous iteration's reads of Q/dO/P/dS are done
    LoadTile<kMaxD>(q_s, q_base, ld, q0, kBwdTile, T, D);
    LoadTile<kMaxD>(do_s, do_base, C, q0, kBwdTile, T, D);
    for (int r = tid; r < kBwdTile; r += kThreads) {
      const int i = q0 + r;
      lse_s[r] = i < T ? lse_base[i] : 0.0f;
      delta_s[r] = i < T ? delta_base[i] : 0.0f;
    }
    __syncthreads();

    // Pairs (key ty*4 + kk, query tx + 16*qq): s = k.q, dp = v.dO.
    float s[4][2], dp[4][2];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) s[kk][0] = s[kk][1] = dp[kk][0] = dp[kk][1] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < kMaxD; ++d) {
      const float qa = q_s[tx * kRow + d], qb = q_s[(tx + 16) * kRow + d];
      const float oa = do_s[tx * kRow + d], ob = do_s[(tx + 16) * kRow + d];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const float kv = k_s[(ty * 4 + kk) * kRow + d];
        const float vv = v_s[(ty * 4 + kk) * kRow + d];
        s[kk][0] += kv * qa;
        s[kk][1] += kv * qb;
        dp[kk][0] += vv * oa;
        dp[kk][1] += vv * ob;
      }
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int key = ty * 4 + kk;
      const int j = k0 + key;
#pragma unroll
      for (int qq = 0; qq < 2; ++qq) {
        const int query = tx + 16 * qq;
        const int i = q0 + query;
        const bool valid = i < T && j < T && j <= i;
        const float p = valid ? expf(s[kk][qq] * scale - lse_s[query]) : 0.0f;
        p_s[key * kS + query] = p;
        ds_s[key * kS + query] = valid ? p * (dp[kk][qq] - delta_s[query]) : 0.0f;
      }
    }
    __syncthreads();

    // dV += P^T dO, dK += dS^T Q for keys ty*4 + kk, columns tx + 16*jj.
#pragma unroll 4
    for (int qi = 0; qi < kBwdTile; ++qi) {
      float ov[kPer], qv[kPer];
#pragma unroll
      for (int jj = 0; jj < kPer; ++jj) {
        ov[jj] = do_s[qi * kRow + tx + 16 * jj];
        qv[jj] = q_s[qi * kRow + tx + 16 * jj];
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const float p = p_s[(ty * 4 + kk) * kS + qi];
        const float ds = ds_s[(ty * 4 + kk) * kS + qi];
#pragma unroll
        for (int jj = 0; jj < kPer; ++jj) {
          dv[kk][jj] += p * ov[jj];
          dk[kk][jj] += ds * qv[jj];
        }
      }
    }
  }

  float* dk_base = dqkv + static_cast<size_t>(b) * T * ld + C + head;
  float* dv_base = dk_base + C;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int j = k0 + ty * 4 + kk;
    if (j >= T) continue;
#pragma unroll
    for (int jj = 0; jj < kPer; ++jj) {
      const int d = tx + 16 * jj;
      if (d < D) {
        dk_base[static_cast<size_t>(j) * ld + d] = dk[kk][jj] * scale;
        dv_base[static_cast<size_t>(j) * ld + d] = dv[kk][jj];
      }
    }
  }
}

template <int kMaxD>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardQKernel(const float* dout, const float* qkv, const float* lse,
                             const float* delta, float* dqkv, int T, int C, int H, float scale) {
  using Dm = Dims<kMaxD>;
  constexpr int kRow = Dm::kRow, kPer = Dm::kPerThread, kS = Dm::kScoreRow;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* do_s = q_s + kBwdTile * kRow;
  float* k_s = do_s + kBwdTile * kRow;
  float* v_s = k_s + kBwdTile * kRow;
  float* ds_s = v_s + kBwdTile * kRow;  // [query][key]
  float* lse_s = ds_s + kBwdTile * kS;
  float* delta_s = lse_s + kBwdTile;

  const int D = C / H;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBwdTile;  // latest (longest) tiles first
  const size_t ld = 3 * static_cast<size_t>(C);
  const size_t head = static_cast<size_t>(h) * D;
  const float* q_base = qkv + static_cast<size_t>(b) * T * ld + head;
  const float* do_base = dout + static_cast<size_t>(b) * T * C + head;
  const float* lse_base = lse + (static_cast<size_t>(b) * H + h) * T;
  const float* delta_base = delta + (static_cast<size_t>(b) * H + h) * T;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;

  LoadTile<kMaxD>(q_s, q_base, ld, q0, kBwdTile, T, D);
  LoadTile<kMaxD>(do_s, do_base, C, q0, kBwdTile, T, D);
  for (int r = tid; r < kBwdTile; r += kThreads) {
    const int i = q0 + r;
    lse_s[r] = i < T ? lse_base[i] : 0.0f;
    delta_s[r] = i < T ? delta_base[i] : 0.0f;
  }

  float dq[4][kPer];
#pragma unroll
  for (int qq = 0; qq < 4; ++qq) {
#pragma unroll
    for (int jj = 0; jj < kPer; ++jj) dq[qq][jj] = 0.0f;
  }

  const int q_end = min(q0 + kBwdTile, T);
  for (int k0 = 0; k0 < q_end; k0 += kBwdTile) {
    __syncthreads();  // previous iteration's reads of K/V/dS are done (first: Q/dO visible)
    LoadTile<kMaxD>(k_s, q_base + C, ld, k0, kBwdTile, T, D);
    LoadTile<kMaxD>(v_s, q_base + 2 * C, ld, k0, kBwdTile, T, D);
    __syncthreads();

    // Pairs (query ty*4 + qq, key tx + 16*kk): s = q.k, dp = dO.v.
    float s[4][2], dp[4][2];
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) s[qq][0] = s[qq][1] = dp[qq][0] = dp[qq][1] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < kMaxD; ++d) {
      const float ka = k_s[tx * kRow + d], kb = k_s[(tx + 16) * kRow + d];
      const float va = v_s[tx * kRow + d], vb = v_s[(tx + 16) * kRow + d];
#pragma unroll
      for (int qq = 0; qq < 4; ++qq) {
        const float qv = q_s[(ty * 4 + qq) * kRow + d];
        const float ov = do_s[(ty * 4 + qq) * kRow + d];
        s[qq][0] += qv * ka;
        s[qq][1] += qv * kb;
        dp[qq][0] += ov * va;
        dp[qq][1] += ov * vb;
      }
    }
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
      const int query = ty * 4 + qq;
      const int i = q0 + query;
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const int key = tx + 16 * kk;
        const int j = k0 + key;
        const bool valid = i < T && j < T && j <= i;
        const float p = valid ? expf(s[qq][kk] * scale - lse_s[query]) : 0.0f;
        ds_s[query * kS + key] = valid ? p * (dp[qq][kk] - delta_s[query]) : 0.0f;
      }
    }
    __syncthreads();

    // dQ += dS K for queries ty*4 + qq, columns tx + 16*jj.
#pragma unroll 4
    for (int kj = 0; kj < kBwdTile; ++kj) {
      float kv[kPer];
#pragma unroll
      for (int jj = 0; jj < kPer; ++jj) kv[jj] = k_s[kj * kRow + tx + 16 * jj];
#pragma unroll
      for (int qq = 0; qq < 4; ++qq) {
        const float ds = ds_s[(ty * 4 + qq) * kS + kj];
#pragma unroll
        for (int jj = 0; jj < kPer; ++jj) dq[qq][jj] += ds * kv[jj];
      }
    }
  }

  float* dq_base = dqkv + static_cast<size_t>(b) * T * ld + head;
#pragma unroll
  for (int qq = 0; qq < 4; ++qq) {
    const int i = q0 + ty * 4 + qq;
    if (i >= T) continue;
#pragma unroll
    for (int jj = 0; jj < kPer; ++jj) {
      const int d = tx + 16 * jj;
      if (d < D) dq_base[static_cast<size_t>(i) * ld + d] = dq[qq][jj] * scale;
    }
  }
}

absl::Status CheckShape(const char* op, int B, int T, int C, int H) {
  if (B < 0 || T < 0 || C <= 0 || H <= 0 || C % H != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: bad shape B=%d T=%d C=%d H=%d (need C %% H == 0)", op, B, T, C, H));
  }
  if (C / H > kAttentionMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: head dim %d exceeds the supported %d",
                                                      op, C / H, kAttentionMaxHeadDim));
  }
  if (B > 65535 || H > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: B=%d or H=%d exceeds the grid limit 65535", op, B, H));
  }
  return absl::OkStatus();
}

constexpr int SmemBytes(int floats) { return floats * static_cast<int>(sizeof(float)); }

// Opts `kernel` into `bytes` of dynamic shared memory (needed above 48 KiB; cheap to repeat).
template <typename Kernel>
absl::Status AllowSmem(Kernel kernel, int bytes) {
  PW_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return absl::OkStatus();
}

template <int kMaxD>
absl::Status ForwardImpl(cudaStream_t stream, const float* qkv, float* out, float* lse, int B,
                         int T, int C, int H, float scale) {
  const dim3 grid(internal::CeilDiv(T, kFwdQ), H, B);
  constexpr int kBytes = SmemBytes(Dims<kMaxD>::kFwdFloats);
  PW_RETURN_IF_ERROR(AllowSmem(AttentionForwardKernel<kMaxD>, kBytes));
  AttentionForwardKernel<kMaxD><<<grid, kThreads, kBytes, stream>>>(qkv, out, lse, T, C, H, scale);
  PW_CUDA_LAUNCH_CHECK("AttentionForwardKernel");
  return absl::OkStatus();
}

template <int kMaxD>
absl::Status BackwardImpl(cudaStream_t stream, const float* dout, const float* qkv,
                          const float* lse, const float* delta, float* dqkv, int B, int T, int C,
                          int H, float scale) {
  const dim3 grid(internal::CeilDiv(T, kBwdTile), H, B);
  constexpr int kKvBytes = SmemBytes(Dims<kMaxD>::kDkdvFloats);
  PW_RETURN_IF_ERROR(AllowSmem(AttentionBackwardKvKernel<kMaxD>, kKvBytes));
  AttentionBackwardKvKernel<kMaxD>
      <<<grid, kThreads, kKvBytes, stream>>>(dout, qkv, lse, delta, dqkv, T, C, H, scale);
  PW_CUDA_LAUNCH_CHECK("AttentionBackwardKvKernel");
  constexpr int kQBytes = SmemBytes(Dims<kMaxD>::kDqFloats);
  PW_RETURN_IF_ERROR(AllowSmem(AttentionBackwardQKernel<kMaxD>, kQBytes));
  AttentionBackwardQKernel<kMaxD>
      <<<grid, kThreads, kQBytes, stream>>>(dout, qkv, lse, delta, dqkv, T, C, H, scale);
  PW_CUDA_LAUNCH_CHECK("AttentionBackwardQKernel");
  return absl::OkStatus();
}

}  // namespace

absl::Status AttentionForward(cudaStream_t stream, const float* qkv, float* out, float* lse, int B,
                              int T, int C, int H) {
  PW_RETURN_IF_ERROR(CheckShape("AttentionForward", B, T, C, H));
  if (B == 0 || T == 0) return absl::OkStatus();
  const int D = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (D <= 32) return ForwardImpl<32>(stream, qkv, out, lse, B, T, C, H, scale);
  if (D <= 64) return ForwardImpl<64>(stream, qkv, out, lse, B, T, C, H, scale);
  return ForwardImpl<128>(stream, qkv, out, lse, B, T, C, H, scale);
}

absl::Status AttentionBackward(cudaStream_t stream, const float* dout, const float* qkv,
                               const float* out, const float* lse, float* dqkv, float* scratch,
                               int B, int T, int C, int H) {
  PW_RETURN_IF_ERROR(CheckShape("AttentionBackward", B, T, C, H));
  if (B == 0 || T == 0) return absl::OkStatus();
  const int D = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t rows = static_cast<size_t>(B) * H * T;
  constexpr int kDeltaThreads = 256;  // 8 warps, one row each
  const size_t blocks = (rows + kDeltaThreads / 32 - 1) / (kDeltaThreads / 32);
  if (blocks > 0x7fffffffu) return absl::InvalidArgumentError("AttentionBackward: B*H*T too large");
  AttentionDeltaKernel<<<static_cast<unsigned int>(blocks), kDeltaThreads, 0, stream>>>(
      dout, out, scratch, B, T, C, H);
  PW_CUDA_LAUNCH_CHECK("AttentionDeltaKernel");
  if (D <= 32) return BackwardImpl<32>(stream, dout, qkv, lse, scratch, dqkv, B, T, C, H, scale);
  if (D <= 64) return BackwardImpl<64>(stream, dout, qkv, lse, scratch, dqkv, B, T, C, H, scale);
  return BackwardImpl<128>(stream, dout, qkv, lse, scratch, dqkv, B, T, C, H, scale);
}

}  // namespace pipewright::cuda
