#include "bench/kernel_suite.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/cpu.h"
#include "pipewright/train.h"

namespace pipewright::bench {
namespace {

BenchRow SgemmRow(int m, int n, int k, int reps) {
  std::vector<float> a(static_cast<size_t>(m) * k, 0.5f), b(static_cast<size_t>(k) * n, 0.25f),
      c(static_cast<size_t>(m) * n);
  BenchRow r;
  r.name = absl::StrFormat("sgemm %dx%dx%d", m, n, k);
  r.flops = 2.0 * m * n * k;
  r.seconds = MedianSeconds(reps, [&] {
    cpu::Gemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
  });
  r.gflops_per_s = r.flops / r.seconds / 1e9;
  return r;
}

}  // namespace

absl::StatusOr<KernelSuiteResult> RunKernelSuite(int repetitions) {
  SetCpuKernelThreads(1);
  KernelSuiteResult out;
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetModel("gpt-small", 0));
  const int tokens = static_cast<int>(graph.shape().tokens());
  // The GEMM shapes of one gpt-small block for one micro-batch, plus a square reference.
  const int c = 256;
  for (auto [m, n, k] : std::vector<std::tuple<int, int, int>>{
           {1024, 1024, 1024}, {tokens, 3 * c, c}, {tokens, 4 * c, c}, {tokens, c, 4 * c}}) {
    BenchRow r = SgemmRow(m, n, k, repetitions);
    out.sgemm_gflops_per_s = std::max(out.sgemm_gflops_per_s, r.gflops_per_s);
    out.rows.push_back(r);
  }
  TrainOptions o;
  o.steps = repetitions + 1;
  o.warmup_steps = 0;
  o.threads_per_rank = 1;  // the step against single-thread sgemm: one thread on both sides
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(graph, 1, o));
  absl::Status status;
  BenchRow step;
  step.name = absl::StrFormat("gpt-small train step (%d tokens, fwd+bwd+adamw)", tokens);
  const Cost cost = graph.TotalCost();
  step.flops = cost.forward_flops + cost.backward_flops;
  step.seconds = MedianSeconds(repetitions, [&] {
    auto r = trainer->Step();
    if (!r.ok()) status = r.status();
  });
  PW_RETURN_IF_ERROR(status);
  step.gflops_per_s = step.flops / step.seconds / 1e9;
  out.rows.push_back(step);
  out.step_gflops_per_s = step.gflops_per_s;
  out.fraction_of_sgemm = out.step_gflops_per_s / out.sgemm_gflops_per_s;
  return out;
}

}  // namespace pipewright::bench
