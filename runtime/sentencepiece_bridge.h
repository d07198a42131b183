// The one translation unit that includes SentencePiece's headers (runtime/sentencepiece_bridge.cc),
// behind an interface of standard types only. Internal.
//
// sentencepiece_processor.h declares `namespace absl { using std::string_view; }`, which makes
// every use of absl::string_view ambiguous next to Debian's Abseil (whose string_view lives in
// an inline namespace): no file may include both. runtime/tokenizer.cc uses Abseil and this.
#ifndef PIPEWRIGHT_RUNTIME_SENTENCEPIECE_BRIDGE_H_
#define PIPEWRIGHT_RUNTIME_SENTENCEPIECE_BRIDGE_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pipewright::internal::spm {

// A sentencepiece::SentencePieceProcessor. The functions returning std::string return "" on
// success and SentencePiece's error message otherwise. Const functions are thread-safe.
class Processor {
 public:
  Processor();
  ~Processor();
  Processor(const Processor&) = delete;
  Processor& operator=(const Processor&) = delete;

  // Loads a serialized model (the bytes of a .model file).
  std::string Load(std::string_view serialized);
  int PieceCount() const;
  int EosId() const;  // -1: none
  const std::string& Piece(int id) const;
  float Score(int id) const;
  std::string Encode(std::string_view text, std::vector<int>* ids) const;
  std::string Decode(const std::vector<int>& ids, std::string* text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes the next training sentence into *sentence; false at the end (or on an error, which
// the caller keeps).
using NextSentence = std::function<bool(std::string* sentence)>;

// SentencePieceTrainer::Train with the options `kwargs` (spm_train's flags without dashes) on
// the sentences `next` gives, after seeding SentencePiece's random generator with `seed`. The
// serialized model goes to *model, no file is written. "" on success, else the error.
std::string Train(const std::vector<std::pair<std::string, std::string>>& kwargs, unsigned seed,
                  NextSentence next, std::string* model);

}  // namespace pipewright::internal::spm

#endif  // PIPEWRIGHT_RUNTIME_SENTENCEPIECE_BRIDGE_H_
