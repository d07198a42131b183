#include "pipewright/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "pipewright/input.h"
#include "pipewright/status.h"
#include "runtime/mapped_file.h"
#include "runtime/random.h"
#include "runtime/token_file.h"
#include "runtime/token_formats.h"

namespace pipewright {
namespace {

using internal::MappedFile;
using internal::WindowStart;

constexpr char kTokenMagic[] = "PWTOKENS\n";
constexpr size_t kTokenMagicLen = sizeof(kTokenMagic) - 1;

std::string Errno() { return std::strerror(errno); }

class TextDataset final : public TokenDataset {
 public:
  TextDataset(std::string path, std::unique_ptr<MappedFile> file, int64_t seq_len, uint64_t seed)
      : TokenDataset(seq_len), path_(std::move(path)), file_(std::move(file)), seed_(seed) {}
  std::string Describe() const override {
    return absl::StrCat("text:", path_, " (", file_->size(), " bytes)");
  }
  void Tokens(int64_t index, int64_t seq_len, int32_t* out) const override {
    const uint64_t span = file_->size() - static_cast<uint64_t>(seq_len);  // > 1 (open checks)
    const unsigned char* p = file_->data() + WindowStart(seed_, index, span);
    for (int64_t t = 0; t <= seq_len; ++t) out[t] = p[t];
    file_->SampleRead();
  }

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  uint64_t seed_;
};

class TokenFileDataset final : public TokenDataset {
 public:
  TokenFileDataset(std::string path, std::unique_ptr<MappedFile> file, TokenFileInfo info,
                   int64_t seq_len, uint64_t seed)
      : TokenDataset(seq_len),
        path_(std::move(path)),
        file_(std::move(file)),
        info_(info),
        seed_(seed) {}
  std::string Describe() const override {
    return absl::StrCat("tokens:", path_, " (", info_.tokens, " ", info_.dtype(),
                        " tokens, vocabulary ", info_.vocab_size, ")");
  }
  int64_t vocab_size() const override { return info_.vocab_size; }
  void Tokens(int64_t index, int64_t seq_len, int32_t* out) const override {
    const uint64_t span = static_cast<uint64_t>(info_.tokens - seq_len);  // > 1 (open checks)
    const uint64_t start = WindowStart(seed_, index, span);
    const unsigned char* base = file_->data() + kTokenFileHeaderBytes;
    // memcpy per token: the payload is only 2-byte aligned relative to the header, and the
    // format is little-endian like every host this runs on.
    if (info_.token_bytes == 2) {
      for (int64_t t = 0; t <= seq_len; ++t) {
        uint16_t v;
        std::memcpy(&v, base + 2 * (start + t), 2);
        out[t] = v;
      }
    } else {
      for (int64_t t = 0; t <= seq_len; ++t) {
        uint32_t v;
        std::memcpy(&v, base + 4 * (start + t), 4);
        out[t] = static_cast<int32_t>(v);
      }
    }
    file_->SampleRead();
  }

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  TokenFileInfo info_;
  uint64_t seed_;
};

class Synthetic final : public TokenDataset {
 public:
  Synthetic(int64_t seq_len, uint64_t seed) : TokenDataset(seq_len), seed_(seed) {}
  std::string Describe() const override { return "synthetic (repeated patterns)"; }
  void Tokens(int64_t index, int64_t seq_len, int32_t* out) const override {
    uint64_t key = HashCombine(seed_ ^ 0x73796e00ull, static_cast<uint64_t>(index));
    int period = 2 + static_cast<int>(SplitMix64(key) % 7);
    int32_t pattern[8];
    for (int i = 0; i < period; ++i) {
      pattern[i] = 'a' + static_cast<int32_t>(HashCombine(key, i + 1) % 16);
    }
    for (int64_t t = 0; t <= seq_len; ++t) out[t] = pattern[t % period];
  }

 private:
  uint64_t seed_;
};

class Delayed final : public TokenDataset {
 public:
  Delayed(std::shared_ptr<const TokenDataset> data, absl::Duration delay)
      : TokenDataset(data->seq_len()), data_(std::move(data)), delay_(delay) {}
  std::string Describe() const override {
    return absl::StrCat(data_->Describe(), " + ", absl::FormatDuration(delay_),
                        " per sample (benchmark delay)");
  }
  int64_t vocab_size() const override { return data_->vocab_size(); }
  void Tokens(int64_t index, int64_t seq_len, int32_t* out) const override {
    absl::SleepFor(delay_);
    data_->Tokens(index, seq_len, out);
  }

