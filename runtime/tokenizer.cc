// SentencePiece tokenizers (pipewright/data.h; docs/data.md, "Tokenizers"): training a model on
// a text corpus, loading one, and preparing token files with it.
//
// Note [Lossless tokenizers]. SentencePiece's defaults normalize text (NFKC, newlines and runs of
// spaces folded into one space) and its trainer reads one sentence per line, so no learnt piece
// holds a newline. A model trained that way cannot give a document back from its tokens. The
// models TrainTokenizer writes therefore use the identity normalization, keep whitespace as it
// is, and fall back to byte pieces (<0x0A>, ...) for whatever has no piece of its own, so
// Decode(Encode(text)) == text for every document, newlines included. The price is 256 byte
// pieces in every vocabulary (hence kMinTokenizerVocab).
//
// Note [Document separators]. `data prepare` splits its input into documents at blank lines
// (a run of two or more newlines; the run itself is not tokenized: it is what the separator
// token stands for), tokenizes each document alone, and writes the model's end-of-sequence id
// between each two. A single newline stays inside its document. The input is read a block at a
// time and held one document at a time, each at most kMaxTokenizerDocumentBytes.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "pipewright/data.h"
#include "pipewright/input.h"
#include "pipewright/status.h"
#include "runtime/checkpoint_files.h"
#include "runtime/sentencepiece_bridge.h"
#include "runtime/token_file.h"

namespace pipewright {
namespace {

// The seed of SentencePiece's random generator (sentence sampling, the unigram trainer's
// seeding): fixed, so that training is reproducible.
constexpr unsigned kTrainSeed = 20240521;
// SentencePiece keeps every training sentence in memory; beyond this many lines it samples
// them (with the fixed seed).
constexpr int64_t kMaxTrainSentences = 10'000'000;

// SentencePiece's error `message` (runtime/sentencepiece_bridge.h) after `context`, without the
// source location and check it starts with ("./src/x.cc(660) [a == b] Vocabulary ...").
absl::Status SpmError(absl::string_view message, absl::string_view context) {
  // With nothing after it, the failed check is all there is to say ("[!sentences_.empty()]").
  if (const size_t at = message.find(") ["); at != absl::string_view::npos) {
    const size_t end = message.rfind(']');
    if (end != absl::string_view::npos && end > at) {
      absl::string_view rest = absl::StripAsciiWhitespace(message.substr(end + 1));
      message = rest.empty() ? message.substr(at + 2, end - at - 1) : rest;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(context, ": ", message));
}

// Reads records from an open file a block at a time: the text between runs of at least
// `separator` newlines (1: lines; 2: documents, Note [Document separators]). A shorter run of
// newlines is part of the record; empty records are skipped. Holds one record at a time, at most
// kMaxTokenizerDocumentBytes.
class RecordReader {
 public:
  RecordReader(RegularFile file, std::string what, int separator)
      : file_(std::move(file)), what_(std::move(what)), separator_(separator), buf_(1 << 20) {}

  // The next record into *record; false at the end or on an error (status()).
  bool Next(std::string* record) {
    record->clear();
    int newlines = 0;  // a run of newlines just read, not yet placed
    while (status_.ok()) {
      if (pos_ == len_ && !Fill()) break;
      const char* p = buf_.data() + pos_;
      if (*p == '\n') {
        ++newlines;
        Advance(1);
        continue;
      }
      if (newlines >= separator_) {
        if (!record->empty()) return true;  // the next record starts at p
      } else {
        record->append(newlines, '\n');
      }
      newlines = 0;
      if (record->empty()) record_start_ = offset_;
      const void* nl = std::memchr(p, '\n', len_ - pos_);
      const size_t n = nl ? static_cast<const char*>(nl) - p : len_ - pos_;
      if (static_cast<int64_t>(record->size() + n) > kMaxTokenizerDocumentBytes) {
        status_ = absl::InvalidArgumentError(absl::StrCat(
            what_, " '", file_.path(), "': the ", separator_ == 1 ? "line" : "document",
            " starting at byte ", record_start_, " is longer than ",
            kMaxTokenizerDocumentBytes >> 20, " MiB, the most tokenized at once",
            separator_ == 1 ? "" : " (documents are separated by blank lines)"));
        return false;
      }
      record->append(p, n);
      Advance(n);
    }
    if (!status_.ok()) return false;
    if (newlines < separator_ && !record->empty()) record->append(newlines, '\n');
    return !record->empty();
  }
  const absl::Status& status() const { return status_; }

 private:
  void Advance(size_t n) {
    pos_ += n;
    offset_ += static_cast<int64_t>(n);
  }
  // Reads the next block; false at the end of the file or on an error.
  bool Fill() {
    while (true) {
      const ssize_t n = ::read(file_.fd(), buf_.data(), buf_.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        status_ = ErrnoStatus(errno, absl::StrCat("cannot read ", what_), file_.path());
        return false;
      }
      pos_ = 0;
      len_ = static_cast<size_t>(n);
      return n > 0;
    }
  }

  RegularFile file_;
  std::string what_;
  int separator_;
  std::vector<char> buf_;
  size_t pos_ = 0, len_ = 0;
  int64_t offset_ = 0, record_start_ = 0;
  absl::Status status_;
};

// Replaces `path` with `text`: through a temporary file beside it renamed over it (a failed
// write leaves the old file whole), or in place for a character device (/dev/null).
absl::Status ReplaceFile(const std::string& path, const std::string& text, absl::string_view what) {
  PW_RETURN_IF_ERROR(CheckOutputPath(path, what));
  struct stat st;
  const bool in_place = ::stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode);
  const std::string tmp = in_place ? path : path + ".tmp";
  internal::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoStatus(errno, absl::StrCat("cannot create ", what), tmp);
  absl::Status s = internal::WriteAll(fd.get(), text.data(), text.size(), tmp);
  if (int err = fd.Close(); s.ok() && err != 0) s = ErrnoStatus(err, "cannot write", tmp);
  if (s.ok() && !in_place && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = ErrnoStatus(errno, absl::StrCat("cannot rename '", tmp, "' to"), path);
  }
  if (!s.ok() && !in_place) ::unlink(tmp.c_str());
  return s;
}

}  // namespace

struct SentencePieceTokenizer::Impl {
  internal::spm::Processor spm;
};

SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Open(
    const std::string& path, absl::string_view what) {
  PW_ASSIGN_OR_RETURN(std::string bytes, ReadRegularFile(path, what, kMaxTokenizerModelBytes));
  auto impl = std::make_unique<Impl>();
  const std::string context = absl::StrCat(what, " '", path, "' is not a SentencePiece model");
  if (std::string e = impl->spm.Load(bytes); !e.empty()) return SpmError(e, context);
  if (impl->spm.PieceCount() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": it holds no pieces"));
  }
  return std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(impl)));
}

