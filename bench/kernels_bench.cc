// Google Benchmark microbenchmarks of the CPU kernels at gpt-small shapes (one thread):
//   build/bin/kernels_bench --benchmark_filter=Gelu
#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/cpu.h"

namespace {
using namespace pipewright::cpu;
constexpr int kTokens = 1024, kC = 256, kT = 128, kH = 8;

void BM_Gemm(benchmark::State& state) {
  const int m = state.range(0), n = state.range(1), k = state.range(2);
  std::vector<float> a(size_t(m) * k, 0.5f), b(size_t(k) * n, 0.25f), c(size_t(m) * n);
  for (auto _ : state) {
    Gemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * m * n * k, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Gemm)
    ->Args({kTokens, 3 * kC, kC})
    ->Args({kTokens, 4 * kC, kC})
    ->Args({1024, 1024, 1024});

// ---- 16-bit GEMMs: the Linear layer's products in --precision bf16
// (docs/benchmarks-kernels.md) ----
// Args: Linear (in, out), gemm (0 forward y = x W^T: NT; 1 input gradient dx = dy W: NN; 2 weight
// gradient dW += dy^T x: TN), path (0 sgemm on f32 inputs, the fp32 baseline; 1 GemmHalf's
// widening path: bf16 -> f32 copies + sgemm; 2 GemmHalfBlock kFma; 3 GemmHalfBlock kBf16Dot).
void BM_GemmBf16(benchmark::State& state) {
  const int in = state.range(0), out = state.range(1), gemm = state.range(2);
  const int path = state.range(3);
  const bool ta = gemm == 2, tb = gemm == 0;
  const int m = gemm == 2 ? out : kTokens, n = gemm == 1 ? in : gemm == 0 ? out : in;
  const int k = gemm == 0 ? in : gemm == 1 ? out : kTokens;
  const auto kernel = path == 3 ? HalfGemmKernel::kBf16Dot : HalfGemmKernel::kFma;
  if (path >= 2 && path <= 3 && !CanRunHalfGemmKernel(kernel)) {
    state.SkipWithError("kernel not supported on this CPU");
    return;
  }
  static const char* const kPaths[] = {"sgemm f32", "bf16 widen+sgemm", "bf16 fma",
                                       "bf16 vdpbf16ps", "own f32"};
  state.SetLabel(std::string(ta ? "T" : "N") + (tb ? "T " : "N ") + kPaths[path]);
  const int lda = ta ? m : k, ldb = tb ? k : n;
  std::vector<float> a(size_t(m) * k), b(size_t(k) * n), c(size_t(m) * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(int(i * 7919 % 1000) - 500) / 500.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(int(i * 104729 % 1000) - 500) / 500.0f;
  std::vector<uint16_t> a16(a.size()), b16(b.size());
  FloatToBf16(a.data(), a16.data(), a.size());
  FloatToBf16(b.data(), b16.data(), b.size());
  const float beta = gemm == 2 ? 1.0f : 0.0f;  // weight gradients accumulate
  for (auto _ : state) {
    if (path == 0) {
      Gemm(ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, beta, c.data(), n);
    } else if (path == 4) {
      GemmF32Block(ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, beta, c.data(), n, 0, m, 0,
                   n);
    } else if (path == 1) {
      GemmHalf(true, ta, tb, m, n, k, 1.0f, a16.data(), lda, b16.data(), ldb, beta, c.data(), n,
               Isa::kBaseline);
    } else {
      GemmHalfBlock(true, ta, tb, m, n, k, 1.0f, a16.data(), lda, b16.data(), ldb, beta, c.data(),
                    n, 0, m, 0, n, kernel);
    }
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * m * n * k, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
// gpt-small's Linears: attention qkv (256 -> 768), MLP up (256 -> 1024), MLP down (1024 -> 256),
// attention projection and LM head (256 -> 256).
BENCHMARK(BM_GemmBf16)
    ->ArgsProduct({{kC}, {3 * kC, 4 * kC, kC}, {0, 1, 2}, {0, 1, 2, 3, 4}})
    ->ArgsProduct({{4 * kC}, {kC}, {0, 1, 2}, {0, 1, 2, 3, 4}})
    ->ArgNames({"in", "out", "gemm", "path"});

// ---- fp32 GEMMs on operands that are not in cache, as inside a training step ----
// The Linear products of BM_GemmBf16 (gemm 0 forward NT, 1 input gradient NN, 2 weight gradient
// TN) with path 0 OpenBLAS sgemm or 4 pipewright's fp32 GEMM, each call on the next of 16 sets
// of A, B and C (48-144 MiB together, past L2 and most of what L3 keeps for one core).
void BM_GemmCold(benchmark::State& state) {
  const int in = state.range(0), out = state.range(1), gemm = state.range(2);
  const int path = state.range(3);
  if (path == 4 && !HaveGemmHalfAvx512()) {
    state.SkipWithError("no AVX-512");
    return;
  }
  const bool ta = gemm == 2, tb = gemm == 0;
  const int m = gemm == 2 ? out : kTokens, n = gemm == 1 ? in : gemm == 0 ? out : in;
  const int k = gemm == 0 ? in : gemm == 1 ? out : kTokens;
  const int lda = ta ? m : k, ldb = tb ? k : n;
  constexpr int kSets = 16;
  std::vector<std::vector<float>> a(kSets), b(kSets), c(kSets);
  for (int i = 0; i < kSets; ++i) {
    a[i].assign(size_t(m) * k, 0.5f);
    b[i].assign(size_t(k) * n, 0.25f);
    c[i].assign(size_t(m) * n, 0.0f);
  }
  const float beta = gemm == 2 ? 1.0f : 0.0f;
  int set = 0;
  for (auto _ : state) {
    float* cp = c[set].data();
    if (path == 0) {
      BlasSgemm(ta, tb, m, n, k, 1.0f, a[set].data(), lda, b[set].data(), ldb, beta, cp, n);
    } else {
      GemmF32Block(ta, tb, m, n, k, 1.0f, a[set].data(), lda, b[set].data(), ldb, beta, cp, n, 0, m,
                   0, n);
    }
    benchmark::DoNotOptimize(cp);
    set = (set + 1) % kSets;
  }
  state.SetLabel(std::string(ta ? "T" : "N") + (tb ? "T " : "N ") +
                 (path == 0 ? "sgemm f32" : "own f32"));
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * m * n * k, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_GemmCold)
    ->ArgsProduct({{kC}, {3 * kC, 4 * kC, kC}, {0, 1, 2}, {0, 4}})
    ->ArgsProduct({{4 * kC}, {kC}, {0, 1, 2}, {0, 4}})
    ->ArgNames({"in", "out", "gemm", "path"});

// ---- elementwise, LayerNorm, cross-entropy, optimizer and cast kernels, per ISA variant ----
// Arg isa: 0 baseline, 1 avx2, 2 avx512 (variants this CPU lacks are skipped). Shapes are one
// gpt-small micro-batch: [kTokens, kC] activations, [kTokens, 4 kC] MLP hidden, vocabulary 256.
// bytes_per_second counts what one call reads and writes.
std::vector<float> Filled(size_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = lo + (hi - lo) * float((i * 7919) % 1000) / 1000.0f;
  return v;
}

template <typename Fn>
void RunIsa(benchmark::State& state, double bytes, Fn fn) {
  const Isa isa = static_cast<Isa>(state.range(0));
  if (static_cast<int>(isa) > static_cast<int>(KernelIsa())) {
    state.SkipWithError("ISA not supported on this CPU");
    return;
  }
  state.SetLabel(IsaName(isa));
  for (auto _ : state) {
    fn(isa);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(state.iterations() * bytes));
}
#define PW_ISA_BENCHMARK(fn) BENCHMARK(fn)->DenseRange(0, 2)->ArgName("isa")

constexpr int kHidden = 4 * kC, kVocab = 256;
constexpr size_t kHiddenElems = size_t(kTokens) * kHidden, kActElems = size_t(kTokens) * kC;

void BM_GeluForward(benchmark::State& state) {
  auto x = Filled(kHiddenElems, -4, 4), y = x;
  RunIsa(state, 8.0 * x.size(), [&](Isa isa) { GeluForward(x.data(), y.data(), x.size(), isa); });
}
PW_ISA_BENCHMARK(BM_GeluForward);

void BM_GeluBackward(benchmark::State& state) {
  auto x = Filled(kHiddenElems, -4, 4), dy = Filled(x.size(), -1, 1), dx = x;
  RunIsa(state, 12.0 * x.size(),
         [&](Isa isa) { GeluBackward(x.data(), dy.data(), dx.data(), x.size(), isa); });
}
PW_ISA_BENCHMARK(BM_GeluBackward);

// The MLP's bias + GELU: BiasAdd then GeluForward, against the fused kernel (pre in place).
void BM_BiasThenGelu(benchmark::State& state) {
  auto pre = Filled(kHiddenElems, -4, 4), bias = Filled(kHidden, -1, 1), y = pre;
  RunIsa(state, 16.0 * pre.size(), [&](Isa isa) {
    BiasAdd(pre.data(), bias.data(), kTokens, kHidden, isa);
    GeluForward(pre.data(), y.data(), pre.size(), isa);
  });
}
PW_ISA_BENCHMARK(BM_BiasThenGelu);

void BM_BiasGeluForwardFused(benchmark::State& state) {
  auto pre = Filled(kHiddenElems, -4, 4), bias = Filled(kHidden, -1, 1), y = pre;
  RunIsa(state, 12.0 * pre.size(), [&](Isa isa) {
    BiasGeluForward(pre.data(), bias.data(), pre.data(), y.data(), kTokens, kHidden, isa);
  });
}
PW_ISA_BENCHMARK(BM_BiasGeluForwardFused);

// Its backward: GeluBackward then BiasBackward, against the fused kernel.
void BM_GeluThenBiasBackward(benchmark::State& state) {
  auto pre = Filled(kHiddenElems, -4, 4), dy = Filled(pre.size(), -1, 1), dpre = pre,
       dbias = Filled(kHidden, 0, 0);
  RunIsa(state, 16.0 * pre.size(), [&](Isa isa) {
    GeluBackward(pre.data(), dy.data(), dpre.data(), pre.size(), isa);
    BiasBackward(dpre.data(), dbias.data(), kTokens, kHidden, isa);
  });
}
PW_ISA_BENCHMARK(BM_GeluThenBiasBackward);

void BM_BiasGeluBackwardFused(benchmark::State& state) {
  auto pre = Filled(kHiddenElems, -4, 4), dy = Filled(pre.size(), -1, 1), dpre = pre,
       dbias = Filled(kHidden, 0, 0);
  RunIsa(state, 12.0 * pre.size(), [&](Isa isa) {
    BiasGeluBackward(pre.data(), dy.data(), dpre.data(), dbias.data(), kTokens, kHidden, isa);
  });
}
PW_ISA_BENCHMARK(BM_BiasGeluBackwardFused);

void BM_BiasBackward(benchmark::State& state) {
  auto dy = Filled(kHiddenElems, -1, 1), dbias = Filled(kHidden, 0, 0);
  RunIsa(state, 4.0 * dy.size(),
         [&](Isa isa) { BiasBackward(dy.data(), dbias.data(), kTokens, kHidden, isa); });
}
PW_ISA_BENCHMARK(BM_BiasBackward);

void BM_AddInPlace(benchmark::State& state) {
  auto y = Filled(kActElems, -1, 1), x = Filled(kActElems, -1, 1);
  RunIsa(state, 12.0 * y.size(), [&](Isa isa) { AddInPlace(y.data(), x.data(), y.size(), isa); });
}
PW_ISA_BENCHMARK(BM_AddInPlace);

void BM_LayerNormForward(benchmark::State& state) {
  auto x = Filled(kActElems, -3, 5), y = x, g = Filled(kC, 0.5f, 1.5f), b = Filled(kC, -1, 1),
       mean = Filled(kTokens, 0, 0), rstd = mean;
  RunIsa(state, 8.0 * x.size(), [&](Isa isa) {
    LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), kTokens, kC,
                     1e-5f, isa);
  });
}
PW_ISA_BENCHMARK(BM_LayerNormForward);

void BM_LayerNormBackwardInput(benchmark::State& state) {
  auto x = Filled(kActElems, -3, 5), dy = Filled(kActElems, -1, 1), dx = x,
       g = Filled(kC, 0.5f, 1.5f), mean = Filled(kTokens, 0, 1), rstd = Filled(kTokens, 0.5f, 2);
  RunIsa(state, 12.0 * x.size(), [&](Isa isa) {
    LayerNormBackwardInput(x.data(), g.data(), mean.data(), rstd.data(), dy.data(), dx.data(),
                           kTokens, kC, isa);
  });
}
PW_ISA_BENCHMARK(BM_LayerNormBackwardInput);

void BM_LayerNormBackwardWeight(benchmark::State& state) {
  auto x = Filled(kActElems, -3, 5), dy = Filled(kActElems, -1, 1), dg = Filled(kC, 0, 0), db = dg,
       mean = Filled(kTokens, 0, 1), rstd = Filled(kTokens, 0.5f, 2);
  RunIsa(state, 8.0 * x.size(), [&](Isa isa) {
    LayerNormBackwardWeight(x.data(), mean.data(), rstd.data(), dy.data(), dg.data(), db.data(),
                            kTokens, kC, isa);
  });
}
PW_ISA_BENCHMARK(BM_LayerNormBackwardWeight);

void BM_CrossEntropyForwardBackward(benchmark::State& state) {
  auto logits = Filled(size_t(kTokens) * kVocab, -6, 6), dlogits = logits;
  std::vector<int32_t> t(kTokens);
  for (int r = 0; r < kTokens; ++r) t[r] = (r * 31) % kVocab;
  RunIsa(state, 12.0 * logits.size(), [&](Isa isa) {
    int64_t count = 0;
    benchmark::DoNotOptimize(
        SoftmaxCrossEntropyForward(logits.data(), t.data(), kTokens, kVocab, &count, isa));
    SoftmaxCrossEntropyBackward(logits.data(), t.data(), kTokens, kVocab, 1.0f / kTokens,
                                dlogits.data(), isa);
  });
}
PW_ISA_BENCHMARK(BM_CrossEntropyForwardBackward);

void BM_AdamW(benchmark::State& state) {
  const size_t n = size_t(12) * kC * kC;  // one block's weights
  auto p = Filled(n, -1, 1), g = Filled(n, -1, 1), m = Filled(n, -0.1f, 0.1f),
       v = Filled(n, 0, 0.01f);
  RunIsa(state, 28.0 * n, [&](Isa isa) {
    AdamWUpdate(p.data(), g.data(), m.data(), v.data(), n, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.1f, 10,
                1.0f, isa);
  });
}
PW_ISA_BENCHMARK(BM_AdamW);

// f32 -> 16 bits -> f32; arg bf16: 1 bfloat16, 0 IEEE half.
void BM_CastRoundTrip(benchmark::State& state) {
  auto x = Filled(kHiddenElems, -4, 4), y = x;
  std::vector<uint16_t> h(x.size());
  const bool bf16 = state.range(1) != 0;
  RunIsa(state, 12.0 * x.size(), [&](Isa isa) {
    if (bf16) {
      FloatToBf16(x.data(), h.data(), x.size(), isa);
      Bf16ToFloat(h.data(), y.data(), x.size(), isa);
    } else {
      FloatToHalf(x.data(), h.data(), x.size(), isa);
      HalfToFloat(h.data(), y.data(), x.size(), isa);
    }
  });
}
BENCHMARK(BM_CastRoundTrip)->ArgsProduct({{0, 1, 2}, {1, 0}})->ArgNames({"isa", "bf16"});

// Causal attention (flash-style, O(T D) memory per head), args {B, T, C, H}: gpt-small's
// micro-batch (8 x 128 tokens, 8 heads of 32), T = 1024 at gpt-small's width, and gpt2-124m's layer
// (12 heads of 64). Items are tokens. PIPEWRIGHT_CPU_ISA=avx2|baseline times the narrower variants.
struct AttentionBuffers {
  AttentionBuffers(int B, int T, int C, int H)
      : qkv(size_t(B) * T * 3 * C),
        dout(size_t(B) * T * C),
        out(dout.size()),
        lse(size_t(B) * H * T),
        dqkv(qkv.size()),
        scratch(std::max(AttentionForwardScratchFloats(T, C, H),
                         AttentionBackwardScratchFloats(T, C, H))) {
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = float(i % 13) * 0.05f - 0.3f;
    for (size_t i = 0; i < dout.size(); ++i) dout[i] = float(i % 7) * 0.1f - 0.3f;
  }
  std::vector<float> qkv, dout, out, lse, dqkv, scratch;
};

void BM_AttentionForward(benchmark::State& state) {
  const int B = state.range(0), T = state.range(1), C = state.range(2), H = state.range(3);
  AttentionBuffers a(B, T, C, H);
  for (auto _ : state) {
    AttentionForward(a.qkv.data(), a.out.data(), a.lse.data(), T, C, H, 0, B * H, a.scratch.data());
    benchmark::DoNotOptimize(a.out.data());
  }
  state.SetItemsProcessed(state.iterations() * B * T);
}

void BM_AttentionForwardBackward(benchmark::State& state) {
  const int B = state.range(0), T = state.range(1), C = state.range(2), H = state.range(3);
  AttentionBuffers a(B, T, C, H);
  for (auto _ : state) {
    AttentionForward(a.qkv.data(), a.out.data(), a.lse.data(), T, C, H, 0, B * H, a.scratch.data());
    AttentionBackward(a.dout.data(), a.qkv.data(), a.out.data(), a.lse.data(), a.dqkv.data(), T, C,
                      H, 0, B * H, a.scratch.data());
    benchmark::DoNotOptimize(a.dqkv.data());
  }
  state.SetItemsProcessed(state.iterations() * B * T);
}

void AttentionShapes(benchmark::internal::Benchmark* b) {
  b->Args({kTokens / kT, kT, kC, kH})->Args({1, 1024, kC, kH})->Args({1, 1024, 768, 12});
  b->ArgNames({"B", "T", "C", "H"})->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_AttentionForward)->Apply(AttentionShapes);
BENCHMARK(BM_AttentionForwardBackward)->Apply(AttentionShapes);

}  // namespace

int main(int argc, char** argv) {
  // The OpenBLAS kernels the CLI uses (its detection can fall short: cpu_features.cc).
  pipewright::ReexecForBlasCore(argv);
  pipewright::SetCpuKernelThreads(1);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
