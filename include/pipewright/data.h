// Training data: a Dataset gives global sample i as the first stage's input and the loss layer's
// target, of the shapes and dtypes its SampleSpec says; the token datasets (byte-level text and
// prepared token files, both memory-mapped, and a deterministic synthetic task) are
// TokenDatasets; loader workers build whole steps ahead of use.
//
// Global sample i depends only on (dataset, seed, i) — never on the batch layout — so runs with
// different pipeline depths, schedules or micro-batchings see the same global batches. A token
// sample is seq_len + 1 tokens: inputs are tokens [0, seq_len), targets tokens [1, seq_len].
#ifndef PIPEWRIGHT_DATA_H_
#define PIPEWRIGHT_DATA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pipewright/tensor.h"

namespace pipewright {

// One sample without the batch dimension: what the first stage takes, and what the last stage's
// loss layer reads as LayerContext::targets. The loader stacks micro_batch_size samples into
// [B, ...shape] tensors. input_shape[0] is the sequence length (the engine checks it against the
// model's MicroBatchShape::seq_len).
struct SampleSpec {
  std::vector<int64_t> input_shape;
  DType input_dtype = DType::kI32;
  std::vector<int64_t> target_shape;
  DType target_dtype = DType::kI32;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // For reports and checkpoints: "synthetic (repeated patterns)", "text:<path> (<n> bytes)".
  virtual std::string Describe() const = 0;
  virtual SampleSpec Spec() const = 0;
  // Writes global sample `index` (>= 0) into host buffers of Spec()'s sizes. Called from loader
  // threads of several ranks at once: must be thread-safe, and deterministic in `index`.
  virtual void Sample(int64_t index, void* input, void* target) const = 0;
};

// Byte-level language modelling (vocabulary 256): input [T] i32 tokens, target [T] i32 = the
// input shifted by one.
class TokenDataset : public Dataset {
 public:
  explicit TokenDataset(int64_t seq_len) : seq_len_(seq_len) {}
  int64_t seq_len() const { return seq_len_; }
  // Every token is < vocab_size(): 256 for bytes, a token file's recorded vocabulary.
  virtual int64_t vocab_size() const { return 256; }
  // Writes seq_len + 1 tokens of sample `index` for sequences of `seq_len` tokens (the dataset's
  // own, or shorter).
  virtual void Tokens(int64_t index, int64_t seq_len, int32_t* out) const = 0;
  SampleSpec Spec() const final;
  void Sample(int64_t index, void* input, void* target) const final;

 private:
  int64_t seq_len_;
};

// Byte-level text, memory-mapped (never read whole): sample i is the window of seq_len + 1 bytes
// at a position drawn from (seed, i). Errors when the file is missing, unreadable or shorter
// than seq_len + 2 bytes.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTextDataset(const std::string& path,
                                                              int64_t seq_len, uint64_t seed);

// Token files (docs/data.md, "Token files"): a 256-byte header — "PWTOKENS\n", then a JSON
// object {"format", "version", "dtype", "vocab_size", "tokens"} padded with spaces, then "\n" —
// followed by `tokens` little-endian uint16 (vocabulary <= 65536) or uint32 tokens.
inline constexpr int64_t kTokenFileHeaderBytes = 256;
struct TokenFileInfo {
  int64_t vocab_size = 256;
  int64_t tokens = 0;
  int token_bytes = 2;  // 2: uint16, 4: uint32
  std::string dtype() const { return token_bytes == 2 ? "uint16" : "uint32"; }
};
// The header of token file `path`, checked against the file's size; InvalidArgument naming the
// file when it is malformed.
absl::StatusOr<TokenFileInfo> ReadTokenFileInfo(const std::string& path);
// Writes `tokens` (each < vocab_size) as a token file, uint16 when the vocabulary fits.
absl::Status WriteTokenFile(const std::string& path, const std::vector<uint32_t>& tokens,
                            int64_t vocab_size);
// `pipewright data prepare`: the bytes of text file `input` as byte-level tokens (vocabulary
// 256, uint16), streamed in blocks so that neither file is ever held in memory whole.
absl::StatusOr<TokenFileInfo> PrepareByteTokenFile(const std::string& input,
                                                   const std::string& output);
