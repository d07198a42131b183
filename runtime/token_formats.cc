// The ecosystem's token files (pipewright/data.h; docs/data.md, "Other token formats"):
// Megatron-LM / NeMo indexed datasets, llm.c token shards and nanoGPT's headerless files, read in
// place from their memory mappings.
//
// Note [Token streams]. Every format is a sequence of token arrays in files: Megatron's .bin
// holds one array per sequence at the byte offsets its .idx lists, an llm.c shard one array after
// a 1 KiB header, several shards one after another. A dataset over them is the concatenation,
// in order, as one stream of tokens (contiguous arrays merged into one segment), and sample i is
// the window of seq_len + 1 tokens at the position WindowStart draws for (seed, i) — as for text
// and PWTOKENS files, so the samples do not depend on the format a corpus is stored in, and a
// window may span two sequences (Megatron's preprocessing puts an end-of-document token between
// documents when asked to; pipewright does not add one). Opening checks everything a sample
// could read: the headers, every array within its file, and (streaming with pread, outside the
// mappings) every token in [0, 2^31); the largest token + 1 is the data's vocabulary, which
// CheckVocabulary compares with the model's.
#include "runtime/token_formats.h"

#include <fcntl.h>
#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipewright/data.h"
#include "runtime/mapped_file.h"

namespace pipewright {
namespace {

using internal::MappedFile;

// How a token is stored.
enum class Elem { kU8, kI8, kI16, kU16, kI32, kU32, kI64 };

int Width(Elem e) {
  switch (e) {
    case Elem::kU8:
    case Elem::kI8:
      return 1;
    case Elem::kI16:
    case Elem::kU16:
      return 2;
    case Elem::kI32:
    case Elem::kU32:
      return 4;
    case Elem::kI64:
      return 8;
  }
  return 1;
}

const char* Name(Elem e) {
  switch (e) {
    case Elem::kU8:
      return "uint8";
    case Elem::kI8:
      return "int8";
    case Elem::kI16:
      return "int16";
    case Elem::kU16:
      return "uint16";
    case Elem::kI32:
      return "int32";
    case Elem::kU32:
      return "uint32";
    case Elem::kI64:
      return "int64";
  }
  return "?";
}

// The little-endian token at p (any alignment).
int64_t Read(const unsigned char* p, Elem e) {
  switch (e) {
    case Elem::kU8:
      return p[0];
    case Elem::kI8:
      return static_cast<int8_t>(p[0]);
    case Elem::kI16: {
      int16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case Elem::kU16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case Elem::kI32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case Elem::kU32: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case Elem::kI64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
  }
  return 0;
}

absl::Status Bad(const std::string& path, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("data file '", path, "': ", problem));
}

// A run of tokens: `tokens` of them at byte `offset` of file `file`.
struct Segment {
  int file = 0;
  uint64_t offset = 0;
  int64_t tokens = 0;
};

// The files of a dataset, their segments (Note [Token streams]) and the stream's vocabulary.
struct TokenStream {
  std::vector<std::string> paths;
  std::vector<std::unique_ptr<MappedFile>> files;
  std::vector<Segment> segments;
  Elem elem = Elem::kU16;
  int64_t tokens = 0;

  // Appends a run, merged into the last segment where it continues it.
  void Add(int file, uint64_t offset, int64_t n) {
    if (n == 0) return;
    if (!segments.empty()) {
      Segment& last = segments.back();
      if (last.file == file &&
          last.offset + static_cast<uint64_t>(last.tokens) * Width(elem) == offset) {
        last.tokens += n;
        tokens += n;
        return;
      }
    }
    segments.push_back({file, offset, n});
    tokens += n;
  }

