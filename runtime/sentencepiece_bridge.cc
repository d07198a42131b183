// SentencePiece behind standard types (runtime/sentencepiece_bridge.h): no Abseil header here.
#include "runtime/sentencepiece_bridge.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unordered_map>

namespace pipewright::internal::spm {
namespace {

std::string Message(const sentencepiece::util::Status& s) {
  if (s.ok()) return "";
  std::string m = s.message();
  return m.empty() ? "unknown SentencePiece error" : m;
}

// The training sentences `next` gives, as SentencePiece's iterator.
class Sentences final : public sentencepiece::SentenceIterator {
 public:
  explicit Sentences(NextSentence next) : next_(std::move(next)) { Next(); }
  bool done() const override { return done_; }
  void Next() override { done_ = !next_(&sentence_); }
  const std::string& value() const override { return sentence_; }
  // The reader's errors are the caller's to report: the iteration just ends.
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  NextSentence next_;
  std::string sentence_;
  bool done_ = false;
};

}  // namespace

struct Processor::Impl {
  sentencepiece::SentencePieceProcessor spm;
};

Processor::Processor() : impl_(std::make_unique<Impl>()) {}
Processor::~Processor() = default;

std::string Processor::Load(std::string_view serialized) {
  return Message(impl_->spm.LoadFromSerializedProto(serialized));
}
int Processor::PieceCount() const { return impl_->spm.GetPieceSize(); }
int Processor::EosId() const { return impl_->spm.eos_id(); }
const std::string& Processor::Piece(int id) const { return impl_->spm.IdToPiece(id); }
float Processor::Score(int id) const { return impl_->spm.GetScore(id); }

std::string Processor::Encode(std::string_view text, std::vector<int>* ids) const {
  return Message(impl_->spm.Encode(text, ids));
}

std::string Processor::Decode(const std::vector<int>& ids, std::string* text) const {
  return Message(impl_->spm.Decode(ids, text));
}

std::string Train(const std::vector<std::pair<std::string, std::string>>& kwargs, unsigned seed,
                  NextSentence next, std::string* model) {
  const std::unordered_map<std::string, std::string> args(kwargs.begin(), kwargs.end());
  sentencepiece::SetRandomGeneratorSeed(seed);
  Sentences sentences(std::move(next));
  return Message(sentencepiece::SentencePieceTrainer::Train(args, &sentences, model));
}

}  // namespace pipewright::internal::spm