 private:
  std::shared_ptr<const TokenDataset> data_;
  absl::Duration delay_;
};

absl::Status BadTokenFile(const std::string& path, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("token file '", path, "': ", problem));
}

std::string TokenHeader(const TokenFileInfo& info) {
  nlohmann::json j = {{"format", "pipewright-tokens"},
                      {"version", 1},
                      {"dtype", info.dtype()},
                      {"vocab_size", info.vocab_size},
                      {"tokens", info.tokens}};
  std::string h = absl::StrCat(kTokenMagic, j.dump());
  h.resize(kTokenFileHeaderBytes - 1, ' ');
  h.push_back('\n');
  return h;
}

absl::StatusOr<TokenFileInfo> ParseTokenHeader(const std::string& path, const unsigned char* data,
                                               size_t size) {
  if (size < kTokenMagicLen || std::memcmp(data, kTokenMagic, kTokenMagicLen) != 0) {
    return BadTokenFile(path, "no PWTOKENS header (make one with 'pipewright data prepare')");
  }
  if (size < static_cast<size_t>(kTokenFileHeaderBytes)) {
    return BadTokenFile(path, absl::StrCat("is ", size, " bytes, shorter than the ",
                                           kTokenFileHeaderBytes, "-byte header"));
  }
  std::string text(reinterpret_cast<const char*>(data) + kTokenMagicLen,
                   kTokenFileHeaderBytes - kTokenMagicLen);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return BadTokenFile(path, "malformed header");
  TokenFileInfo info;
  try {
    if (j.at("format").get<std::string>() != "pipewright-tokens") {
      return BadTokenFile(path, "header format is not 'pipewright-tokens'");
    }
    if (j.at("version").get<int>() != 1) {
      return BadTokenFile(path, absl::StrCat("unsupported version ", j.at("version").dump()));
    }
    const std::string dtype = j.at("dtype").get<std::string>();
    if (dtype == "uint16") {
      info.token_bytes = 2;
    } else if (dtype == "uint32") {
      info.token_bytes = 4;
    } else {
      return BadTokenFile(path, absl::StrCat("dtype '", dtype, "' (uint16 or uint32)"));
    }
    info.vocab_size = j.at("vocab_size").get<int64_t>();
    info.tokens = j.at("tokens").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    return BadTokenFile(path, absl::StrCat("malformed header: ", e.what()));
  }
  const int64_t max_vocab = info.token_bytes == 2 ? int64_t{1} << 16 : int64_t{1} << 31;
  if (info.vocab_size < 1 || info.vocab_size > max_vocab) {
    return BadTokenFile(path, absl::StrCat("vocab_size ", info.vocab_size, " is not in [1, ",
                                           max_vocab, "] for ", info.dtype()));
  }
  if (info.tokens < 0) return BadTokenFile(path, "negative token count");
  const uint64_t want =
      kTokenFileHeaderBytes + static_cast<uint64_t>(info.tokens) * info.token_bytes;
  if (size != want) {
    return BadTokenFile(path, absl::StrCat("is ", size, " bytes; the header's ", info.tokens, " ",
                                           info.dtype(), " tokens make ", want));
  }
  return info;
}

// Every token < vocab, read with pread in blocks rather than through the mapping, so that the
// check leaves nothing resident in the process (Note [Memory-mapped data]).
absl::Status CheckTokens(const std::string& path, const TokenFileInfo& info) {
  if (info.token_bytes == 2 && info.vocab_size == (int64_t{1} << 16)) return absl::OkStatus();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("data file '", path, "': ", Errno()));
  std::vector<unsigned char> buf(size_t{4} << 20);
  const uint64_t end =
      kTokenFileHeaderBytes + static_cast<uint64_t>(info.tokens) * info.token_bytes;
  uint64_t off = kTokenFileHeaderBytes;
  absl::Status status;
  while (off < end && status.ok()) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - off));
    ssize_t got = ::pread(fd, buf.data(), want, static_cast<off_t>(off));
    if (got <= 0 || got % info.token_bytes != 0) {
      // Short reads of a regular file end only at its end, which the size check ruled out.
      status = absl::DataLossError(absl::StrCat("error reading data file '", path, "'"));
      break;
    }
    for (ssize_t i = 0; i < got; i += info.token_bytes) {
      uint32_t v = 0;
      if (info.token_bytes == 2) {
        uint16_t h;
        std::memcpy(&h, &buf[i], 2);
        v = h;
      } else {
        std::memcpy(&v, &buf[i], 4);
      }
      if (v >= static_cast<uint64_t>(info.vocab_size)) {
        const uint64_t index = (off + i - kTokenFileHeaderBytes) / info.token_bytes;
        status =
            BadTokenFile(path, absl::StrCat("token ", index, " is ", v,
                                            ", not below the vocabulary size ", info.vocab_size));
        break;
      }
    }
    off += static_cast<uint64_t>(got);
  }
  ::close(fd);
  return status;
}

}  // namespace