  // Reads every token with pread (Note [Memory-mapped data]: nothing stays resident): each must
  // be in [0, 2^31). Returns the largest + 1.
  absl::StatusOr<int64_t> Vocabulary() const {
    int64_t largest = -1;
    std::vector<unsigned char> buf(size_t{4} << 20);
    const int w = Width(elem);
    int64_t before = 0;  // tokens of the stream before this segment
    for (const Segment& s : segments) {
      const std::string& path = paths[s.file];
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return absl::NotFoundError(absl::StrCat("data file '", path, "' cannot be read"));
      uint64_t off = s.offset;
      const uint64_t end = s.offset + static_cast<uint64_t>(s.tokens) * w;
      absl::Status status;
      while (off < end && status.ok()) {
        const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - off));
        const ssize_t got = ::pread(fd, buf.data(), want, static_cast<off_t>(off));
        if (got <= 0 || got % w != 0) {
          status = absl::DataLossError(absl::StrCat("error reading data file '", path, "'"));
          break;
        }
        for (ssize_t i = 0; i < got; i += w) {
          const int64_t v = Read(&buf[i], elem);
          if (v < 0 || v > std::numeric_limits<int32_t>::max()) {
            const uint64_t k = before + (off + i - s.offset) / w;
            status = Bad(path,
                         absl::StrCat("token ", k, " of the stream is ", v, ", outside [0, 2^31)"));
            break;
          }
          largest = std::max(largest, v);
        }
        off += static_cast<uint64_t>(got);
      }
      ::close(fd);
      PW_RETURN_IF_ERROR(status);
      before += s.tokens;
    }
    return largest + 1;
  }
};

class StreamDataset final : public TokenDataset {
 public:
  StreamDataset(std::string what, TokenStream stream, int64_t vocab, int64_t seq_len, uint64_t seed)
      : TokenDataset(seq_len),
        what_(std::move(what)),
        s_(std::move(stream)),
        vocab_(vocab),
        seed_(seed) {
    int64_t n = 0;
    for (const Segment& seg : s_.segments) {
      starts_.push_back(n);
      n += seg.tokens;
    }
  }
  std::string Describe() const override {
    // "<format>:<what --data named> (...)": eval reads the part before the last " (" back as
    // the --data of the checkpoint's training data.
    return absl::StrCat(
        what_, " (", s_.tokens, " ", Name(s_.elem), " tokens",
        s_.files.size() > 1 ? absl::StrCat(" from ", s_.files.size(), " files") : std::string(),
        ", vocabulary ", vocab_, ")");
  }
  int64_t vocab_size() const override { return vocab_; }
  void Tokens(int64_t index, int64_t seq_len, int32_t* out) const override {
    const uint64_t span = static_cast<uint64_t>(s_.tokens - seq_len);  // > 1 (open checks)
    int64_t pos = static_cast<int64_t>(internal::WindowStart(seed_, index, span));
    size_t k = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) -
                                   starts_.begin()) -
               1;
    const int w = Width(s_.elem);
    for (int64_t t = 0; t <= seq_len; ++t, ++pos) {
      while (pos >= starts_[k] + s_.segments[k].tokens) ++k;
      const Segment& seg = s_.segments[k];
      const unsigned char* p =
          s_.files[seg.file]->data() + seg.offset + static_cast<uint64_t>(pos - starts_[k]) * w;
      out[t] = static_cast<int32_t>(Read(p, s_.elem));
    }
    for (const auto& f : s_.files) f->SampleRead();
  }

 private:
  std::string what_;
  TokenStream s_;
  std::vector<int64_t> starts_;  // per segment: its first token's position in the stream
  int64_t vocab_;
  uint64_t seed_;
};

absl::StatusOr<std::unique_ptr<TokenDataset>> Finish(std::string what, TokenStream s,
                                                     int64_t seq_len, uint64_t seed) {
  if (s.tokens < seq_len + 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", s.tokens, " tokens; a sample needs at least ", seq_len + 2));
  }
  PW_ASSIGN_OR_RETURN(const int64_t vocab, s.Vocabulary());
  return std::make_unique<StreamDataset>(std::move(what), std::move(s), vocab, seq_len, seed);
}

// Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType).
absl::StatusOr<Elem> MegatronElem(const std::string& path, int code) {
  switch (code) {
    case 1:
      return Elem::kU8;
    case 2:
      return Elem::kI8;
    case 3:
      return Elem::kI16;
    case 4:
      return Elem::kI32;
    case 5:
      return Elem::kI64;
    case 8:
      return Elem::kU16;
    case 6:
    case 7:
      return Bad(path, absl::StrCat("dtype code ", code, " (", code == 6 ? "float64" : "float32",
                                    "): token ids must be integers"));
    default:
      return Bad(path, absl::StrCat("unknown dtype code ", code,
                                    " (Megatron's are 1-8: uint8, int8, int16, int32, int64, "
                                    "float64, float32, uint16)"));
  }
}

constexpr char kMegatronMagic[] = "MMIDIDX\0\0";
constexpr size_t kMegatronMagicLen = 9;
constexpr size_t kMegatronHeader = 9 + 8 + 1 + 8 + 8;
constexpr int32_t kLlmcMagic = 20240520;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

