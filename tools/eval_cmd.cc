// `pipewright eval`: a checkpoint's loss on held-out data (EvaluateCheckpoint), with the
// checkpoint it read and what it skipped on the way.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "pipewright/cpu.h"
#include "pipewright/input.h"
#include "pipewright/train.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {

using json = nlohmann::json;

void RegisterEval(CLI::App& app, int* exit_code) {
  struct EvalFlags {
    std::string checkpoint, data = "synthetic", dump;
    int64_t batches = 16;
    bool json = false;
  };
  auto f = std::make_shared<EvalFlags>();
  CLI::App* cmd = app.add_subcommand("eval", "Evaluate a checkpoint's loss on data");
  cmd->add_option("--checkpoint", f->checkpoint, "Checkpoint directory")->required();
  cmd->add_option("--data", f->data, "synthetic, a token file, or a text file");
  AddInt(cmd, "--batches", &f->batches, {1, 65536}, "Held-out batches to evaluate");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->add_option("--dump", f->dump,
                  "Also write the evaluated tokens and targets as JSON to FILE (scripts/hf-check "
                  "runs the same tokens through transformers)");
  cmd->callback([f, exit_code] {
    SetCpuKernelThreads(1);
    if (!f->dump.empty()) {
      if (absl::Status s = CheckOutputPath(f->dump, "--dump"); !s.ok()) {
        *exit_code = ReportError(s);
        return;
      }
    }
    auto r = EvaluateCheckpoint(f->checkpoint, f->data, f->batches);
    if (!r.ok()) {
      *exit_code = ReportError(r.status());
      return;
    }
    for (const std::string& w : r->warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
    if (!f->dump.empty()) {
      json d = {{"loss", r->loss}, {"inputs", json::array()}, {"targets", json::array()}};
      for (size_t i = 0; i < r->inputs.size(); ++i) {
        const Tensor& in = r->inputs[i];
        const Tensor& t = r->targets[i];
        for (int64_t b = 0; b < in.dim(0); ++b) {
          const int32_t* x = in.data<int32_t>() + b * in.dim(1);
          const int32_t* y = t.data<int32_t>() + b * t.dim(1);
          d["inputs"].push_back(std::vector<int32_t>(x, x + in.dim(1)));
          d["targets"].push_back(std::vector<int32_t>(y, y + t.dim(1)));
        }
      }
      if (absl::Status s = WriteFile(f->dump, d.dump(), "--dump"); !s.ok()) {
        *exit_code = ReportError(s);
        return;
      }
    }
    if (f->json) {
      json j = {{"model", r->model}, {"checkpoint", r->path},       {"step", r->step},
                {"loss", r->loss},   {"perplexity", r->perplexity}, {"tokens", r->tokens}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("eval: %s at step %lld (%s): loss %.4f, perplexity %.3f over %lld tokens\n",
                  r->model.c_str(), static_cast<long long>(r->step), r->path.c_str(), r->loss,
                  r->perplexity, static_cast<long long>(r->tokens));
    }
    *exit_code = 0;
  });
}

}  // namespace pipewright::tools
