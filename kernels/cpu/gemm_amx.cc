// bf16 GEMM on AMX tiles (Intel Advanced Matrix Extensions, Sapphire Rapids and later): Note
// [AMX GEMM].
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/gemm_pack.h"
#include "pipewright/cpu.h"
#include "pipewright/status.h"

namespace pipewright::cpu {

// Note [AMX GEMM]
// TDPBF16PS multiplies a 16 x 32 bf16 tile of A by a 32 x 16 one of B (stored as 16 rows of k
// pairs) into a 16 x 16 fp32 tile of C. Per element it keeps two fp32 partial sums, of the even
// and of the odd k of its 32, each a chain of fused multiply-adds from +0 in increasing k, and
// adds their sum to C: c = c + (even + odd), denormals flushed, round to nearest even (the
// instruction's documented pseudocode; `GemmAmx.OneInstructionIsThePseudocode` checks the
// hardware against it bit for bit). So the AMX kernel's result is defined by this order:
//   s = (alpha == 1 ? beta * c : 0)                      (beta == 0: s = 0, beta == 1: s = c)
//   for each chunk of 32 k from k = 0:  s += (E + O)     E, O: the chunk's even and odd chains
//   c = (alpha == 1 ? s : alpha * s + beta * c)
// a trailing partial chunk padded with zeros (zero products leave E and O unchanged). It is not
// Note [16-bit GEMM]'s single running sum, so its bits differ from kFma's and kBf16Dot's (within
// the same rounding bound, which the tests hold it to); like theirs they do not depend on the
// blocking or the part of C computed (k blocks are multiples of 32 and the running sums are
// stored in C between them), so threads may split C freely and one process's ranks agree.
//
// Layout: C in blocks of 32 x 32 (four accumulator tiles, tmm0-3), A in strips of 32 rows packed
// per 32-k chunk as two 16 x 32 tiles (tmm4-5; packed as Note [16-bit GEMM]'s pair panels, then
// transposed 16 x 16 words at a time), B as the pair panels of 32 columns the vdpbf16ps kernel
// uses: a B tile is 16 consecutive k pairs of 16 of a panel's 32 columns, 128 bytes apart (tmm6-7).
// Per chunk: four tile loads, four TDPBF16PS. A whole 32 x 32 block of C whose running sum starts
// from C or zero is loaded and stored by the tiles directly; an edge block or a scaled one goes
// through a 32 x 32 buffer with masked copies.
//
// Linux grants a process the 8 KiB of tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); AmxAvailable() asks once. Each call configures the
// tiles on its thread (LDTILECFG) and releases them at the end (TILERELEASE).

#if PW_HAVE_X86_VARIANTS

#define PW_TARGET_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

namespace {

constexpr int kBlock = 32;   // rows and columns of a C block
constexpr int kChunk = 32;   // k of one TDPBF16PS
constexpr int kKcAmx = 512;  // k per block: a 32-row A strip is 32 KiB, a B panel 32 KiB
constexpr int kChunkWords = 2 * 16 * 16;  // one chunk of a packed A strip: two 16 x 16 word tiles

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// An A strip's chunks as AMX A tiles: from pair panels of 32 rows ([pair][32 row words], `steps`
// pairs, a multiple of 16), each chunk of 16 pairs as two [16 rows][16 pair words] tiles.
PW_TARGET_AMX void PanelsToTiles(const uint32_t* panel, int steps, uint32_t* tiles) {
  for (int c = 0; c < steps / 16; ++c) {
    for (int t = 0; t < 2; ++t) {
      __m512i x[16];
      for (int p = 0; p < 16; ++p) {
        x[p] = _mm512_loadu_si512(panel + static_cast<size_t>(16 * c + p) * kBlock + 16 * t);
      }
      Transpose16x16(x);  // x[row] = the row's 16 pairs
      uint32_t* out = tiles + static_cast<size_t>(c) * kChunkWords + 256 * t;
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(out + 16 * r, x[r]);
    }
  }
}

enum class Start { kZero, kLoad, kLoadScaled };          // s = 0; s = c; s = beta c
enum class Finish { kPlain, kScaled, kScaledPlusBeta };  // c = s; c = alpha s; c = alpha s + beta c

// One 32 x 32 block of C (rows x cols of it valid, row stride ldc) over `chunks` k chunks of the
// packed A strip `ap` and the B panel `bp` (32 column words per pair).
PW_TARGET_AMX void AmxBlock(const uint32_t* ap, const uint32_t* bp, int chunks, float* c,
                            size_t ldc, int rows, int cols, float alpha, float beta, Start start,
                            Finish finish) {
  const bool direct =
      rows == kBlock && cols == kBlock && start != Start::kLoadScaled && finish == Finish::kPlain;
  alignas(64) float buf[kBlock * kBlock];
  float* base = c;
  size_t stride = ldc * sizeof(float);
  if (!direct) {
    for (int i = 0; i < kBlock; ++i) {
      for (int j = 0; j < kBlock; ++j) {
        float v = 0.0f;
        if (start != Start::kZero && i < rows && j < cols) {
          v = c[i * ldc + j];
          if (start == Start::kLoadScaled) v *= beta;
        }
        buf[i * kBlock + j] = v;
      }
    }
    base = buf;
    stride = kBlock * sizeof(float);
  }
  const size_t down = 16 * stride / sizeof(float);  // 16 rows further, in floats
  if (direct && start == Start::kZero) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, base, stride);
    _tile_loadd(1, base + 16, stride);
    _tile_loadd(2, base + down, stride);
    _tile_loadd(3, base + down + 16, stride);
  }
  for (int k = 0; k < chunks; ++k) {
    const uint32_t* a = ap + static_cast<size_t>(k) * kChunkWords;
    const uint32_t* b = bp + static_cast<size_t>(k) * 16 * kBlock;
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + 256, 64);
    _tile_loadd(6, b, kBlock * 4);
    _tile_loadd(7, b + 16, kBlock * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, base, stride);
  _tile_stored(1, base + 16, stride);
  _tile_stored(2, base + down, stride);
  _tile_stored(3, base + down + 16, stride);
  if (direct) return;
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      const float s = buf[i * kBlock + j];
      float& out = c[i * ldc + j];
      if (finish == Finish::kPlain) {
        out = s;
      } else if (finish == Finish::kScaled) {
        out = alpha * s;
      } else {
        out = std::fma(alpha, s, beta * out);
      }
    }
  }
}