template <typename T>
T At(const unsigned char* p, uint64_t offset) {
  T v;
  std::memcpy(&v, p + offset, sizeof(T));
  return v;
}

bool StartsWithLlmcMagic(const MappedFile& f) {
  return f.size() >= 4 && At<int32_t>(f.data(), 0) == kLlmcMagic;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenMegatronDataset(const std::string& path,
                                                                  int64_t seq_len, uint64_t seed) {
  std::string prefix = path;
  if (absl::EndsWith(prefix, ".bin") || absl::EndsWith(prefix, ".idx")) {
    prefix.resize(prefix.size() - 4);
  }
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> idx, MappedFile::Open(idx_path));
  const unsigned char* p = idx->data();
  const uint64_t size = idx->size();
  if (size < kMegatronHeader) {
    return Bad(idx_path, absl::StrCat("has ", size, " bytes, less than the index header's ",
                                      kMegatronHeader, " (truncated?)"));
  }
  if (std::memcmp(p, kMegatronMagic, kMegatronMagicLen) != 0) {
    return Bad(idx_path, "does not start with Megatron's index magic \"MMIDIDX\\0\\0\"");
  }
  const uint64_t version = At<uint64_t>(p, 9);
  if (version != 1) {
    return Bad(idx_path, absl::StrCat("index version ", version, "; only version 1 is read"));
  }
  PW_ASSIGN_OR_RETURN(const Elem elem, MegatronElem(idx_path, p[17]));
  const uint64_t sequences = At<uint64_t>(p, 18), documents = At<uint64_t>(p, 26);
  // Every count is bounded by the file before any product is formed.
  const uint64_t body = size - kMegatronHeader;
  if (sequences > body / 12 || documents > body / 8 || sequences * 12 + documents * 8 > body) {
    return Bad(idx_path,
               absl::StrCat("says ", sequences, " sequences and ", documents,
                            " document indices, more than its ", size, " bytes hold (truncated?)"));
  }
  const uint64_t expect = kMegatronHeader + sequences * 12 + documents * 8;
  // Newer multimodal indices append one int8 mode per sequence.
  if (size != expect && size != expect + sequences) {
    return Bad(idx_path, absl::StrCat("has ", size, " bytes; ", sequences, " sequences and ",
                                      documents, " document indices take ", expect));
  }
  TokenStream s;
  s.elem = elem;
  s.paths = {bin_path};
  PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> bin, MappedFile::Open(bin_path));
  const uint64_t bin_size = bin->size();
  const int w = Width(elem);
  const uint64_t lengths = kMegatronHeader, pointers = lengths + 4 * sequences,
                 docs = pointers + 8 * sequences;
  for (uint64_t i = 0; i < sequences; ++i) {
    const int32_t n = At<int32_t>(p, lengths + 4 * i);
    const int64_t at = At<int64_t>(p, pointers + 8 * i);
    if (n < 0 || at < 0 || static_cast<uint64_t>(at) > bin_size ||
        static_cast<uint64_t>(n) * w > bin_size - static_cast<uint64_t>(at)) {
      return Bad(bin_path, absl::StrCat("sequence ", i, " (", n, " tokens at byte ", at,
                                        ") lies outside its ", bin_size, " bytes (truncated?)"));
    }
    s.Add(0, static_cast<uint64_t>(at), n);
  }
  int64_t previous = 0;
  for (uint64_t d = 0; d < documents; ++d) {
    const int64_t v = At<int64_t>(p, docs + 8 * d);
    if (v < previous || static_cast<uint64_t>(v) > sequences) {
      return Bad(idx_path,
                 absl::StrCat("document index ", d, " is ", v, ": they must rise from 0 to the ",
                              sequences, " sequences"));
    }
    previous = v;
  }
  s.files.push_back(std::move(bin));
  return Finish(absl::StrCat("megatron:", prefix), std::move(s), seq_len, seed);
}

