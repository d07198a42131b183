// Google Benchmark microbenchmarks of the CPU kernels at gpt-small shapes (one thread):
//   build/bin/kernels_bench --benchmark_filter=Gelu
#include <benchmark/benchmark.h>

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

void BM_GeluForward(benchmark::State& state) {
  std::vector<float> x(size_t(kTokens) * 4 * kC, 0.3f), y(x.size());
  for (auto _ : state) {
    GeluForward(x.data(), y.data(), x.size());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * x.size());
}
BENCHMARK(BM_GeluForward);

void BM_LayerNormForward(benchmark::State& state) {
  std::vector<float> x(size_t(kTokens) * kC, 0.3f), y(x.size()), g(kC, 1.0f), b(kC, 0.0f),
      mean(kTokens), rstd(kTokens);
  for (int i = 0; i < int(x.size()); ++i) x[i] = float(i % 17);
  for (auto _ : state) {
    LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), kTokens, kC,
                     1e-5f);
    benchmark::DoNotOptimize(y.data());
  }
}
BENCHMARK(BM_LayerNormForward);

void BM_AttentionForwardBackward(benchmark::State& state) {
  const int B = kTokens / kT;
  std::vector<float> qkv(size_t(kTokens) * 3 * kC), out(size_t(kTokens) * kC),
      probs(size_t(B) * kH * kT * kT), dqkv(qkv.size()), scratch(size_t(kT) * kT);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = float(i % 13) * 0.01f;
  for (auto _ : state) {
    AttentionForward(qkv.data(), out.data(), probs.data(), B, kT, kC, kH);
    AttentionBackward(out.data(), qkv.data(), probs.data(), dqkv.data(), scratch.data(), B, kT, kC,
                      kH);
    benchmark::DoNotOptimize(dqkv.data());
  }
}
BENCHMARK(BM_AttentionForwardBackward);

}  // namespace

int main(int argc, char** argv) {
  pipewright::SetCpuKernelThreads(1);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
