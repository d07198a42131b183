// `pipewright bench`: benchmark suites (kernels, overhead, scaling, partitioner, cuda).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/kernel_suite.h"
#include "bench/partitioner_suite.h"
#include "bench/pipeline_suite.h"
#include "pipewright/cpu.h"
#include "tools/commands.h"
#include "tools/flags.h"

#if PIPEWRIGHT_WITH_CUDA
#include "bench/cuda_suite.h"
#endif

namespace pipewright::tools {

namespace {

int RunOverhead(int steps, double stage_ms, bool as_json) {
  bench::OverheadConfig c;
  c.steps = steps;
  c.stage_seconds = stage_ms / 1e3;
  auto r = bench::RunOverheadSuite(c);
  if (!r.ok()) return ReportError(r.status());
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : *r) {
    rows.push_back({{"schedule", row.schedule},
                    {"stages", row.stages},
                    {"micro_batches", row.micro_batches},
                    {"chunks", row.chunks},
                    {"measured_step_s", row.measured_step_s},
                    {"predicted_step_s", row.predicted_step_s},
                    {"ratio", row.ratio},
                    {"measured_bubble", row.measured_bubble},
                    {"predicted_bubble", row.predicted_bubble}});
  }
  if (as_json) {
    nlohmann::json j = {{"suite", "overhead"},
                        {"stage_seconds", c.stage_seconds},
                        {"steps", steps},
                        {"rows", rows}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "engine overhead: p=%d m=%d, stage F = I = W = %.1f ms (Delay layers), median of %d "
      "steps\n%-12s %8s %12s %12s %8s %10s %10s\n",
      c.stages, c.micro_batches, stage_ms, steps, "schedule", "chunks", "measured s", "simulator s",
      "ratio", "bubble", "sim bubble");
  for (const auto& row : *r) {
    std::printf("%-12s %8d %12.4f %12.4f %8.3f %9.1f%% %9.1f%%\n", row.schedule.c_str(), row.chunks,
                row.measured_step_s, row.predicted_step_s, row.ratio, 100 * row.measured_bubble,
                100 * row.predicted_bubble);
  }
  return 0;
}

int RunScaling(int micro_batches, int steps, bool as_json) {
  auto r = bench::RunScalingSuite(micro_batches, steps);
  if (!r.ok()) return ReportError(r.status());
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : r->rows) {
    rows.push_back({{"stages", row.stages},
                    {"micro_batches", row.micro_batches},
                    {"step_s", row.step_s},
                    {"tokens_per_s", row.tokens_per_s}});
  }
  if (as_json) {
    nlohmann::json j = {{"suite", "scaling"},         {"model", "gpt-small"},
                        {"blas_threads_per_rank", 1}, {"rows", rows},
                        {"speedup", r->speedup},      {"ideal_speedup", r->ideal},
                        {"efficiency", r->efficiency}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  for (const auto& row : r->rows) {
    std::printf("gpt-small pp=%d m=%d: %.3f s/step, %.0f tokens/s\n", row.stages, row.micro_batches,
                row.step_s, row.tokens_per_s);
  }
  std::printf("speedup %.2fx of ideal 2m/(m+1) = %.2fx: %.0f%% efficiency\n", r->speedup, r->ideal,
              100 * r->efficiency);
  return 0;
}

int RunPartitioner(int repetitions, bool as_json) {
  auto r = bench::RunPartitionerSuite(repetitions);
  if (!r.ok()) return ReportError(r.status());
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : *r) {
    rows.push_back({{"name", row.name},
                    {"layers", row.layers},
                    {"stages", row.stages},
                    {"micro_batches", row.micro_batches},
                    {"schedule", row.schedule},
                    {"seconds", row.seconds},
                    {"candidates", row.candidates},
                    {"bottleneck_s", row.bottleneck_s},
                    {"lower_bound_s", row.lower_bound_s},
                    {"recomputed_stages", row.recomputed_stages}});
  }
  if (as_json) {
    nlohmann::json j = {{"suite", "partitioner"}, {"repetitions", repetitions}, {"rows", rows}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%-60s %6s %6s %10s %10s %12s %12s %6s\n", "partition", "layers", "stages", "seconds",
              "partitions", "bottleneck", "lower bound", "recomp");
  for (const auto& row : *r) {
    std::printf("%-60s %6d %6d %10.4f %10d %11.4gs %11.4gs %6d\n", row.name.c_str(), row.layers,
                row.stages, row.seconds, row.candidates, row.bottleneck_s, row.lower_bound_s,
                row.recomputed_stages);
  }
  return 0;
}

int RunCuda(int repetitions, bool as_json) {
#if PIPEWRIGHT_WITH_CUDA
  auto r = bench::RunCudaSuite(repetitions);
  if (!r.ok()) return ReportError(r.status());
  nlohmann::json gemm = nlohmann::json::array();
  for (const auto& row : r->gemm_rows) {
    gemm.push_back({{"name", row.name},
                    {"dtype", row.dtype},
                    {"m", row.m},
                    {"n", row.n},
                    {"k", row.k},
                    {"seconds", row.seconds},
                    {"tflops_per_s", row.tflops_per_s}});
  }
  nlohmann::json copies = nlohmann::json::array();
  for (const auto& row : r->copy_rows) {
    copies.push_back({{"name", row.name},
                      {"bytes", row.bytes},
                      {"seconds", row.seconds},
                      {"gb_per_s", row.gb_per_s}});
  }
  if (as_json) {
    nlohmann::json j = {{"suite", "cuda"},
                        {"device", r->device_name},
                        {"device_count", r->device_count},
                        {"repetitions", repetitions},
                        {"gemm", gemm},
                        {"copies", copies},
                        {"measured_bf16_peak_tflops", r->measured_bf16_peak_tflops},
                        {"d2d_copy_gb_per_s", r->d2d_gb_per_s}};
    if (r->peer_gb_per_s >= 0) {
      j["peer_copy_gb_per_s"] = r->peer_gb_per_s;
      j["peer_access"] = r->peer_access;
    } else {
      j["peer_copy_gb_per_s"] = nullptr;
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s (%d CUDA device%s), median of %d runs, inputs rotated between 2 sets\n",
              r->device_name.c_str(), r->device_count, r->device_count == 1 ? "" : "s",
              repetitions);
  for (const auto& row : r->gemm_rows) {
    std::printf("%-44s %10.3f ms %9.1f TFLOP/s\n", row.name.c_str(), 1e3 * row.seconds,
                row.tflops_per_s);
  }
  for (const auto& row : r->copy_rows) {
    std::printf("%-66s %10.3f ms %9.1f GB/s\n", row.name.c_str(), 1e3 * row.seconds, row.gb_per_s);
  }
  std::printf("measured bf16 peak: %.1f TFLOP/s\n", r->measured_bf16_peak_tflops);
  return 0;
#else
  (void)repetitions;
  (void)as_json;
  return ReportError(absl::UnavailableError(
      "no CUDA device: this pipewright was built without CUDA (PIPEWRIGHT_CUDA=OFF or no nvcc)"));
#endif
}

}  // namespace

void RegisterBench(CLI::App& app, int* exit_code) {
  struct BenchFlags {
    std::string suite = "kernels";
    int repetitions = 5;
    int steps = 3;
    int micro_batches = 8;
    double stage_ms = 10;
    bool json = false;
  };
  auto f = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand("bench", "Run a benchmark suite");
  cmd->add_option("--suite", f->suite, "kernels | overhead | scaling | partitioner | cuda")
      ->check(CLI::IsMember({"kernels", "overhead", "scaling", "partitioner", "cuda"}));
  AddInt(cmd, "--steps", &f->steps, {1, 1000}, "Timed steps per row (overhead, scaling)");
  AddInt(cmd, "--micro-batches", &f->micro_batches, {1, 4096}, "Micro-batches (scaling)");
  AddReal(cmd, "--stage-ms", &f->stage_ms, RealRange::Closed(0.01, 10000),
          "Delay of one stage's F, I and W (overhead)");
  AddInt(cmd, "--repetitions", &f->repetitions, {1, 1000}, "Timed repetitions per row (median)");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->callback([f, exit_code] {
    if (f->suite == "overhead") {
      *exit_code = RunOverhead(f->steps, f->stage_ms, f->json);
      return;
    }
    if (f->suite == "partitioner") {
      *exit_code = RunPartitioner(f->repetitions, f->json);
      return;
    }
    if (f->suite == "cuda") {
      *exit_code = RunCuda(f->repetitions, f->json);
      return;
    }
    if (f->suite == "scaling") {
      *exit_code = RunScaling(f->micro_batches, f->steps, f->json);
      return;
    }
    auto r = bench::RunKernelSuite(f->repetitions);
    if (!r.ok()) {
      *exit_code = ReportError(r.status());
      return;
    }
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& row : r->rows) {
      rows.push_back({{"name", row.name},
                      {"seconds", row.seconds},
                      {"gflops_per_s", row.gflops_per_s},
                      {"flops", row.flops}});
    }
    nlohmann::json j = {{"suite", "kernels"},
                        {"threads", 1},
                        {"isa", CpuKernelIsa()},
                        {"blas_core", BlasCoreName()},
                        {"gemm", CpuGemmName()},
                        {"rows", rows},
                        {"sgemm_gflops_per_s", r->sgemm_gflops_per_s},
                        {"gemm_gflops_per_s", r->gemm_gflops_per_s},
                        {"step_gflops_per_s", r->step_gflops_per_s},
                        {"step_fraction_of_sgemm", r->fraction_of_sgemm},
                        {"step_fraction_of_gemm", r->fraction_of_gemm}};
    if (!r->bf16_kernel.empty()) {
      j["bf16_kernel"] = r->bf16_kernel;
      j["bf16_gemm_gflops_per_s"] = r->bf16_gemm_gflops_per_s;
      j["bf16_step_gflops_per_s"] = r->bf16_step_gflops_per_s;
      j["bf16_step_fraction_of_gemm"] = r->bf16_fraction_of_gemm;
    }
    if (f->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("CPU kernels: %s; fp32 GEMM: %s; OpenBLAS kernels: %s\n", CpuKernelIsa().c_str(),
                  CpuGemmName().c_str(), BlasCoreName().c_str());
      for (const auto& row : r->rows) {
        std::printf("%-55s %10.4f s %8.2f GFLOP/s\n", row.name.c_str(), row.seconds,
                    row.gflops_per_s);
      }
      std::printf("train step reaches %.1f%% of single-thread OpenBLAS sgemm",
                  100 * r->fraction_of_sgemm);
      if (r->gemm_gflops_per_s > r->sgemm_gflops_per_s) {
        std::printf(", %.1f%% of the fastest GEMM above", 100 * r->fraction_of_gemm);
      }
      std::printf("\n");
      if (!r->bf16_kernel.empty()) {
        std::printf("bf16 train step reaches %.1f%% of the bf16 GEMM (%s) above\n",
                    100 * r->bf16_fraction_of_gemm, r->bf16_kernel.c_str());
      }
    }
    *exit_code = 0;
  });
}

}  // namespace pipewright::tools