int64_t SentencePieceTokenizer::vocab_size() const { return impl_->spm.PieceCount(); }

int SentencePieceTokenizer::eos_id() const { return impl_->spm.EosId(); }

absl::StatusOr<std::vector<uint32_t>> SentencePieceTokenizer::Encode(absl::string_view text) const {
  std::vector<int> ids;
  if (std::string e = impl_->spm.Encode(std::string_view(text.data(), text.size()), &ids);
      !e.empty()) {
    return SpmError(e, "cannot tokenize");
  }
  return std::vector<uint32_t>(ids.begin(), ids.end());
}

absl::StatusOr<std::string> SentencePieceTokenizer::Decode(const std::vector<uint32_t>& ids) const {
  std::vector<int> in;
  in.reserve(ids.size());
  for (uint32_t id : ids) {
    if (id >= static_cast<uint64_t>(vocab_size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", id, " is not below the vocabulary size ", vocab_size()));
    }
    in.push_back(static_cast<int>(id));
  }
  std::string text;
  if (std::string e = impl_->spm.Decode(in, &text); !e.empty()) return SpmError(e, "cannot decode");
  return text;
}

absl::StatusOr<TrainedTokenizer> TrainTokenizer(const TrainTokenizerOptions& options) {
  if (options.vocab_size < kMinTokenizerVocab || options.vocab_size > kMaxTokenizerVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("TrainTokenizerOptions.vocab_size = ", options.vocab_size, ": must be in [",
                     kMinTokenizerVocab, ", ", kMaxTokenizerVocab,
                     "] (259 pieces are <unk>, <s>, </s> and ", "the 256 byte pieces)"));
  }
  if (options.model_type != "unigram" && options.model_type != "bpe") {
    return absl::InvalidArgumentError(absl::StrCat(
        "TrainTokenizerOptions.model_type = ", options.model_type, ": must be unigram or bpe"));
  }
  if (options.model_prefix.empty()) {
    return absl::InvalidArgumentError("TrainTokenizerOptions.model_prefix is empty");
  }
  TrainedTokenizer out;
  out.model_path = options.model_prefix + ".model";
  out.vocab_path = options.model_prefix + ".vocab";
  out.model_type = options.model_type;
  for (const std::string& path : {out.model_path, out.vocab_path}) {
    PW_RETURN_IF_ERROR(CheckOutputPath(path, "TrainTokenizerOptions.model_prefix"));
  }
  PW_ASSIGN_OR_RETURN(RegularFile file,
                      RegularFile::Open(options.input, "TrainTokenizerOptions.input"));
  out.input_bytes = file.size();
  RecordReader reader(std::move(file), "TrainTokenizerOptions.input", /*separator=*/1);
  auto next_line = [&reader, &out](std::string* line) {
    const bool more = reader.Next(line);
    out.sentences += more ? 1 : 0;
    return more;
  };

  // Note [Lossless tokenizers]; one thread and a fixed seed: the same files every time.
  const std::vector<std::pair<std::string, std::string>> kwargs = {
      {"model_type", options.model_type},
      {"vocab_size", absl::StrCat(options.vocab_size)},
      {"num_threads", "1"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"byte_fallback", "true"},
      {"input_sentence_size", absl::StrCat(kMaxTrainSentences)},
      {"shuffle_input_sentence", "true"},
      {"minloglevel", "2"},  // errors only: no progress log on stderr
  };
  std::string model;
  const std::string error = internal::spm::Train(kwargs, kTrainSeed, next_line, &model);
  PW_RETURN_IF_ERROR(reader.status());
  if (!error.empty()) {
    return SpmError(error,
                    absl::StrCat("cannot train a tokenizer of ", options.vocab_size,
                                 " pieces on TrainTokenizerOptions.input '", options.input, "'"));
  }
  internal::spm::Processor spm;
  if (std::string e = spm.Load(model); !e.empty()) {
    return absl::InternalError(absl::StrCat("the trained model does not load: ", e));
  }
  out.vocab_size = spm.PieceCount();
  // The .vocab file as spm_train writes it: each piece and its score.
  std::string vocab;
  for (int id = 0; id < spm.PieceCount(); ++id) {
    absl::StrAppend(&vocab, spm.Piece(id), "\t", spm.Score(id), "\n");
  }
  PW_RETURN_IF_ERROR(ReplaceFile(out.model_path, model, "TrainTokenizerOptions.model_prefix"));
  PW_RETURN_IF_ERROR(ReplaceFile(out.vocab_path, vocab, "TrainTokenizerOptions.model_prefix"));
  return out;
}

