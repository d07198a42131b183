#include "bench/kernel_suite.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/cpu.h"
#include "pipewright/precision.h"
#include "pipewright/train.h"

namespace pipewright::bench {
namespace {

// One reference product: C = A B^T with m x n x k, on OpenBLAS's sgemm, on pipewright's own
// fp32 GEMM (cpu::Gemm where cpu::OwnF32Gemm()), or on bf16 inputs with the kernel the bf16 step
// uses (cpu::Bf16GemmKernel(): AMX, vdpbf16ps or fma; one thread), timed as a batch of calls of at
// least kMinBatchSeconds (one product is ~3 ms, short enough for timer and scheduling noise).
struct Sgemm {
  enum class Kind { kBlas, kOwn, kBf16 };
  int m, n, k;
  Kind kind;
  std::vector<float> a, b, c;
  std::vector<uint16_t> a16, b16;
  int calls = 1;
  Sgemm(int m_, int n_, int k_, Kind kind_)
      : m(m_),
        n(n_),
        k(k_),
        kind(kind_),
        a(static_cast<size_t>(m_) * k_, 0.5f),
        b(static_cast<size_t>(k_) * n_, 0.25f),
        c(static_cast<size_t>(m_) * n_),
        a16(kind_ == Kind::kBf16 ? a.size() : 0, 0x3F00),    // bf16 0.5
        b16(kind_ == Kind::kBf16 ? b.size() : 0, 0x3E80) {}  // bf16 0.25
  void Run() {
    for (int i = 0; i < calls; ++i) {
      if (kind == Kind::kBlas) {
        cpu::BlasSgemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
      } else if (kind == Kind::kOwn) {
        cpu::Gemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
      } else {
        cpu::GemmHalfBlock(true, false, true, m, n, k, 1.0f, a16.data(), k, b16.data(), k, 0.0f,
                           c.data(), n, 0, m, 0, n, cpu::Bf16GemmKernel());
      }
    }
  }
  double flops() const { return 2.0 * m * n * k; }
  std::string Name() const {
    const std::string what =
        kind == Kind::kBlas ? "sgemm (OpenBLAS)"
        : kind == Kind::kOwn
            ? "gemm (pipewright)"
            : absl::StrFormat("bf16 gemm (%s)", cpu::HalfGemmKernelName(cpu::Bf16GemmKernel()));
    return absl::StrFormat("%s %dx%dx%d", what, m, n, k);
  }
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
  // The bf16 step and products too, where the CPU has a native bf16 kernel (AVX-512).
  const bool bf16 = cpu::HaveGemmHalfAvx512() && cpu::KernelIsa() == cpu::Isa::kAvx512;
  std::vector<Sgemm> gemms;
  using Kind = Sgemm::Kind;
  for (Kind kind : {Kind::kBlas, Kind::kOwn, Kind::kBf16}) {
    if (kind == Kind::kOwn && !cpu::OwnF32Gemm()) continue;
    if (kind == Kind::kBf16 && !bf16) continue;
    for (auto [m, n, k] : std::vector<std::tuple<int, int, int>>{
             {1024, 1024, 1024}, {tokens, 3 * c, c}, {tokens, 4 * c, c}, {tokens, c, 4 * c}}) {
      gemms.emplace_back(m, n, k, kind);
    }
  }
  TrainOptions o;
  o.steps = repetitions + 1;
  o.warmup_steps = 0;
  o.threads_per_rank = 1;  // the step against single-thread GEMM: one thread on both sides
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(graph, 1, o));
  std::unique_ptr<Trainer> trainer16;
  if (bf16) {
    TrainOptions o16 = o;
    o16.precision = Precision::kBf16;
    PW_ASSIGN_OR_RETURN(trainer16, Trainer::Create(graph, 1, o16));
  }
  absl::Status status;
  auto step_of = [&](Trainer* t) {
    auto r = t->Step();
    if (!r.ok() && status.ok()) status = r.status();
  };
  auto step = [&] { step_of(trainer.get()); };
  auto step16 = [&] { step_of(trainer16.get()); };
  const Cost cost = graph.TotalCost();
  const double step_flops = cost.forward_flops + cost.backward_flops;
  // Warm-up: one step and one call of each product, which also sizes the batches.
  step();
  if (bf16) step16();
  PW_RETURN_IF_ERROR(status);
  for (Sgemm& g : gemms) {
    const double once = std::max(1e-6, Seconds([&] { g.Run(); }));
    g.calls = std::max(1, static_cast<int>(kMinBatchSeconds / once));
  }
  std::vector<std::vector<double>> gemm_s(gemms.size());
  std::vector<double> step_s, fraction, fraction_all, step16_s, fraction16;
  for (int rep = 0; rep < repetitions; ++rep) {
    double best_blas = 0, best = 0, best16 = 0;
    for (size_t i = 0; i < gemms.size(); ++i) {
      const double t = Seconds([&] { gemms[i].Run(); }) / gemms[i].calls;
      gemm_s[i].push_back(t);
      const double rate = gemms[i].flops() / t;
      if (gemms[i].kind == Kind::kBlas) best_blas = std::max(best_blas, rate);
      if (gemms[i].kind == Kind::kBf16) {
        best16 = std::max(best16, rate);
      } else {
        best = std::max(best, rate);
      }
    }
    const double t = Seconds(step);
    PW_RETURN_IF_ERROR(status);
    step_s.push_back(t);
    fraction.push_back(step_flops / t / best_blas);
    fraction_all.push_back(step_flops / t / best);
    if (bf16) {
      const double t16 = Seconds(step16);
      PW_RETURN_IF_ERROR(status);
      step16_s.push_back(t16);
      fraction16.push_back(step_flops / t16 / best16);
    }
  }
  for (size_t i = 0; i < gemms.size(); ++i) {
    BenchRow r;
    r.name = gemms[i].Name();
    r.flops = gemms[i].flops();
    r.seconds = Median(gemm_s[i]);
    r.gflops_per_s = r.flops / r.seconds / 1e9;
    if (gemms[i].kind == Kind::kBlas) {
      out.sgemm_gflops_per_s = std::max(out.sgemm_gflops_per_s, r.gflops_per_s);
    }
    if (gemms[i].kind == Kind::kBf16) {
      out.bf16_gemm_gflops_per_s = std::max(out.bf16_gemm_gflops_per_s, r.gflops_per_s);
    } else {
      out.gemm_gflops_per_s = std::max(out.gemm_gflops_per_s, r.gflops_per_s);
    }
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
  if (bf16) {
    BenchRow r16;
    r16.name = absl::StrFormat("gpt-small bf16 train step (%d tokens, %s)", tokens,
                               cpu::HalfGemmKernelName(cpu::Bf16GemmKernel()));
    r16.flops = step_flops;
    r16.seconds = Median(step16_s);
    r16.gflops_per_s = r16.flops / r16.seconds / 1e9;
    out.rows.push_back(r16);
    out.bf16_kernel = cpu::HalfGemmKernelName(cpu::Bf16GemmKernel());
    out.bf16_step_gflops_per_s = r16.gflops_per_s;
    out.bf16_fraction_of_gemm = Median(fraction16);
  }
  return out;
}

}  // namespace pipewright::bench