absl::Status internal::WriteTokenStream(const std::string& path, TokenFileInfo info, TokenFill fill,
                                        int64_t* written) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot create '", tmp, "': ", Errno()));
  }
  auto fail = [&](absl::string_view what) {
    std::string msg = absl::StrCat(what, " '", tmp, "': ", Errno());
    std::fclose(f);
    std::remove(tmp.c_str());
    return absl::DataLossError(msg);
  };
  // The header's token count is rewritten at the end, once known.
  std::string header = TokenHeader(info);
  if (std::fwrite(header.data(), 1, header.size(), f) != header.size()) return fail("cannot write");
  std::vector<uint32_t> block(1 << 20);
  std::vector<unsigned char> out(block.size() * info.token_bytes);
  int64_t n = 0;
  while (true) {
    absl::StatusOr<size_t> got_or = fill(block.data(), block.size());
    if (!got_or.ok()) {
      std::fclose(f);
      std::remove(tmp.c_str());
      return got_or.status();
    }
    const size_t got = *got_or;
    if (got == 0) break;
    for (size_t i = 0; i < got; ++i) {
      if (info.token_bytes == 2) {
        uint16_t v = static_cast<uint16_t>(block[i]);
        std::memcpy(&out[2 * i], &v, 2);
      } else {
        std::memcpy(&out[4 * i], &block[i], 4);
      }
    }
    const size_t bytes = got * info.token_bytes;
    if (std::fwrite(out.data(), 1, bytes, f) != bytes) return fail("cannot write");
    n += static_cast<int64_t>(got);
  }
  info.tokens = n;
  header = TokenHeader(info);
  if (std::fseek(f, 0, SEEK_SET) != 0 ||
      std::fwrite(header.data(), 1, header.size(), f) != header.size()) {
    return fail("cannot write");
  }
  if (std::fclose(f) != 0) {
    std::remove(tmp.c_str());
    return absl::DataLossError(absl::StrCat("cannot write '", tmp, "': ", Errno()));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string msg = absl::StrCat("cannot rename '", tmp, "' to '", path, "': ", Errno());
    std::remove(tmp.c_str());
    return absl::DataLossError(msg);
  }
  *written = n;
  return absl::OkStatus();
}

absl::StatusOr<RegularFile> internal::OpenPrepareInput(const std::string& input,
                                                       absl::string_view input_what,
                                                       const std::string& output,
                                                       absl::string_view output_what) {
  PW_ASSIGN_OR_RETURN(RegularFile file, RegularFile::Open(input, input_what));
  // The output replaces what is at its path once complete: never the input itself.
  struct stat in_st, out_st;
  if (::fstat(file.fd(), &in_st) == 0 && ::stat(output.c_str(), &out_st) == 0 &&
      in_st.st_dev == out_st.st_dev && in_st.st_ino == out_st.st_ino) {
    return absl::InvalidArgumentError(
        absl::StrCat("the output '", output, "' is the ", input_what, " '", input,
                     "': writing the tokens there would replace the text (choose another output)"));
  }
  PW_RETURN_IF_ERROR(CheckOutputPath(output, output_what));
  return file;
}

absl::StatusOr<TokenFileInfo> ReadTokenFileInfo(const std::string& path) {
  PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  return ParseTokenHeader(path, file->data(), file->size());
}

absl::Status WriteTokenFile(const std::string& path, const std::vector<uint32_t>& tokens,
                            int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocabulary size ", vocab_size, " is not in [1, 2^31]"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= static_cast<uint64_t>(vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token ", i, " is ", tokens[i], ", not below the vocabulary size ", vocab_size));
    }
  }
  TokenFileInfo info;
  info.vocab_size = vocab_size;
  info.token_bytes = vocab_size <= (int64_t{1} << 16) ? 2 : 4;
  size_t next = 0;
  auto fill = [&](uint32_t* out, size_t cap) -> absl::StatusOr<size_t> {
    size_t n = std::min(cap, tokens.size() - next);
    std::copy_n(tokens.begin() + next, n, out);
    next += n;
    return n;
  };
  int64_t written = 0;
  return internal::WriteTokenStream(path, info, fill, &written);
}

