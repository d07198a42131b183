// `pipewright bench`: benchmark suites (more suites arrive with the runtime issue).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "bench/kernel_suite.h"
#include "tools/commands.h"

namespace pipewright::tools {

void RegisterBench(CLI::App& app, int* exit_code) {
  struct BenchFlags {
    std::string suite = "kernels";
    int repetitions = 5;
    bool json = false;
  };
  auto f = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand("bench", "Run a benchmark suite");
  cmd->add_option("--suite", f->suite, "kernels")->check(CLI::IsMember({"kernels"}));
  cmd->add_option("--repetitions", f->repetitions, "Timed repetitions per row (median)")
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->callback([f, exit_code] {
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
                        {"rows", rows},
                        {"sgemm_gflops_per_s", r->sgemm_gflops_per_s},
                        {"step_gflops_per_s", r->step_gflops_per_s},
                        {"fraction_of_sgemm", r->fraction_of_sgemm}};
    if (f->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      for (const auto& row : r->rows) {
        std::printf("%-55s %10.4f s %8.2f GFLOP/s\n", row.name.c_str(), row.seconds,
                    row.gflops_per_s);
      }
      std::printf("train step reaches %.1f%% of single-thread sgemm\n", 100 * r->fraction_of_sgemm);
    }
    *exit_code = 0;
  });
}

}  // namespace pipewright::tools
