// `pipewright data prepare`: a text corpus as a memory-mapped token file (docs/data.md, "Token
// files"), which `train --data` and `eval --data` then read without loading it; byte-level, or
// with a SentencePiece model that `pipewright data train-tokenizer` trains (docs/data.md,
// "Tokenizers").
#include <cstdio>
#include <nlohmann/json.hpp>

#include "pipewright/data.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {
namespace {

void RegisterPrepare(CLI::App* data, int* exit_code) {
  struct Flags {
    PrepareOptions options;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = data->add_subcommand(
      "prepare",
      "Write a text file as a token file: its bytes (vocabulary 256, uint16), or the "
      "tokens of a SentencePiece model");
  cmd->add_option("--input", f->options.input, "Text corpus")->required();
  cmd->add_option("--output", f->options.output, "Token file to write (conventionally *.tokens)")
      ->required();
  cmd->add_option("--tokenizer", f->options.tokenizer,
                  "bytes (the default), or spm:MODEL.model: a SentencePiece model; documents "
                  "(separated by blank lines) are tokenized alone, the model's end-of-sequence "
                  "token between each two");
  cmd->add_flag("--json", f->json, "Print the header as JSON");
  cmd->callback([f, exit_code] {
    absl::StatusOr<TokenFileInfo> info = PrepareTokenFile(f->options);
    if (!info.ok()) {
      *exit_code = ReportError(info.status());
      return;
    }
    const std::string& output = f->options.output;
    if (f->json) {
      nlohmann::json j = {{"output", output},
                          {"dtype", info->dtype()},
                          {"vocab_size", info->vocab_size},
                          {"tokens", info->tokens}};
      if (!f->options.tokenizer.empty()) j["tokenizer"] = f->options.tokenizer;
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("wrote %s: %lld %s tokens, vocabulary %lld\n", output.c_str(),
                  static_cast<long long>(info->tokens), info->dtype().c_str(),
                  static_cast<long long>(info->vocab_size));
    }
    *exit_code = 0;
  });
}

void RegisterTrainTokenizer(CLI::App* data, int* exit_code) {
  struct Flags {
    TrainTokenizerOptions options;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = data->add_subcommand(
      "train-tokenizer",
      "Train a SentencePiece tokenizer on a text corpus (one thread, a fixed seed: the same "
      "files every time); writes PREFIX.model and PREFIX.vocab");
  cmd->add_option("--input", f->options.input, "Text corpus, one training sentence per line")
      ->required();
  cmd->add_option("--model-prefix", f->options.model_prefix,
                  "Writes <prefix>.model and <prefix>.vocab")
      ->required();
  AddInt(cmd, "--vocab-size", &f->options.vocab_size,
         IntRange(kMinTokenizerVocab, kMaxTokenizerVocab),
         "Pieces in the model, 256 byte pieces and <unk>, <s>, </s> included")
      ->required();
  cmd->add_option("--model-type", f->options.model_type, "unigram or bpe")
      ->capture_default_str()
      ->check(CLI::IsMember({"unigram", "bpe"}));
  cmd->add_flag("--json", f->json, "Print what was written as JSON");
  cmd->callback([f, exit_code] {
    absl::StatusOr<TrainedTokenizer> t = TrainTokenizer(f->options);
    if (!t.ok()) {
      *exit_code = ReportError(t.status());
      return;
    }
    if (f->json) {
      nlohmann::json j = {{"model", t->model_path},      {"vocab", t->vocab_path},
                          {"vocab_size", t->vocab_size}, {"model_type", t->model_type},
                          {"sentences", t->sentences},   {"input_bytes", t->input_bytes}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("wrote %s and %s: %s model of %lld pieces, trained on %lld lines\n",
                  t->model_path.c_str(), t->vocab_path.c_str(), t->model_type.c_str(),
                  static_cast<long long>(t->vocab_size), static_cast<long long>(t->sentences));
    }
    *exit_code = 0;
  });
}

}  // namespace

void RegisterData(CLI::App& app, int* exit_code) {
  CLI::App* data = app.add_subcommand("data", "Prepare training data and tokenizers");
  data->require_subcommand(1);
  RegisterPrepare(data, exit_code);
  RegisterTrainTokenizer(data, exit_code);
}

}  // namespace pipewright::tools
