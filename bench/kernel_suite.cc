#include "bench/kernel_suite.h"

#include <algorithm>
#include <functional>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/cpu.h"
#include "pipewright/train.h"

namespace pipewright::bench {
namespace {

// One reference product: C = A B^T with m x n x k, on OpenBLAS's sgemm or on pipewright's own
// fp32 GEMM (cpu::Gemm where cpu::OwnF32Gemm()), timed as a batch of calls of at least
// kMinBatchSeconds (one product is ~3 ms, short enough for timer and scheduling noise).
struct Sgemm {
  int m, n, k;
  bool blas;
  std::vector<float> a, b, c;
  int calls = 1;
  Sgemm(int m_, int n_, int k_, bool blas_)
      : m(m_),
        n(n_),
        k(k_),
        blas(blas_),
        a(static_cast<size_t>(m_) * k_, 0.5f),
        b(static_cast<size_t>(k_) * n_, 0.25f),
        c(static_cast<size_t>(m_) * n_) {}
  void Run() {
    for (int i = 0; i < calls; ++i) {
      if (blas) {
        cpu::BlasSgemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
      } else {
        cpu::Gemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
      }
    }
  }
  double flops() const { return 2.0 * m * n * k; }
};

constexpr double kMinBatchSeconds = 0.03;

double Seconds(const std::function<void()>& fn) {
  const absl::Time s = absl::Now();
  fn();
  return absl::ToDoubleSeconds(absl::Now() - s);
}

}  // namespace

// Note [Interleaved rounds]. The machine's speed drifts (shared hosts: the same sgemm measured
// 96 to 150 GFLOP/s within minutes), so the suite measures in rounds: each round times every
// reference product, then one training step. The step's fraction of GEMM is the median over
// rounds of (step rate / best product rate of the same round); the rows show medians.
absl::StatusOr<KernelSuiteResult> RunKernelSuite(int repetitions) {
  SetCpuKernelThreads(1);
  KernelSuiteResult out;
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetModel("gpt-small", 0));
  const int tokens = static_cast<int>(graph.shape().tokens());
  // The GEMM shapes of one gpt-small block for one micro-batch, plus a square reference, on
  // OpenBLAS and (where the step uses it) on pipewright's own GEMM: the step is measured
  // against the fastest of them.
  const int c = 256;
  std::vector<Sgemm> gemms;
  for (bool blas : {true, false}) {
    if (!blas && !cpu::OwnF32Gemm()) continue;
    for (auto [m, n, k] : std::vector<std::tuple<int, int, int>>{
             {1024, 1024, 1024}, {tokens, 3 * c, c}, {tokens, 4 * c, c}, {tokens, c, 4 * c}}) {
      gemms.emplace_back(m, n, k, blas);
    }
  }
  TrainOptions o;
  o.steps = repetitions + 1;
  o.warmup_steps = 0;
  o.threads_per_rank = 1;  // the step against single-thread GEMM: one thread on both sides
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(graph, 1, o));
  absl::Status status;
  auto step = [&] {
    auto r = trainer->Step();
    if (!r.ok() && status.ok()) status = r.status();
  };
  const Cost cost = graph.TotalCost();
  const double step_flops = cost.forward_flops + cost.backward_flops;
  // Warm-up: one step and one call of each product, which also sizes the batches.
  step();
  PW_RETURN_IF_ERROR(status);
  for (Sgemm& g : gemms) {
    const double once = std::max(1e-6, Seconds([&] { g.Run(); }));
    g.calls = std::max(1, static_cast<int>(kMinBatchSeconds / once));
  }
  std::vector<std::vector<double>> gemm_s(gemms.size());
  std::vector<double> step_s, fraction, fraction_all;
  for (int rep = 0; rep < repetitions; ++rep) {
    double best_blas = 0, best = 0;
    for (size_t i = 0; i < gemms.size(); ++i) {
      const double t = Seconds([&] { gemms[i].Run(); }) / gemms[i].calls;
      gemm_s[i].push_back(t);
      if (gemms[i].blas) best_blas = std::max(best_blas, gemms[i].flops() / t);
      best = std::max(best, gemms[i].flops() / t);
    }
    const double t = Seconds(step);
    PW_RETURN_IF_ERROR(status);
    step_s.push_back(t);
    fraction.push_back(step_flops / t / best_blas);
    fraction_all.push_back(step_flops / t / best);
  }
  for (size_t i = 0; i < gemms.size(); ++i) {
    BenchRow r;
    r.name =
        absl::StrFormat("%s %dx%dx%d", gemms[i].blas ? "sgemm (OpenBLAS)" : "gemm (pipewright)",
                        gemms[i].m, gemms[i].n, gemms[i].k);
    r.flops = gemms[i].flops();
    r.seconds = Median(gemm_s[i]);
    r.gflops_per_s = r.flops / r.seconds / 1e9;
    if (gemms[i].blas) out.sgemm_gflops_per_s = std::max(out.sgemm_gflops_per_s, r.gflops_per_s);
    out.gemm_gflops_per_s = std::max(out.gemm_gflops_per_s, r.gflops_per_s);
    out.rows.push_back(r);
  }
  BenchRow row;
  row.name = absl::StrFormat("gpt-small train step (%d tokens, fwd+bwd+adamw)", tokens);
  row.flops = step_flops;
  row.seconds = Median(step_s);
  row.gflops_per_s = row.flops / row.seconds / 1e9;
  out.rows.push_back(row);
  out.step_gflops_per_s = row.gflops_per_s;
  out.fraction_of_sgemm = Median(fraction);
  out.fraction_of_gemm = Median(fraction_all);
  return out;
}

}  // namespace pipewright::bench