absl::StatusOr<TokenFileInfo> PrepareTokenFile(const PrepareOptions& options) {
  if (options.tokenizer.empty() || options.tokenizer == "bytes") {
    return PrepareByteTokenFile(options.input, options.output);
  }
  if (!absl::StartsWith(options.tokenizer, "spm:") || options.tokenizer.size() == 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PrepareOptions.tokenizer '", options.tokenizer,
        "' is not a tokenizer: expected bytes or spm:PATH (a SentencePiece model file)"));
  }
  const std::string model_path = options.tokenizer.substr(4);
  PW_ASSIGN_OR_RETURN(std::unique_ptr<SentencePieceTokenizer> tokenizer,
                      SentencePieceTokenizer::Open(model_path, "PrepareOptions.tokenizer model"));
  const int eos = tokenizer->eos_id();
  if (eos < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "PrepareOptions.tokenizer model '", model_path,
        "' has no end-of-sequence piece: the documents could not be told apart in the tokens"));
  }
  PW_ASSIGN_OR_RETURN(RegularFile file,
                      internal::OpenPrepareInput(options.input, "PrepareOptions.input",
                                                 options.output, "PrepareOptions.output"));
  RecordReader documents(std::move(file), "PrepareOptions.input", /*separator=*/2);

  TokenFileInfo info;
  info.vocab_size = tokenizer->vocab_size();
  info.token_bytes = info.vocab_size <= (int64_t{1} << 16) ? 2 : 4;
  // Note [Document separators]: the tokens of one document at a time, after the separator.
  std::string text;
  std::vector<uint32_t> pending;
  size_t next = 0;
  bool first = true;
  auto fill = [&](uint32_t* out, size_t capacity) -> absl::StatusOr<size_t> {
    size_t n = 0;
    while (n < capacity) {
      if (next == pending.size()) {
        if (!documents.Next(&text)) {
          PW_RETURN_IF_ERROR(documents.status());
          break;
        }
        PW_ASSIGN_OR_RETURN(std::vector<uint32_t> ids, tokenizer->Encode(text));
        pending.clear();
        if (!first) pending.push_back(static_cast<uint32_t>(eos));
        first = false;
        pending.insert(pending.end(), ids.begin(), ids.end());
        next = 0;
      }
      const size_t take = std::min(capacity - n, pending.size() - next);
      std::copy_n(pending.begin() + next, take, out + n);
      next += take;
      n += take;
    }
    return n;
  };
  PW_RETURN_IF_ERROR(internal::WriteTokenStream(options.output, info, fill, &info.tokens));
  return info;
}

}  // namespace pipewright
