// SentencePiece tokenizers (pipewright/data.h, docs/data.md "Tokenizers"): training, token files
// of documents separated by the model's end-of-sequence id, reproducibility, every refusal.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "pipewright/data.h"
#include "runtime/sentencepiece_bridge.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The tokens of token file `path` (after its 256-byte header), of `token_bytes` each.
std::vector<uint32_t> ReadTokens(const std::string& path, int token_bytes) {
  const std::string bytes = Slurp(path);
  std::vector<uint32_t> out;
  for (size_t at = kTokenFileHeaderBytes; at + token_bytes <= bytes.size(); at += token_bytes) {
    uint32_t v = 0;
    std::memcpy(&v, bytes.data() + at, token_bytes);  // little-endian host
    out.push_back(v);
  }
  return out;
}

// A few KB of text in documents: lines of words from a small vocabulary, single newlines,
// tabs, runs of spaces and a non-ASCII word inside documents.
std::vector<std::string> Documents() {
  const char* words[] = {"the",   "pipeline", "stage",  "gradient", "bubble",  "schedule",
                         "micro", "batch",    "tensor", "rank",     "warm-up", "café",
                         "of",    "and",      "to",     "in",       "a",       "token"};
  std::vector<std::string> docs;
  uint64_t x = 12345;
  for (int d = 0; d < 24; ++d) {
    std::string doc;
    const int lines = 1 + d % 4;
    for (int l = 0; l < lines; ++l) {
      if (l > 0) doc += "\n";
      for (int w = 0; w < 12; ++w) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        if (w > 0) doc += (x >> 60) == 0 ? "\t" : ((x >> 60) == 1 ? "  " : " ");
        doc += words[(x >> 33) % (sizeof(words) / sizeof(words[0]))];
      }
      doc += (d % 3 == 0) ? "." : ",";
    }
    docs.push_back(doc);
  }
  return docs;
}

// The documents joined by blank lines: one, or three newlines after every fifth document (a
// longer run separates too).
std::string Corpus(const std::vector<std::string>& docs) {
  std::string text;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (i > 0) text += (i % 5 == 0) ? "\n\n\n" : "\n\n";
    text += docs[i];
  }
  return text + "\n\n";
}

class TokenizerTest : public testing_util::ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    docs_ = Documents();
    corpus_ = Path("corpus.txt");
    std::ofstream(corpus_, std::ios::binary) << Corpus(docs_);
  }
  TrainedTokenizer Train(const std::string& prefix, const std::string& type, int64_t vocab) {
    TrainTokenizerOptions o;
    o.input = corpus_;
    o.model_prefix = Path(prefix);
    o.vocab_size = vocab;
    o.model_type = type;
    absl::StatusOr<TrainedTokenizer> t = TrainTokenizer(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : TrainedTokenizer{};
  }
  absl::StatusOr<TokenFileInfo> Prepare(const std::string& input, const std::string& output,
                                        const std::string& tokenizer) {
    return PrepareTokenFile({input, Path(output), tokenizer});
  }
  std::vector<std::string> docs_;
  std::string corpus_;
};

// The token file holds each document's tokens, the model's EOS between each two; decoding a
// document's tokens gives its text back exactly (newlines, tabs and runs of spaces included).
void ExpectDocumentsRoundTrip(const std::string& model, const std::string& tokens,
                              const std::vector<std::string>& docs) {
  absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> tok =
      SentencePieceTokenizer::Open(model, "model");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const int eos = (*tok)->eos_id();
  EXPECT_EQ(eos, 2);
  absl::StatusOr<TokenFileInfo> info = ReadTokenFileInfo(tokens);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->vocab_size, (*tok)->vocab_size());
  const std::vector<uint32_t> ids = ReadTokens(tokens, info->token_bytes);
  ASSERT_EQ(static_cast<int64_t>(ids.size()), info->tokens);
  std::vector<std::vector<uint32_t>> split(1);
  for (uint32_t id : ids) {
    ASSERT_LT(id, static_cast<uint64_t>(info->vocab_size));
    if (id == static_cast<uint32_t>(eos)) {
      split.emplace_back();
    } else {
      split.back().push_back(id);
    }
  }
  ASSERT_EQ(split.size(), docs.size()) << "one EOS between each two documents";
  for (size_t i = 0; i < docs.size(); ++i) {
    EXPECT_FALSE(split[i].empty()) << "document " << i;
    absl::StatusOr<std::string> text = (*tok)->Decode(split[i]);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, docs[i]) << "document " << i;
  }
}

