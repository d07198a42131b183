// `pipewright bench --suite kernels`: achieved GFLOP/s of a gpt-small training step (forward,
// backward, optimizer; one thread) against single-thread GEMM: OpenBLAS sgemm and, where the step
// runs it, pipewright's own fp32 GEMM, whichever is faster; and of its bf16 step against the bf16
// GEMM that step runs (AMX where the CPU has it).
#ifndef PIPEWRIGHT_BENCH_KERNEL_SUITE_H_
#define PIPEWRIGHT_BENCH_KERNEL_SUITE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pipewright::bench {

struct BenchRow {
  std::string name;
  double seconds = 0;  // median time of one repetition
  double gflops_per_s = 0;
  double flops = 0;  // per repetition
};

struct KernelSuiteResult {
  std::vector<BenchRow> rows;
  double sgemm_gflops_per_s = 0;  // best single-thread OpenBLAS sgemm among the reference shapes
  double gemm_gflops_per_s = 0;   // best of every reference product (OpenBLAS and pipewright)
  double step_gflops_per_s = 0;
  // The step's rate over the best OpenBLAS sgemm's (the figure issue 14 set a target for), and
  // over the best of every reference product's; medians over rounds (Note [Interleaved rounds]).
  double fraction_of_sgemm = 0;
  double fraction_of_gemm = 0;
  // With a native bf16 kernel (AVX-512): the bf16 products' kernel (cpu::Bf16GemmKernel(): "amx",
  // "vdpbf16ps" or "fma"), its best rate on the reference shapes, the gpt-small bf16 step's
  // rate (the fp32 step's FLOPs), and that step's fraction of the bf16 products' (median).
  std::string bf16_kernel;
  double bf16_gemm_gflops_per_s = 0;
  double bf16_step_gflops_per_s = 0;
  double bf16_fraction_of_gemm = 0;
};

// `repetitions` interleaved rounds after one warm-up (Note [Interleaved rounds] in
// kernel_suite.cc).
absl::StatusOr<KernelSuiteResult> RunKernelSuite(int repetitions);

}  // namespace pipewright::bench

#endif  // PIPEWRIGHT_BENCH_KERNEL_SUITE_H_