// Tokenizers (docs/data.md, "Tokenizers"; runtime/tokenizer.cc): SentencePiece models (the
// Debian library libsentencepiece) trained on a text corpus, and token files prepared with them.
// Errors name the options' fields ("TrainTokenizerOptions.vocab_size = 5: ..."), which the CLI
// words as its flags.
//
// The vocabularies train-tokenizer accepts: its models hold 3 control pieces (<unk>, <s>, </s>)
// and 256 byte pieces besides the text's characters and the learnt pieces, so 260 is the least
// any corpus allows (SentencePiece itself refuses a size below what the corpus's characters
// need, and above what its text can fill, for a unigram model).
inline constexpr int64_t kMinTokenizerVocab = 260;
inline constexpr int64_t kMaxTokenizerVocab = int64_t{1} << 20;
// The longest line train-tokenizer reads and the longest document prepare tokenizes at once.
inline constexpr int64_t kMaxTokenizerDocumentBytes = int64_t{64} << 20;
// The largest model file opened (Llama's is 0.5 MB; a 256k-piece model about 5 MB).
inline constexpr int64_t kMaxTokenizerModelBytes = int64_t{256} << 20;

struct TrainTokenizerOptions {
  std::string input;          // a text corpus: a regular file, one training sentence per line
  std::string model_prefix;   // writes <model_prefix>.model and <model_prefix>.vocab
  int64_t vocab_size = 8000;  // pieces, in [kMinTokenizerVocab, kMaxTokenizerVocab]
  std::string model_type = "unigram";  // "unigram" or "bpe"
};
struct TrainedTokenizer {
  std::string model_path, vocab_path;
  int64_t vocab_size = 0;  // pieces in the model
  std::string model_type;
  int64_t sentences = 0;    // lines read from the input
  int64_t input_bytes = 0;  // the input's size
};
// Trains a SentencePiece model on the lines of `options.input` and writes it (.model, the
// serialized model, and .vocab, "piece<TAB>score" per line; each replaced atomically). The model
// is lossless: identity normalization, whitespace kept as it is and byte fallback, so that
// decoding a text's tokens gives the text back, newlines and bytes it never saw included; its
// end-of-sequence piece </s> is id 2. Training is reproducible: one thread and a fixed seed, so
// the same input and options write the same files. SentencePiece's progress log is silenced
// (it would go to stderr); its errors ("Vocabulary size is too large") come back as
// InvalidArgument naming the input. The input is refused before a byte is read when it is not a
// regular file (a FIFO, a device); a line longer than kMaxTokenizerDocumentBytes is an error.
absl::StatusOr<TrainedTokenizer> TrainTokenizer(const TrainTokenizerOptions& options);

// A loaded SentencePiece model. Encode and Decode are const and may be called from several
// threads at once.
class SentencePieceTokenizer {
 public:
  // Loads the model file `path`: a regular file of at most kMaxTokenizerModelBytes, read by
  // pipewright (ReadRegularFile) and parsed from memory. NotFound when it is missing,
  // InvalidArgument naming `what` and the path when it is not a regular file or not a
  // SentencePiece model.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Open(const std::string& path,
                                                                      absl::string_view what);
  ~SentencePieceTokenizer();
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  int64_t vocab_size() const;  // the model's piece count; every id is below it
  int eos_id() const;          // the end-of-sequence piece, -1 when the model has none
  // The ids of `text`, with the model's own normalization (lossless for train-tokenizer's).
  absl::StatusOr<std::vector<uint32_t>> Encode(absl::string_view text) const;
  // The text of `ids` (each < vocab_size(): InvalidArgument otherwise).
  absl::StatusOr<std::string> Decode(const std::vector<uint32_t>& ids) const;

 private:
  struct Impl;
  explicit SentencePieceTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct PrepareOptions {
  std::string input;   // a text corpus (a regular file)
  std::string output;  // the token file to write
  // "" or "bytes": PrepareByteTokenFile. "spm:PATH": the SentencePiece model file PATH.
  std::string tokenizer;
};
// `pipewright data prepare`: `options.input` as a token file. With a SentencePiece model the
// input is read as documents separated by blank lines (a run of two or more newlines, which
// is not tokenized itself); each document is tokenized alone and its tokens follow the
// model's end-of-sequence id, written between each two documents (none before the first or
// after the last; empty documents are skipped). A model without an end-of-sequence piece is
// refused (FailedPrecondition), since documents could not be told apart. The header's
// vocab_size is the model's piece count, the dtype uint16 when it is at most 65536 and uint32
// otherwise. The input is streamed a document at a time; a document longer than
// kMaxTokenizerDocumentBytes is InvalidArgument naming its start's byte offset. An unknown
// tokenizer, or a model that is missing or not one, is an error naming the field and the file.
absl::StatusOr<TokenFileInfo> PrepareTokenFile(const PrepareOptions& options);

// A memory-mapped token file: sample i is the window of seq_len + 1 tokens at the position the
// text dataset would draw for (seed, i), so a text file and its prepared token file give the
// same samples. Opening checks the header, the size and (streaming, outside the mapping) that
// every token is < vocab_size.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTokenFileDataset(const std::string& path,
                                                                   int64_t seq_len, uint64_t seed);
