// `pipewright eval`: a checkpoint's loss on held-out data (EvaluateCheckpoint), with the
// checkpoint it read and what it skipped on the way.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "pipewright/checkpoint.h"
#include "pipewright/cpu.h"
#include "pipewright/input.h"
#include "pipewright/train.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {

using json = nlohmann::json;

namespace {

// The data a checkpoint was trained on, as --data would name it: its manifest's data.source
// ("text:PATH (N bytes)", "tokens:PATH (…)", "megatron:PREFIX (…)", "llmc:PATH or GLOB (…)",
// "nanogpt:PATH (…)", "synthetic (…)"). Empty when the manifest cannot be
// read or names no data (eval then reports the checkpoint's own error, or falls back).
std::string TrainingData(const std::string& dir) {
  absl::StatusOr<std::string> text = ReadCheckpointManifest(dir);
  if (!text.ok()) return "";
  json m = json::parse(*text, nullptr, false);
  if (!m.is_object() || !m.contains("data") || !m["data"].is_object() ||
      !m["data"].contains("source") || !m["data"]["source"].is_string()) {
    return "";
  }
  const std::string source = m["data"]["source"].get<std::string>();
  if (source.rfind("synthetic", 0) == 0) return "synthetic";
  // The formats whose --data is the named part as is; nanoGPT's keeps its prefix.
  for (const char* prefix : {"text:", "tokens:", "megatron:", "llmc:", "nanogpt:"}) {
    const std::string p = prefix;
    if (source.rfind(p, 0) != 0) continue;
    const size_t end = source.rfind(" (");
    const size_t from = p == "nanogpt:" ? 0 : p.size();
    return source.substr(
        from, end == std::string::npos || end < p.size() ? std::string::npos : end - from);
  }
  return "";
}

}  // namespace

void RegisterEval(CLI::App& app, int* exit_code) {
  struct EvalFlags {
    std::string checkpoint, data = "synthetic", dump;
    int64_t batches = 16;
    bool json = false;
  };
  auto f = std::make_shared<EvalFlags>();
  CLI::App* cmd = app.add_subcommand("eval", "Evaluate a checkpoint's loss on data");
  cmd->add_option("--checkpoint", f->checkpoint, "Checkpoint directory")->required();
  CLI::Option* data = cmd->add_option(
      "--data", f->data,
      "synthetic, a token file, or a text file (default: the data the checkpoint was trained "
      "on, as its manifest records it)");
  AddInt(cmd, "--batches", &f->batches, {1, 65536}, "Held-out batches to evaluate");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->add_option("--dump", f->dump,
                  "Also write the evaluated tokens and targets as JSON to FILE (scripts/hf-check "
                  "runs the same tokens through transformers)");
  cmd->callback([f, data, exit_code] {
    SetCpuKernelThreads(1);
    bool own_data = false;
    if (data->count() == 0) {
      const std::string recorded = TrainingData(f->checkpoint);
      own_data = !recorded.empty();
      if (own_data) {
        f->data = recorded;
      } else {
        // A checkpoint that does not record its data as --data can name it: say what is used.
        std::fprintf(stderr,
                     "warning: %s does not name its training data as --data could; evaluating "
                     "%s (give --data)\n",
                     f->checkpoint.c_str(), f->data.c_str());
      }
    }
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
      json j = {{"model", r->model},
                {"checkpoint", r->path},
                {"step", r->step},
                {"loss", r->loss},
                {"perplexity", r->perplexity},
                {"tokens", r->tokens},
                {"data", f->data},
                {"data_is_the_training_data", own_data}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf(
          "eval: %s at step %lld (%s): loss %.4f, perplexity %.3f over %lld tokens of %s (%s; "
          "held-out windows: sample indices from 2^40, never a training step's)\n",
          r->model.c_str(), static_cast<long long>(r->step), r->path.c_str(), r->loss,
          r->perplexity, static_cast<long long>(r->tokens), f->data.c_str(),
          own_data ? "the checkpoint's training data" : "--data");
    }
    *exit_code = 0;
  });
}

}  // namespace pipewright::tools