absl::StatusOr<TokenFileInfo> PrepareByteTokenFile(const std::string& input,
                                                   const std::string& output) {
  PW_ASSIGN_OR_RETURN(RegularFile file,
                      internal::OpenPrepareInput(input, "input file", output, "token file"));
  std::FILE* in = ::fdopen(file.Release(), "rb");
  if (in == nullptr) {
    return absl::InternalError(absl::StrCat("input file '", input, "': ", Errno()));
  }
  TokenFileInfo info;  // byte-level: vocabulary 256, uint16
  std::vector<unsigned char> bytes;
  auto fill = [&](uint32_t* out, size_t cap) -> absl::StatusOr<size_t> {
    bytes.resize(cap);
    size_t n = std::fread(bytes.data(), 1, cap, in);
    if (n < cap && std::ferror(in)) {
      return absl::DataLossError(absl::StrCat("error reading input file '", input, "'"));
    }
    std::copy_n(bytes.begin(), n, out);
    return n;
  };
  absl::Status s = internal::WriteTokenStream(output, info, fill, &info.tokens);
  std::fclose(in);
  PW_RETURN_IF_ERROR(s);
  return info;
}

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTokenFileDataset(const std::string& path,
                                                                   int64_t seq_len, uint64_t seed) {
  PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  PW_ASSIGN_OR_RETURN(TokenFileInfo info, ParseTokenHeader(path, file->data(), file->size()));
  if (info.tokens < seq_len + 2) {
    return BadTokenFile(
        path, absl::StrCat("has ", info.tokens, " tokens; a sample needs at least ", seq_len + 2));
  }
  PW_RETURN_IF_ERROR(CheckTokens(path, info));
  return std::make_unique<TokenFileDataset>(path, std::move(file), info, seq_len, seed);
}

SampleSpec TokenDataset::Spec() const {
  return SampleSpec{{seq_len_}, DType::kI32, {seq_len_}, DType::kI32};
}

void TokenDataset::Sample(int64_t index, void* input, void* target) const {
  std::vector<int32_t> tokens(seq_len_ + 1);
  Tokens(index, seq_len_, tokens.data());
  std::copy_n(tokens.data(), seq_len_, static_cast<int32_t*>(input));
  std::copy_n(tokens.data() + 1, seq_len_, static_cast<int32_t*>(target));
}

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTextDataset(const std::string& path,
                                                              int64_t seq_len, uint64_t seed) {
  PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  if (static_cast<int64_t>(file->size()) < seq_len + 2) {
    return absl::InvalidArgumentError(absl::StrCat("data file '", path, "' has ", file->size(),
                                                   " bytes; a sample needs at least ",
                                                   seq_len + 2));
  }
  return std::make_unique<TextDataset>(path, std::move(file), seq_len, seed);
}

std::unique_ptr<TokenDataset> SyntheticDataset(int64_t seq_len, uint64_t seed) {
  return std::make_unique<Synthetic>(seq_len, seed);
}

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenDataset(absl::string_view spec, int64_t seq_len,
                                                          uint64_t seed) {
  if (spec == "synthetic") return SyntheticDataset(seq_len, seed);
  const std::string path(spec);
  bool ecosystem = false;
  absl::StatusOr<std::unique_ptr<TokenDataset>> other =
      internal::OpenEcosystemFormat(path, seq_len, seed, &ecosystem);
  if (ecosystem) return other;
  {
    PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
    const bool tagged = file->size() >= kTokenMagicLen &&
                        std::memcmp(file->data(), kTokenMagic, kTokenMagicLen) == 0;
    if (tagged || absl::EndsWith(path, ".tokens")) {
      return OpenTokenFileDataset(path, seq_len, seed);
    }
  }
  return OpenTextDataset(path, seq_len, seed);
}

absl::Status CheckVocabulary(const TokenDataset& data, int64_t model_vocab) {
  if (data.vocab_size() <= model_vocab) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("data ", data.Describe(), " has vocabulary ",
                                                 data.vocab_size(), "; the model's is ",
                                                 model_vocab));
}

std::unique_ptr<TokenDataset> WithSampleDelay(std::shared_ptr<const TokenDataset> data,
                                              absl::Duration delay) {
  return std::make_unique<Delayed>(std::move(data), delay);
}

