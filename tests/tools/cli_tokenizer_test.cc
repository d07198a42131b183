// `pipewright data train-tokenizer` and `data prepare --tokenizer` end to end: JSON output, the
// files written, and usage errors (exit 2) that name the flags.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/tools/cli_util.h"

namespace {

using namespace pipewright::cli_test;

class CliTokenizer : public CliDirTest {
 protected:
  CliTokenizer() : CliDirTest("tokenizer_") {}
  // A small corpus of three kinds of documents, separated by blank lines.
  std::string Corpus() {
    const std::string path = Path("corpus.txt");
    std::ofstream f(path);
    for (int i = 0; i < 60; ++i) {
      f << "The pipeline stage " << i << " sends activations to the next rank.\n"
        << "Gradients flow back through every micro-batch.\n\n";
    }
    return path;
  }
};

TEST_F(CliTokenizer, TrainsAndPreparesWithJson) {
  const std::string corpus = Corpus(), prefix = Path("tok");
  Result t = RunCli("data train-tokenizer --input " + corpus + " --model-prefix " + prefix +
                    " --vocab-size 300 --model-type bpe --json");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_EQ(t.err, "") << "SentencePiece's log must stay quiet";
  nlohmann::json j = nlohmann::json::parse(t.out);
  EXPECT_EQ(j["model"], prefix + ".model");
  EXPECT_EQ(j["vocab"], prefix + ".vocab");
  EXPECT_EQ(j["vocab_size"], 300);
  EXPECT_EQ(j["model_type"], "bpe");
  EXPECT_EQ(j["sentences"], 120);
  EXPECT_EQ(j["input_bytes"].get<int64_t>(),
            static_cast<int64_t>(std::filesystem::file_size(corpus)));
  EXPECT_GT(std::filesystem::file_size(prefix + ".model"), 0u);
  EXPECT_GT(std::filesystem::file_size(prefix + ".vocab"), 0u);

  const std::string tokens = Path("corpus.tokens");
  Result p = RunCli("data prepare --input " + corpus + " --output " + tokens +
                    " --tokenizer spm:" + prefix + ".model --json");
  ASSERT_EQ(p.exit_code, 0) << p.err;
  nlohmann::json info = nlohmann::json::parse(p.out);
  EXPECT_EQ(info["dtype"], "uint16");
  EXPECT_EQ(info["vocab_size"], 300);
  EXPECT_EQ(info["tokenizer"], "spm:" + prefix + ".model");
  const int64_t n = info["tokens"].get<int64_t>();
  EXPECT_GT(n, 60);
  EXPECT_LT(n, static_cast<int64_t>(std::filesystem::file_size(corpus)));
  EXPECT_EQ(static_cast<int64_t>(std::filesystem::file_size(tokens)), 256 + 2 * n);
  // The header says the same.
  std::ifstream in(tokens);
  std::string magic, header;
  std::getline(in, magic);
  std::getline(in, header);
  EXPECT_EQ(magic, "PWTOKENS");
  nlohmann::json h = nlohmann::json::parse(header);
  EXPECT_EQ(h["vocab_size"], 300);
  EXPECT_EQ(h["tokens"], n);

  // Trained again: the same model, byte for byte.
  Result again = RunCli("data train-tokenizer --input " + corpus + " --model-prefix " +
                        Path("tok2") + " --vocab-size 300 --model-type bpe");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  std::ifstream a(prefix + ".model", std::ios::binary), b(Path("tok2.model"), std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}),
            std::string(std::istreambuf_iterator<char>(b), {}));
}

TEST_F(CliTokenizer, UsageErrorsNameTheFlags) {
  const std::string corpus = Corpus(), fifo = Path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Result t = RunCli("data train-tokenizer --input " + corpus + " --model-prefix " + Path("m") +
                    " --vocab-size 300");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  const std::string model = Path("m.model");
  const std::string train = "data train-tokenizer --model-prefix " + Path("x") + " ";
  const std::string prepare = "data prepare --output " + Path("o.tokens") + " ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {train + "--input " + corpus + " --vocab-size 5", "--vocab-size 5: must be"},
      {train + "--input " + corpus + " --vocab-size 300 --model-type wordpiece", "--model-type"},
      {train + "--input " + fifo + " --vocab-size 300", "--input '" + fifo + "' is a FIFO"},
      {train + "--input " + corpus + " --vocab-size 90000", "cannot train a tokenizer"},
      {prepare + "--input " + corpus + " --tokenizer gpt2", "--tokenizer 'gpt2' is not a"},
      {prepare + "--input " + corpus + " --tokenizer spm:" + Path("none.model"),
       "--tokenizer model '" + Path("none.model") + "'"},
      {prepare + "--input " + corpus + " --tokenizer spm:" + corpus,
       "--tokenizer model '" + corpus + "' is not a SentencePiece model"},
      {prepare + "--input " + fifo + " --tokenizer spm:" + model, "--input '" + fifo + "'"},
  };
  for (const auto& [args, want] : cases) {
    Result r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << "\n" << r.err;
    EXPECT_EQ(r.out, "") << args;
  }
  EXPECT_FALSE(std::filesystem::exists(Path("o.tokens")));
}

}  // namespace