TEST_F(TokenizerTest, UnigramModelPreparesDocumentsSeparatedByEos) {
  TrainedTokenizer t = Train("uni", "unigram", 300);
  EXPECT_EQ(t.vocab_size, 300);
  EXPECT_EQ(t.model_path, Path("uni.model"));
  EXPECT_GT(t.sentences, static_cast<int64_t>(docs_.size()));
  EXPECT_EQ(t.input_bytes, static_cast<int64_t>(std::filesystem::file_size(corpus_)));
  // The .vocab file: one "piece<TAB>score" line per piece.
  const std::string vocab = Slurp(Path("uni.vocab"));
  EXPECT_EQ(std::count(vocab.begin(), vocab.end(), '\n'), 300);
  EXPECT_EQ(vocab.rfind("<unk>\t", 0), 0u) << vocab.substr(0, 40);
  absl::StatusOr<TokenFileInfo> info = Prepare(corpus_, "c.tokens", "spm:" + t.model_path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dtype(), "uint16");
  EXPECT_EQ(info->vocab_size, 300);
  // Fewer tokens than bytes: the model learnt pieces longer than one byte.
  EXPECT_LT(info->tokens, static_cast<int64_t>(Corpus(docs_).size()));
  ExpectDocumentsRoundTrip(t.model_path, Path("c.tokens"), docs_);
}

TEST_F(TokenizerTest, BpeModelRoundTripsToo) {
  TrainedTokenizer t = Train("bpe", "bpe", 400);
  EXPECT_EQ(t.vocab_size, 400);
  ASSERT_TRUE(Prepare(corpus_, "b.tokens", "spm:" + t.model_path).ok());
  ExpectDocumentsRoundTrip(t.model_path, Path("b.tokens"), docs_);
}

TEST_F(TokenizerTest, SameInputsGiveTheSameBytes) {
  for (const char* type : {"unigram", "bpe"}) {
    TrainedTokenizer a = Train(std::string("a_") + type, type, 300);
    TrainedTokenizer b = Train(std::string("b_") + type, type, 300);
    EXPECT_EQ(Slurp(a.model_path), Slurp(b.model_path)) << type;
    EXPECT_EQ(Slurp(a.vocab_path), Slurp(b.vocab_path)) << type;
    ASSERT_TRUE(Prepare(corpus_, "a.tokens", "spm:" + a.model_path).ok());
    ASSERT_TRUE(Prepare(corpus_, "b.tokens", "spm:" + a.model_path).ok());
    EXPECT_EQ(Slurp(Path("a.tokens")), Slurp(Path("b.tokens"))) << type;
  }
}

// Without a tokenizer, or with "bytes", prepare is the byte-level PrepareByteTokenFile.
TEST_F(TokenizerTest, BytesTokenizerIsTheByteLevelPrepare) {
  ASSERT_TRUE(PrepareByteTokenFile(corpus_, Path("ref.tokens")).ok());
  for (const char* spec : {"", "bytes"}) {
    absl::StatusOr<TokenFileInfo> info = Prepare(corpus_, "x.tokens", spec);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->vocab_size, 256);
    EXPECT_EQ(Slurp(Path("x.tokens")), Slurp(Path("ref.tokens"))) << "'" << spec << "'";
  }
}

TEST_F(TokenizerTest, TrainingRefusesBadOptionsAndInputs) {
  auto train = [&](int64_t vocab, const std::string& type, const std::string& input) {
    return TrainTokenizer({input, Path("m"), vocab, type}).status();
  };
  for (int64_t vocab : {int64_t{5}, kMinTokenizerVocab - 1, kMaxTokenizerVocab + 1}) {
    absl::Status s = train(vocab, "unigram", corpus_);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("TrainTokenizerOptions.vocab_size = " + std::to_string(vocab)),
              std::string::npos)
        << s;
  }
  absl::Status s = train(320, "wordpiece", corpus_);
  EXPECT_NE(s.message().find("TrainTokenizerOptions.model_type = wordpiece"), std::string::npos)
      << s;
  // More pieces than this corpus can fill: SentencePiece's refusal, naming the input.
  s = train(50000, "unigram", corpus_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(corpus_), std::string::npos) << s;
  EXPECT_EQ(s.message().find("src/"), std::string::npos) << "source location kept: " << s;
  const std::string fifo = Path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  s = train(320, "unigram", fifo);  // refused without blocking on it
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("FIFO"), std::string::npos) << s;
  EXPECT_EQ(train(320, "unigram", Path("missing.txt")).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(Path("m.model")));
}