// Rows [m0, m1) x columns [n0, n1) of C; k > 0 and alpha != 0.
PW_TARGET_AMX void GemmAmx(const pack::Operands& g, int m0, int m1, int n0, int n1) {
  thread_local std::vector<pack::Line> a_pairs, a_tiles, b_buf;
  constexpr HalfGemmKernel kPairs = HalfGemmKernel::kBf16Dot;  // one word per k pair
  // alpha != 1 with beta != 0 combines the finished sum with c's old value: one k block.
  const int kc_limit = g.alpha != 1.0f && g.beta != 0.0f ? g.k : kKcAmx;
  const int blocks = (g.k + kc_limit - 1) / kc_limit;
  // Blocks of whole chunks, so that every chunk starts at a multiple of 32 (Note [AMX GEMM]).
  const int kc_max = ((g.k + blocks - 1) / blocks + kChunk - 1) / kChunk * kChunk;
  const int steps_max = kc_max / 2;
  const int nc_max = std::max(kBlock, pack::kPackedBBytes / (4 * steps_max) / kBlock * kBlock);
  uint32_t* ap = pack::Scratch(a_pairs, static_cast<size_t>(kBlock) * steps_max);
  uint32_t* at = pack::Scratch(a_tiles, static_cast<size_t>(kBlock) * steps_max);
  uint32_t* bp =
      pack::Scratch(b_buf, static_cast<size_t>(std::min(nc_max, n1 - n0) + kBlock) * steps_max);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  for (int jc0 = n0; jc0 < n1; jc0 += nc_max) {
    const int nc = std::min(nc_max, n1 - jc0);
    for (int pc = 0; pc < g.k; pc += kc_max) {
      const int kc = std::min(kc_max, g.k - pc);
      const int chunks = (kc + kChunk - 1) / kChunk, steps = chunks * 16;
      const bool first = pc == 0, last = pc + kc == g.k;
      Start start = Start::kLoad;  // a later block continues the running sum stored in C
      if (first) {
        start = g.alpha != 1.0f || g.beta == 0.0f ? Start::kZero
                : g.beta == 1.0f                  ? Start::kLoad
                                                  : Start::kLoadScaled;
      }
      Finish finish = Finish::kPlain;
      if (last && g.alpha != 1.0f) {
        finish = g.beta == 0.0f ? Finish::kScaled : Finish::kScaledPlusBeta;
      }
      // Pair panels padded with zero pairs up to whole chunks (the packers zero k past kc).
      for (int jc = 0; jc < nc; jc += kBlock) {
        uint32_t* panel = bp + static_cast<size_t>(jc) * steps;
        const int nr = std::min(kBlock, nc - jc);
        if (g.trans_b) {  // stored n x k
          pack::PackRowPairs<kBlock>(kPairs, true, g.b + static_cast<size_t>(jc0 + jc) * g.ldb + pc,
                                     g.ldb, nr, kc, panel);
        } else {  // stored k x n
          pack::PackColumnPairs<kBlock>(
              kPairs, true, g.b + static_cast<size_t>(pc) * g.ldb + jc0 + jc, g.ldb, nr, kc, panel);
        }
        const int packed = (kc + 1) / 2;
        std::memset(panel + static_cast<size_t>(packed) * kBlock, 0,
                    static_cast<size_t>(steps - packed) * kBlock * sizeof(uint32_t));
      }
      for (int ir = m0; ir < m1; ir += kBlock) {
        const int mr = std::min(kBlock, m1 - ir);
        if (g.trans_a) {  // stored k x m
          pack::PackColumnPairs<kBlock>(kPairs, true, g.a + static_cast<size_t>(pc) * g.lda + ir,
                                        g.lda, mr, kc, ap);
        } else {  // stored m x k
          pack::PackRowPairs<kBlock>(kPairs, true, g.a + static_cast<size_t>(ir) * g.lda + pc,
                                     g.lda, mr, kc, ap);
        }
        const int packed = (kc + 1) / 2;
        std::memset(ap + static_cast<size_t>(packed) * kBlock, 0,
                    static_cast<size_t>(steps - packed) * kBlock * sizeof(uint32_t));
        PanelsToTiles(ap, steps, at);
        for (int jc = 0; jc < nc; jc += kBlock) {
          AmxBlock(at, bp + static_cast<size_t>(jc) * steps, chunks,
                   g.c + static_cast<size_t>(ir) * g.ldc + jc0 + jc, g.ldc, mr,
                   std::min(kBlock, nc - jc), g.alpha, g.beta, start, finish);
        }
      }
    }
  }
  _tile_release();
}

// Whether the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tiles.
bool DetectAmx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
  if (!tile || !bf16 || !pipewright::GetCpuFeatures().avx512()) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

bool AmxAvailable() {
  static const bool available = DetectAmx();
  return available;
}

void GemmAmxBlock(bool trans_a, bool trans_b, int k, float alpha, const uint16_t* a, int lda,
                  const uint16_t* b, int ldb, float beta, float* c, int ldc, int m0, int m1, int n0,
                  int n1) {
  PW_CHECK(AmxAvailable());
  GemmAmx({true, trans_a, trans_b, k, alpha, a, lda, b, ldb, beta, c, ldc}, m0, m1, n0, n1);
}

#else  // not x86

bool AmxAvailable() { return false; }
void GemmAmxBlock(bool, bool, int, float, const uint16_t*, int, const uint16_t*, int, float, float*,
                  int, int, int, int, int) {
  PW_CHECK(false);
}

#endif

}  // namespace pipewright::cpu