namespace {

// The shards `paths` as one stream, described as llmc:`label`.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenShards(const std::vector<std::string>& paths,
                                                         const std::string& label, int64_t seq_len,
                                                         uint64_t seed) {
  if (paths.empty()) return absl::InvalidArgumentError("token shards: no files");
  TokenStream s;
  for (size_t k = 0; k < paths.size(); ++k) {
    const std::string& path = paths[k];
    PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(path));
    if (f->size() < static_cast<uint64_t>(kLlmcHeaderBytes)) {
      return Bad(path, absl::StrCat("has ", f->size(), " bytes, less than an llm.c shard's ",
                                    kLlmcHeaderBytes, "-byte header"));
    }
    if (!StartsWithLlmcMagic(*f)) {
      return Bad(path, absl::StrCat("does not start with llm.c's shard magic ", kLlmcMagic));
    }
    const int32_t version = At<int32_t>(f->data(), 4), count = At<int32_t>(f->data(), 8);
    if (version != 1 && version != 2) {
      return Bad(path, absl::StrCat("shard version ", version,
                                    "; 1 (uint16 tokens) and 2 (uint32 tokens) are read"));
    }
    const Elem elem = version == 1 ? Elem::kU16 : Elem::kU32;
    if (k > 0 && elem != s.elem) {
      return Bad(path, absl::StrCat("holds ", Name(elem), " tokens where ", paths[0], " holds ",
                                    Name(s.elem), "; shards of one dataset must agree"));
    }
    s.elem = elem;
    const uint64_t want = static_cast<uint64_t>(kLlmcHeaderBytes) +
                          static_cast<uint64_t>(std::max(count, 0)) * Width(elem);
    if (count < 0 || f->size() != want) {
      return Bad(path, absl::StrCat("header says ", count, " ", Name(elem), " tokens (", want,
                                    " bytes with the header); the file has ", f->size(),
                                    count >= 0 && f->size() < want ? " (truncated?)" : ""));
    }
    s.paths.push_back(path);
    s.Add(static_cast<int>(k), static_cast<uint64_t>(kLlmcHeaderBytes), count);
    s.files.push_back(std::move(f));
  }
  return Finish(absl::StrCat("llmc:", label), std::move(s), seq_len, seed);
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTokenShards(const std::vector<std::string>& paths,
                                                              int64_t seq_len, uint64_t seed) {
  return OpenShards(paths, paths.empty() ? "" : absl::StrJoin(paths, ","), seq_len, seed);
}

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenRawTokens(const std::string& path,
                                                            int token_bytes, int64_t seq_len,
                                                            uint64_t seed) {
  if (token_bytes != 2 && token_bytes != 4) {
    return absl::InvalidArgumentError("raw tokens: 2 (uint16) or 4 (uint32) bytes each");
  }
  PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(path));
  if (f->size() % token_bytes != 0) {
    return Bad(path, absl::StrCat("has ", f->size(), " bytes, not a whole number of ", token_bytes,
                                  "-byte tokens"));
  }
  TokenStream s;
  s.elem = token_bytes == 2 ? Elem::kU16 : Elem::kU32;
  s.paths = {path};
  s.Add(0, 0, static_cast<int64_t>(f->size() / token_bytes));
  s.files.push_back(std::move(f));
  return Finish(absl::StrCat("nanogpt:", path), std::move(s), seq_len, seed);
}

namespace internal {

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenEcosystemFormat(const std::string& spec,
                                                                  int64_t seq_len, uint64_t seed,
                                                                  bool* matched) {
  *matched = true;
  if (absl::StartsWith(spec, "nanogpt:")) return OpenRawTokens(spec.substr(8), 2, seq_len, seed);
  if (spec.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = ::glob(spec.c_str(), GLOB_ERR, nullptr, &g);
    std::vector<std::string> paths;
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (paths.empty()) {
      return absl::NotFoundError(absl::StrCat("no data file matches '", spec, "'"));
    }
    std::sort(paths.begin(), paths.end());
    return OpenShards(paths, spec, seq_len, seed);
  }
  std::error_code ec;
  if (!std::filesystem::exists(spec, ec) && std::filesystem::exists(spec + ".idx", ec)) {
    return OpenMegatronDataset(spec, seq_len, seed);  // Megatron's prefix, as its flags take it
  }
  if (absl::EndsWith(spec, ".idx") ||
      (absl::EndsWith(spec, ".bin") &&
       std::filesystem::exists(spec.substr(0, spec.size() - 4) + ".idx", ec))) {
    return OpenMegatronDataset(spec, seq_len, seed);
  }
  PW_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> f, MappedFile::Open(spec));
  if (StartsWithLlmcMagic(*f)) return OpenShards({spec}, spec, seq_len, seed);
  if (absl::EndsWith(spec, ".bin")) {
    return Bad(spec,
               "is neither a Megatron dataset (no .idx beside it) nor an llm.c shard (no "
               "20240520 magic); a headerless nanoGPT file is read as nanogpt:PATH");
  }
  *matched = false;
  return absl::NotFoundError("not an ecosystem token file");
}

}  // namespace internal
}  // namespace pipewright