TEST_F(TokenizerTest, PrepareRefusesBadTokenizersAndInputs) {
  TrainedTokenizer t = Train("ok", "bpe", 320);
  absl::Status s = Prepare(corpus_, "o.tokens", "gpt2").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("PrepareOptions.tokenizer 'gpt2'"), std::string::npos) << s;
  EXPECT_EQ(Prepare(corpus_, "o.tokens", "spm:").status().code(),
            absl::StatusCode::kInvalidArgument);
  s = Prepare(corpus_, "o.tokens", "spm:" + Path("missing.model")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("missing.model"), std::string::npos) << s;
  // A corrupt model: the vocabulary file, and a truncated model.
  std::ofstream(Path("cut.model"), std::ios::binary) << Slurp(t.model_path).substr(0, 100);
  for (const std::string& bad : {t.vocab_path, Path("cut.model")}) {
    s = Prepare(corpus_, "o.tokens", "spm:" + bad).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("'" + bad + "' is not a SentencePiece model"), std::string::npos)
        << s;
  }
  const std::string fifo = Path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  s = Prepare(fifo, "o.tokens", "spm:" + t.model_path).status();
  EXPECT_NE(s.message().find("PrepareOptions.input '" + fifo + "' is a FIFO"), std::string::npos)
      << s;
  s = Prepare(corpus_, "o.tokens", "spm:" + fifo).status();
  EXPECT_NE(s.message().find("FIFO"), std::string::npos) << s;
  s = PrepareTokenFile({corpus_, corpus_, "spm:" + t.model_path}).status();
  EXPECT_NE(s.message().find("is the PrepareOptions.input"), std::string::npos) << s;
  EXPECT_FALSE(std::filesystem::exists(Path("o.tokens")));
}

// A document longer than kMaxTokenizerDocumentBytes is refused, naming where it starts (a sparse
// file: 64 MiB of NUL bytes after a first short document).
TEST_F(TokenizerTest, PrepareRefusesAHugeDocument) {
  TrainedTokenizer t = Train("ok", "bpe", 320);
  const std::string big = Path("big.txt");
  std::ofstream(big, std::ios::binary) << "short\n\n";
  ASSERT_EQ(::truncate(big.c_str(), 7 + kMaxTokenizerDocumentBytes + 1), 0);
  absl::Status s = Prepare(big, "big.tokens", "spm:" + t.model_path).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("document starting at byte 7 is longer than 64 MiB"),
            std::string::npos)
      << s;
  EXPECT_FALSE(std::filesystem::exists(Path("big.tokens")));
  EXPECT_FALSE(std::filesystem::exists(Path("big.tokens.tmp")));
}

// A model without an end-of-sequence piece cannot separate documents: refused.
TEST_F(TokenizerTest, PrepareRefusesAModelWithoutEos) {
  std::ifstream in(corpus_);
  std::string model;
  const std::string error = internal::spm::Train(
      {{"model_type", "bpe"}, {"vocab_size", "60"}, {"eos_id", "-1"}, {"minloglevel", "2"}}, 1,
      [&in](std::string* line) { return static_cast<bool>(std::getline(in, *line)); }, &model);
  ASSERT_EQ(error, "");
  std::ofstream(Path("noeos.model"), std::ios::binary) << model;
  absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> tok =
      SentencePieceTokenizer::Open(Path("noeos.model"), "model");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->eos_id(), -1);
  absl::Status s = Prepare(corpus_, "n.tokens", "spm:" + Path("noeos.model")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("no end-of-sequence piece"), std::string::npos) << s;
}

// The shipped corpus (when this machine has it): every document comes back, and a 1,000-piece
// BPE model needs fewer than half as many tokens as bytes.
TEST_F(TokenizerTest, TinyShakespeare) {
  const std::string path = "/work/shared/data/tinyshakespeare.txt";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is not on this machine";
  TrainTokenizerOptions o{path, Path("shakespeare"), 1000, "bpe"};
  absl::StatusOr<TrainedTokenizer> t = TrainTokenizer(o);
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<TokenFileInfo> info = Prepare(path, "s.tokens", "spm:" + t->model_path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->vocab_size, 1000);
  const double bytes = static_cast<double>(std::filesystem::file_size(path));
  EXPECT_GT(bytes / info->tokens, 2.0) << info->tokens << " tokens";
  // The documents as prepare splits them: at runs of two or more newlines.
  const std::string text = Slurp(path);
  std::vector<std::string> docs;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find("\n\n", start);
    if (end == std::string::npos) end = text.size();
    if (end > start) docs.push_back(text.substr(start, end - start));
    start = end;
    while (start < text.size() && text[start] == '\n') ++start;
  }
  ExpectDocumentsRoundTrip(t->model_path, Path("s.tokens"), docs);
}

}  // namespace
}  // namespace pipewright