StepBatch MakeStepBatch(const Dataset& data, const BatchLayout& layout, int64_t step,
                        int64_t replica) {
  StepBatch batch;
  batch.step = step;
  const SampleSpec spec = data.Spec();
  const int64_t B = layout.micro_batch_size;
  std::vector<int64_t> in_shape = {B}, tg_shape = {B};
  in_shape.insert(in_shape.end(), spec.input_shape.begin(), spec.input_shape.end());
  tg_shape.insert(tg_shape.end(), spec.target_shape.begin(), spec.target_shape.end());
  for (int64_t j = 0; j < layout.micro_batches; ++j) {
    Tensor in = Tensor::Empty(in_shape, spec.input_dtype);
    Tensor tg = Tensor::Empty(tg_shape, spec.target_dtype);
    const size_t in_bytes = in.nbytes() / B, tg_bytes = tg.nbytes() / B;
    for (int64_t b = 0; b < B; ++b) {
      data.Sample(layout.SampleIndex(step, replica, j, b),
                  static_cast<char*>(in.raw()) + b * in_bytes,
                  static_cast<char*>(tg.raw()) + b * tg_bytes);
    }
    batch.inputs.push_back(std::move(in));
    batch.targets.push_back(std::move(tg));
  }
  return batch;
}

// Note [Loader workers]: a step's batch is MakeStepBatch(data, layout, step, replica), a pure
// function of its arguments, so it does not matter which worker builds it or when: workers
// claim steps in order (next_claim), build them concurrently outside the lock, and park the
// results in `built` keyed by step; Next() takes exactly the step it expects. The bound counts
// steps claimed but not yet taken, so a slow step holds back the claims of later ones and memory
// stays at `capacity` batches. With no workers, Next() calls MakeStepBatch itself: the batches
// are the same, only where the time is spent differs (all of it is data wait).
struct DataLoader::State {
  std::shared_ptr<const Dataset> data;
  BatchLayout layout;
  int64_t replica;
  int capacity;
  absl::Mutex mu;
  std::map<int64_t, StepBatch> built ABSL_GUARDED_BY(mu);
  int64_t next_claim ABSL_GUARDED_BY(mu) = 0;  // the next step a worker builds
  int64_t next_take ABSL_GUARDED_BY(mu) = 0;   // the step Next() returns next
  bool stop ABSL_GUARDED_BY(mu) = false;
  absl::Duration waited ABSL_GUARDED_BY(mu);
  std::vector<std::thread> workers;

  void Run() {
    while (true) {
      int64_t step;
      {
        absl::MutexLock lock(&mu);
        auto room = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return stop || next_claim - next_take < capacity;
        };
        mu.Await(absl::Condition(&room));
        if (stop) return;
        step = next_claim++;
      }
      StepBatch b = MakeStepBatch(*data, layout, step, replica);
      absl::MutexLock lock(&mu);
      built.emplace(step, std::move(b));
    }
  }
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> data, BatchLayout layout, int64_t replica,
                       int64_t first_step, int prefetch, int workers)
    : state_(std::make_unique<State>()) {
  state_->data = std::move(data);
  state_->layout = layout;
  state_->replica = replica;
  workers = std::max(0, workers);
  state_->capacity = std::max({1, prefetch, workers});
  {
    absl::MutexLock lock(&state_->mu);
    state_->next_claim = first_step;
    state_->next_take = first_step;
  }
  for (int w = 0; w < workers; ++w) {
    state_->workers.emplace_back([s = state_.get()] { s->Run(); });
  }
}

DataLoader::~DataLoader() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;
  }
  for (std::thread& t : state_->workers) t.join();
}

StepBatch DataLoader::Next() {
  State* s = state_.get();
  absl::Time start = absl::Now();
  if (s->workers.empty()) {
    int64_t step;
    {
      absl::MutexLock lock(&s->mu);
      step = s->next_take++;
    }
    StepBatch b = MakeStepBatch(*s->data, s->layout, step, s->replica);
    absl::MutexLock lock(&s->mu);
    s->waited += absl::Now() - start;
    return b;
  }
  absl::MutexLock lock(&s->mu);
  auto has = [s]() ABSL_SHARED_LOCKS_REQUIRED(s->mu) { return s->built.count(s->next_take) > 0; };
  s->mu.Await(absl::Condition(&has));
  auto it = s->built.find(s->next_take);
  StepBatch b = std::move(it->second);
  s->built.erase(it);
  ++s->next_take;
  s->waited += absl::Now() - start;
  return b;
}

absl::Duration DataLoader::wait_time() const {
  absl::MutexLock lock(&state_->mu);
  return state_->waited;
}

}  // namespace pipewright