// Repeated patterns (docs/data.md): sample i repeats a random pattern of 2..8 letters drawn
// from 'a'..'p'. After one period every token is predictable, so a small attention model can
// drive the loss far below the ln(16) of guessing.
std::unique_ptr<TokenDataset> SyntheticDataset(int64_t seq_len, uint64_t seed);
// A benchmark-only wrapper (`pipewright train --data-delay-us`): `data` whose every sample takes
// `delay` longer, an artificially slow data source for measuring the loader.
std::unique_ptr<TokenDataset> WithSampleDelay(std::shared_ptr<const TokenDataset> data,
                                              absl::Duration delay);
// The ecosystem's token files (docs/data.md, "Other token formats"; Note [Token streams] in
// runtime/token_formats.cc), memory-mapped and read in place: their arrays concatenated into one
// stream, sample i the window at the position the text dataset draws for (seed, i). Opening
// checks the headers, that every array lies within its file and (streaming) that every token is
// in [0, 2^31); the largest token + 1 is vocab_size(). InvalidArgument naming the file and what
// is wrong (magic, version, dtype, a size that does not match, a token out of range).
//  - Megatron-LM / NeMo indexed datasets: PREFIX.idx ("MMIDIDX\0\0", version 1, an integer
//    dtype) and PREFIX.bin; `path` is the prefix or either file.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenMegatronDataset(const std::string& path,
                                                                  int64_t seq_len, uint64_t seed);
//  - llm.c / modded-nanogpt token shards: a header of 256 int32 (20240520, version 1 for uint16
//    tokens or 2 for uint32, the token count), then the tokens; several shards in the order given.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTokenShards(const std::vector<std::string>& paths,
                                                              int64_t seq_len, uint64_t seed);
//  - headerless token arrays (nanoGPT's prepare.py writes uint16): token_bytes 2 or 4.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenRawTokens(const std::string& path,
                                                            int token_bytes, int64_t seq_len,
                                                            uint64_t seed);

// "synthetic"; "nanogpt:PATH" (OpenRawTokens, uint16); a glob ("shards/train_*.bin": llm.c
// shards, sorted); a Megatron prefix, PREFIX.idx, or PREFIX.bin with PREFIX.idx beside it; a file
// that starts with llm.c's magic; a token file (one that starts with the "PWTOKENS" header; a
// path ending in ".tokens" must be one); any other ".bin" is an error; otherwise a text file.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenDataset(absl::string_view spec, int64_t seq_len,
                                                          uint64_t seed);

// InvalidArgument naming the data when its tokens may reach `model_vocab` (the presets train
// and eval run are byte-level: 256).
absl::Status CheckVocabulary(const TokenDataset& data, int64_t model_vocab);

struct BatchLayout {
  int64_t micro_batches = 1;     // per replica
  int64_t micro_batch_size = 1;  // sequences per micro-batch
  int64_t seq_len = 1;           // tokens per sample (throughput reports)
  int64_t replicas = 1;          // data-parallel width
  int64_t global_batch() const { return micro_batches * micro_batch_size * replicas; }
  // Global sample index of sequence `b` of micro-batch `j` of replica `r` at `step`.
  int64_t SampleIndex(int64_t step, int64_t r, int64_t j, int64_t b) const {
    return step * global_batch() + (r * micro_batches + j) * micro_batch_size + b;
  }
};

// One replica's micro-batches for one step: inputs and targets are [B, ...] stacks of samples.
struct StepBatch {
  int64_t step = 0;
  std::vector<Tensor> inputs, targets;
};

// Builds one step's batch for `replica` (synchronously).
StepBatch MakeStepBatch(const Dataset& data, const BatchLayout& layout, int64_t step,
                        int64_t replica);

// Builds one replica's step batches, in step order from `first_step`. With `workers` >= 1,
// that many background threads build whole steps ahead of use into a bounded queue: at most
// max(prefetch, workers) steps are built or being built beyond the one Next() last returned,
// several steps concurrently, and Next() hands them out in step order. With `workers` = 0,
// Next() builds the step on the calling thread (no prefetch, no extra thread). The batches are
// the same for every `workers` (Note [Loader workers] in data.cc).
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> data, BatchLayout layout, int64_t replica,
             int64_t first_step, int prefetch = 2, int workers = 1);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  // The next step's batch, waiting for the workers if they are behind (or building it, with no
  // workers).
  StepBatch Next();
  // Total time Next() spent waiting for data (building it, with no workers).
  absl::Duration wait_time() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace pipewright

#endif  // PIPEWRIGHT_DATA_H_
