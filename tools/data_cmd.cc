// `pipewright data prepare`: a text corpus as a memory-mapped token file (docs/data.md, "Token
// files"), which `train --data` and `eval --data` then read without loading it.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "pipewright/data.h"
#include "tools/commands.h"

namespace pipewright::tools {

void RegisterData(CLI::App& app, int* exit_code) {
  struct PrepareFlags {
    std::string input, output;
    bool json = false;
  };
  CLI::App* data = app.add_subcommand("data", "Prepare training data");
  data->require_subcommand(1);
  auto f = std::make_shared<PrepareFlags>();
  CLI::App* cmd = data->add_subcommand(
      "prepare", "Write a text file's bytes as a token file (vocabulary 256, uint16)");
  cmd->add_option("--input", f->input, "Text corpus")->required();
  cmd->add_option("--output", f->output, "Token file to write (conventionally *.tokens)")
      ->required();
  cmd->add_flag("--json", f->json, "Print the header as JSON");
  cmd->callback([f, exit_code] {
    absl::StatusOr<TokenFileInfo> info = PrepareByteTokenFile(f->input, f->output);
    if (!info.ok()) {
      *exit_code = ReportError(info.status());
      return;
    }
    if (f->json) {
      nlohmann::json j = {{"output", f->output},
                          {"dtype", info->dtype()},
                          {"vocab_size", info->vocab_size},
                          {"tokens", info->tokens}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("wrote %s: %lld %s tokens, vocabulary %lld\n", f->output.c_str(),
                  static_cast<long long>(info->tokens), info->dtype().c_str(),
                  static_cast<long long>(info->vocab_size));
    }
    *exit_code = 0;
  });
}

}  // namespace pipewright::tools
