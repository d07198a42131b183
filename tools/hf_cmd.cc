// `pipewright export` and `pipewright import`: checkpoints to and from other tools' formats
// (today Hugging Face transformers' GPT-2; docs/checkpoint.md, "Hugging Face").
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "pipewright/checkpoint.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {
namespace {

absl::Status CheckFormat(const std::string& format) {
  if (format == "hf") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--format ", format, ": unknown (hf: Hugging Face transformers' GPT-2)"));
}

}  // namespace

void RegisterExport(CLI::App& app, int* exit_code) {
  struct Flags {
    std::string checkpoint, format = "hf", out;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd =
      app.add_subcommand("export", "Write a checkpoint's GPT for transformers (GPT2LMHeadModel)");
  cmd->add_option("--checkpoint", f->checkpoint, "Checkpoint directory")->required();
  cmd->add_option("--format", f->format, "hf (the only format)");
  cmd->add_option("OUT", f->out, "New directory for config.json and model.safetensors")->required();
  cmd->footer(
      "OUT loads with transformers.GPT2LMHeadModel.from_pretrained(OUT) and computes the same\n"
      "logits (scripts/hf-check verifies it against `pipewright eval`).");
  cmd->callback([f, exit_code] {
    absl::Status s = CheckFormat(f->format);
    if (s.ok()) s = ExportHuggingFace(f->checkpoint, f->out);
    if (!s.ok()) {
      *exit_code = ReportError(s);
      return;
    }
    std::printf("export: %s -> %s (config.json, model.safetensors)\n", f->checkpoint.c_str(),
                f->out.c_str());
    *exit_code = 0;
  });
}

void RegisterImport(CLI::App& app, int* exit_code) {
  struct Flags {
    std::string format = "hf", in, preset, out;
    std::optional<uint64_t> seed;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand(
      "import", "Make a step-0 checkpoint from a transformers GPT-2 or Llama directory");
  cmd->add_option("--format", f->format, "hf (the only format)");
  cmd->add_option("--preset", f->preset,
                  "The preset or model spec (llama:… / gpt:…) whose shape the weights have")
      ->required();
  AddUint64(cmd, "--seed", &f->seed,
            "The run seed recorded in the checkpoint (its data order; default: the one an "
            "export recorded, else 1)");
  cmd->add_option("IN", f->in, "Directory with config.json and model.safetensors")->required();
  cmd->add_option("DIR", f->out, "New checkpoint directory")->required();
  cmd->footer(
      "Then: pipewright train --preset P [--tied 1] --resume DIR ... (--tied 1 when the model\n"
      "ties its LM head, as GPT-2 does: config.json's tie_word_embeddings).");
  cmd->callback([f, exit_code] {
    absl::Status s = CheckFormat(f->format);
    if (s.ok()) s = ImportHuggingFace(f->in, f->preset, f->out, f->seed);
    if (!s.ok()) {
      *exit_code = ReportError(s);
      return;
    }
    std::printf("import: %s -> %s (%s, step 0)\n", f->in.c_str(), f->out.c_str(),
                f->preset.c_str());
    *exit_code = 0;
  });
}

}  // namespace pipewright::tools
