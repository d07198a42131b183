#include "pipewright/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "runtime/sha256.h"

namespace pipewright {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;  // 100 MB, as in the reference impl

std::string ErrnoMessage(int err) { return std::strerror(err); }

absl::Status ErrnoStatus(int err, absl::string_view what, const std::string& path) {
  std::string msg = absl::StrCat(what, " '", path, "': ", ErrnoMessage(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Closes a file descriptor on scope exit unless released.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and reports the error (close can report deferred write errors).
  int Close() {
    int fd = fd_;
    fd_ = -1;
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, std::min<size_t>(size, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot write", path);
    }
    if (n == 0) return ErrnoStatus(ENOSPC, "cannot write", path);
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PreadAll(int fd, void* data, size_t size, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, std::min<size_t>(size, size_t{1} << 30), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat("'", path, "': unexpected end of file"));
    }
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// Writes `chunks` to `path` (created/truncated) and fsyncs it.
absl::Status WriteFileSynced(const std::string& path,
                             const std::vector<std::pair<const void*, size_t>>& chunks) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoStatus(errno, "cannot create", path);
  for (const auto& [data, size] : chunks) {
    PW_RETURN_IF_ERROR(WriteAll(fd.get(), data, size, path));
  }
  if (::fsync(fd.get()) != 0) return ErrnoStatus(errno, "cannot fsync", path);
  if (int err = fd.Close(); err != 0) return ErrnoStatus(err, "cannot close", path);
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoStatus(errno, "cannot open directory", path);
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    return ErrnoStatus(errno, "cannot fsync directory", path);
  }
  return absl::OkStatus();
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

// Reads a JSON integer that must be a non-negative int64.
bool GetNonNegative(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = s;
    return true;
  }
  return false;
}

// Builds the padded header text for `tensors`.
absl::StatusOr<std::string> BuildHeader(const std::string& path, const NamedTensors& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    auto err = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write '", path, "': tensor '", name, "': ", what));
    };
    if (name.empty()) return err("empty tensor name");
    if (name == "__metadata__") return err("reserved tensor name");
    if (!IsValidUtf8(name)) return err("name is not valid UTF-8");
    if (!seen.insert(name).second) return err("duplicate tensor name");
    if (!t.device().is_cpu()) return err("not a host tensor");
    int64_t numel = 1;
    for (int64_t d : t.shape()) {
      if (d < 0) return err("negative dimension");
      numel *= d;
    }
    if (numel != t.numel()) return err("undefined tensor");
    if (t.nbytes() > 0 && t.raw() == nullptr) return err("tensor has no storage");
    json entry = json::object();
    entry["dtype"] = DTypeSafetensorsName(t.dtype());
    entry["shape"] = t.shape();
    entry["data_offsets"] = {offset, offset + t.nbytes()};
    header[name] = std::move(entry);
    offset += t.nbytes();
  }
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) {
      if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("cannot write '", path, "': metadata '", k, "' is not valid UTF-8"));
      }
      meta[k] = v;
    }
    header["__metadata__"] = std::move(meta);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// Strips a trailing separator so "a/b/" names the directory "a/b".
fs::path NormalizeDir(const std::string& dir) {
  fs::path p(dir);
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p;
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoStatus(errno, "cannot open", path);
  std::string out;
  char buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

}  // namespace

namespace {

// A file written by WriteCheckpoint, as its manifest records it.
struct FileDigest {
  uint64_t bytes = 0;
  std::string sha256;
};

// WriteSafetensors, returning the digest of the bytes written when `digest` is not null.
absl::Status WriteSafetensorsFile(const std::string& path, const NamedTensors& tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  FileDigest* digest) {
  PW_ASSIGN_OR_RETURN(std::string header, BuildHeader(path, tensors, metadata));
  unsigned char len_bytes[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xFF);
  std::vector<std::pair<const void*, size_t>> chunks;
  chunks.reserve(tensors.size() + 2);
  chunks.emplace_back(len_bytes, sizeof(len_bytes));
  chunks.emplace_back(header.data(), header.size());
  for (const auto& [name, t] : tensors) {
    if (t.nbytes() > 0) chunks.emplace_back(t.raw(), t.nbytes());
  }
  if (digest != nullptr) {
    Sha256 h;
    digest->bytes = 0;
    for (const auto& [data, size] : chunks) {
      h.Update(data, size);
      digest->bytes += size;
    }
    digest->sha256 = h.HexDigest();
  }
  return WriteFileSynced(path, chunks);
}

// The SHA-256 and size of the file at `path`, read in 1 MiB pieces.
absl::StatusOr<FileDigest> DigestFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoStatus(errno, "cannot open", path);
  std::vector<char> buf(1 << 20);
  Sha256 h;
  FileDigest d;
  while (true) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) break;
    h.Update(buf.data(), static_cast<size_t>(n));
    d.bytes += static_cast<uint64_t>(n);
  }
  d.sha256 = h.HexDigest();
  return d;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata) {
  return WriteSafetensorsFile(path, tensors, metadata, nullptr);
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path, Allocator* allocator) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoStatus(errno, "cannot open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    return absl::DataLossError(
        absl::StrCat("'", path, "': truncated safetensors file (", file_size, " bytes)"));
  }
  unsigned char len_bytes[8];
  PW_RETURN_IF_ERROR(PreadAll(fd.get(), len_bytes, 8, 0, path));
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': header length ", header_len,
                                                   " exceeds the limit of ", kMaxHeaderBytes));
  }
  if (header_len > file_size - 8) {
    return absl::DataLossError(absl::StrCat("'", path, "': header length ", header_len,
                                            " exceeds the file size ", file_size));
  }
  std::string header_text(header_len, '\0');
  PW_RETURN_IF_ERROR(PreadAll(fd.get(), header_text.data(), header_len, 8, path));
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;

  json header = json::parse(header_text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': malformed JSON header"));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': JSON header is not an object"));
  }

  SafetensorsFile out;
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", path, "': __metadata__ is not an object"));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("'", path, "': metadata '", m.key(), "' is not a string"));
        }
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto err = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("'", path, "': tensor '", name, "': ", what));
    };
    if (name.empty()) return err("empty tensor name");
    if (!v.is_object()) return err("entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return err("missing or non-string 'dtype'");
    if (sh == v.end() || !sh->is_array()) return err("missing or non-array 'shape'");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return err("'data_offsets' must be an array of two integers");
    }
    const std::string dtype_name = dt->get<std::string>();
    // Only the safetensors (upper-case) spellings are accepted from files.
    if (dtype_name != "F32" && dtype_name != "BF16" && dtype_name != "F16" && dtype_name != "I32") {
      return err(absl::StrCat("unsupported dtype '", dtype_name, "'"));
    }
    Entry e;
    e.name = name;
    PW_ASSIGN_OR_RETURN(e.dtype, ParseDType(dtype_name));
    uint64_t numel = 1;
    for (const json& d : *sh) {
      int64_t dim;
      if (!GetNonNegative(d, &dim)) return err("shape entries must be non-negative integers");
      e.shape.push_back(dim);
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel) ||
          numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return err("shape overflows");
      }
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(e.dtype)), &nbytes)) {
      return err("byte size overflows");
    }
    int64_t b, en;
    if (!GetNonNegative((*off)[0], &b) || !GetNonNegative((*off)[1], &en)) {
      return err("'data_offsets' must be non-negative integers");
    }
    e.begin = static_cast<uint64_t>(b);
    e.end = static_cast<uint64_t>(en);
    if (e.begin > e.end) return err("data_offsets begin > end");
    if (e.end > data_size) {
      return absl::DataLossError(absl::StrCat("'", path, "': tensor '", name, "': data_offsets [",
                                              e.begin, ", ", e.end, "] exceed the data size ",
                                              data_size));
    }
    if (e.end - e.begin != nbytes) {
      return err(absl::StrCat("data_offsets span ", e.end - e.begin, " bytes but shape x dtype is ",
                              nbytes, " bytes"));
    }
    entries.push_back(std::move(e));
  }

  // Offsets must tile the data buffer exactly: contiguous, non-overlapping, no gaps.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  for (const Entry& e : entries) {
    if (e.begin != cursor) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "': tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
                       "] are not contiguous (expected begin ", cursor, ")"));
    }
    cursor = e.end;
  }
  if (cursor != data_size) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': tensors cover ", cursor,
                                                   " bytes but the data section has ", data_size,
                                                   " bytes"));
  }

  if (allocator != nullptr && !allocator->device().is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reading '", path, "': ReadSafetensors needs a host allocator"));
  }
  for (Entry& e : entries) {
    Tensor t = Tensor::Empty(std::move(e.shape), e.dtype, allocator);
    if (t.nbytes() > 0) {
      absl::Status s = PreadAll(fd.get(), t.raw(), t.nbytes(), data_start + e.begin, path);
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat(s.message(), " (tensor '", e.name, "')"));
      }
    }
    out.tensors.emplace(std::move(e.name), std::move(t));
  }
  return out;
}

namespace {

// Creates the parent of `target` and a fresh, empty `tmp` beside it.
absl::Status MakeTempDir(const fs::path& target, const std::string& tmp) {
  std::error_code ec;
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("cannot create directory '", parent.string(), "': ", ec.message()));
    }
  }
  fs::remove_all(tmp, ec);
  if (::mkdir(tmp.c_str(), 0755) != 0) return ErrnoStatus(errno, "cannot create directory", tmp);
  return absl::OkStatus();
}

// Writes `files` into `tmp`, each fsync'ed; their digests into `digests` (name -> {bytes, sha256}).
absl::Status WriteTensorFiles(const std::string& tmp,
                              const std::vector<std::pair<std::string, const NamedTensors*>>& files,
                              json* digests) {
  for (const auto& [name, tensors] : files) {
    FileDigest d;
    PW_RETURN_IF_ERROR(WriteSafetensorsFile(tmp + "/" + name, *tensors, {}, &d));
    (*digests)[name] = {{"bytes", d.bytes}, {"sha256", d.sha256}};
  }
  return absl::OkStatus();
}

// The manifest with `digests` as its "files", then the manifest's own digest, then an fsync of
// `tmp` (Note [Checkpoint digests]).
absl::Status WriteManifest(const std::string& tmp, const std::string& manifest_json, json digests) {
  json manifest = json::parse(manifest_json, nullptr, false);
  if (manifest.is_discarded() || !manifest.is_object()) {
    return absl::InvalidArgumentError("WriteCheckpoint: the manifest is not a JSON object");
  }
  manifest["files"] = std::move(digests);
  const std::string text = manifest.dump(2);
  PW_RETURN_IF_ERROR(WriteFileSynced(tmp + "/manifest.json", {{text.data(), text.size()}}));
  const std::string line = absl::StrCat(Sha256Hex(text), "  manifest.json\n");
  PW_RETURN_IF_ERROR(WriteFileSynced(tmp + "/manifest.json.sha256", {{line.data(), line.size()}}));
  return FsyncDir(tmp);
}

// Renames the complete `tmp` over `target`: an existing checkpoint there is moved aside to
// `old` first and removed only after the rename and the parent's fsync.
absl::Status CommitDir(const std::string& tmp, const fs::path& target, const std::string& old) {
  std::error_code ec;
  const std::string target_str = target.string();
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  bool had_old = false;
  if (fs::exists(target, ec)) {
    fs::remove_all(old, ec);
    if (::rename(target_str.c_str(), old.c_str()) != 0) {
      absl::Status s = ErrnoStatus(errno, "cannot move the old checkpoint aside", target_str);
      fs::remove_all(tmp, ec);
      return s;
    }
    had_old = true;
  }
  if (::rename(tmp.c_str(), target_str.c_str()) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot rename checkpoint into place", target_str);
    if (had_old) ::rename(old.c_str(), target_str.c_str());
    fs::remove_all(tmp, ec);
    return s;
  }
  PW_RETURN_IF_ERROR(FsyncDir(parent.string()));
  if (had_old) {
    fs::remove_all(old, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("checkpoint written, but cannot remove '", old, "': ", ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteCheckpoint(const std::string& dir, const std::string& manifest_json,
                             const NamedTensors& model, const NamedTensors& optimizer,
                             const NamedTensors& grad_sync) {
  static std::atomic<uint64_t> counter{0};
  const fs::path target = NormalizeDir(dir);
  const std::string pid = std::to_string(static_cast<long>(::getpid()));
  const std::string tmp = absl::StrCat(target.string(), ".tmp-", pid, "-", counter.fetch_add(1));
  PW_RETURN_IF_ERROR(MakeTempDir(target, tmp));
  std::vector<std::pair<std::string, const NamedTensors*>> files = {
      {"model.safetensors", &model}, {"optimizer.safetensors", &optimizer}};
  if (!grad_sync.empty()) files.emplace_back("grad_sync.safetensors", &grad_sync);
  json digests = json::object();
  absl::Status s = WriteTensorFiles(tmp, files, &digests);
  if (s.ok()) s = WriteManifest(tmp, manifest_json, std::move(digests));
  if (!s.ok()) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    return s;
  }
  return CommitDir(tmp, target, absl::StrCat(target.string(), ".old-", pid));
}

// Note [Collective checkpoints]. Under a launcher each process holds only its own ranks, so each
// writes its own files into one shared temporary directory (DIR.tmp-shared: the same name in
// every process, created fresh by the root before anyone writes), and the root writes the
// manifest, with every process's digests, only after all of them report their files durable;
// then it renames the directory into place exactly as WriteCheckpoint does. Three exchanges
// order it: the directory exists; every file is written (or which process failed and why); the
// commit's outcome, so every process returns the same status. A crash at any point leaves the
// old checkpoint and DIR.tmp-shared debris, which RemoveCheckpointDebris clears.
absl::Status WriteCheckpointCollective(
    const std::string& dir, const std::string& manifest_json,
    const std::vector<std::pair<std::string, const NamedTensors*>>& files, bool root,
    const CheckpointExchange& exchange) {
  const fs::path target = NormalizeDir(dir);
  const std::string tmp = target.string() + ".tmp-shared";
  // 1: the root makes the directory; everyone learns whether it could.
  std::string made = "ok";
  if (root) {
    absl::Status s = MakeTempDir(target, tmp);
    if (!s.ok()) made = std::string(s.message());
  }
  PW_ASSIGN_OR_RETURN(std::vector<std::string> step1, exchange(made));
  for (const std::string& m : step1) {
    if (m != "ok") return absl::InternalError(absl::StrCat("checkpoint '", dir, "': ", m));
  }
  // 2: every process writes its files; the root gathers the digests (or the errors).
  json mine = json::object();
  absl::Status wrote = WriteTensorFiles(tmp, files, &mine);
  const std::string report = wrote.ok() ? mine.dump() : "error: " + std::string(wrote.message());
  PW_ASSIGN_OR_RETURN(std::vector<std::string> reports, exchange(report));
  // 3: the root writes the manifest and commits; everyone learns the outcome.
  std::string outcome = "ok";
  if (root) {
    absl::Status s = absl::OkStatus();
    json digests = json::object();
    for (size_t p = 0; p < reports.size() && s.ok(); ++p) {
      if (absl::StartsWith(reports[p], "error: ")) {
        s = absl::InternalError(absl::StrCat("process ", p, ": ", reports[p].substr(7)));
        break;
      }
      json d = json::parse(reports[p], nullptr, false);
      for (const auto& [name, v] : d.items()) {
        if (digests.contains(name)) {
          s = absl::InternalError(absl::StrCat("two processes wrote '", name, "'"));
          break;
        }
        digests[name] = v;
      }
    }
    if (s.ok()) s = WriteManifest(tmp, manifest_json, std::move(digests));
    if (s.ok()) {
      s = CommitDir(tmp, target,
                    absl::StrCat(target.string(), ".old-", static_cast<long>(::getpid())));
    } else {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    if (!s.ok()) outcome = std::string(s.message());
  }
  PW_ASSIGN_OR_RETURN(std::vector<std::string> outcomes, exchange(outcome));
  if (!wrote.ok()) return wrote;
  for (const std::string& o : outcomes) {
    if (o != "ok") return absl::InternalError(absl::StrCat("checkpoint '", dir, "': ", o));
  }
  return absl::OkStatus();
}

namespace {

constexpr char kStepPrefix[] = "step-";
constexpr size_t kStepPrefixLen = sizeof(kStepPrefix) - 1;
constexpr char kLatest[] = "latest";

// Note [Checkpoint digests]. WriteCheckpoint records each tensor file's size and SHA-256 in the
// manifest ("files") and the manifest's own SHA-256 in manifest.json.sha256 (sha256sum's
// format, so `sha256sum -c` checks it too). Reading verifies both before any tensor is used: a
// flipped byte anywhere in a checkpoint is a DataLoss error naming the file, both digests
// included. A checkpoint written before digests existed has neither and is read unverified.
absl::Status VerifyDigests(const fs::path& root, const std::string& manifest_text) {
  std::error_code ec;
  const std::string sums = (root / "manifest.json.sha256").string();
  if (fs::exists(sums, ec)) {
    PW_ASSIGN_OR_RETURN(std::string line, ReadTextFile(sums));
    const std::string actual = Sha256Hex(manifest_text);
    if (line.size() < 64 || line.compare(0, 64, actual) != 0) {
      return absl::DataLossError(absl::StrCat(
          (root / "manifest.json").string(), ": SHA-256 mismatch (manifest.json.sha256 records ",
          line.substr(0, std::min<size_t>(64, line.size())), ", the file hashes to ", actual, ")"));
    }
    if (line != absl::StrCat(actual, "  manifest.json\n")) {
      return absl::DataLossError(
          absl::StrCat(sums, ": not the line \"<sha256>  manifest.json\" WriteCheckpoint writes"));
    }
  }
  json m = json::parse(manifest_text, nullptr, false);
  if (m.is_discarded() || !m.is_object() || !m.contains("files")) return absl::OkStatus();
  if (!m["files"].is_object()) {
    return absl::DataLossError(
        absl::StrCat((root / "manifest.json").string(), ": \"files\" is not an object"));
  }
  for (const auto& [name, d] : m["files"].items()) {
    const std::string path = (root / name).string();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
        !d.is_object() || !d.contains("sha256") || !d["sha256"].is_string() ||
        !d.contains("bytes") || !d["bytes"].is_number_unsigned()) {
      return absl::DataLossError(absl::StrCat((root / "manifest.json").string(), ": files[\"", name,
                                              "\"] is not {bytes, sha256} of a file here"));
    }
    if (!fs::exists(path, ec)) {
      return absl::DataLossError(absl::StrCat(path, ": listed in the manifest but missing"));
    }
    PW_ASSIGN_OR_RETURN(FileDigest actual, DigestFile(path));
    const uint64_t bytes = d["bytes"].get<uint64_t>();
    const std::string sha = d["sha256"].get<std::string>();
    if (actual.bytes != bytes) {
      return absl::DataLossError(
          absl::StrCat(path, ": ", actual.bytes, " bytes, the manifest records ", bytes));
    }
    if (actual.sha256 != sha) {
      return absl::DataLossError(absl::StrCat(path, ": SHA-256 mismatch (the manifest records ",
                                              sha, ", the file hashes to ", actual.sha256, ")"));
    }
  }
  return absl::OkStatus();
}

// The tensors of `kind` ("model", "optimizer", "grad_sync") by name, from KIND.safetensors (one
// process's checkpoint) and every KIND-*.safetensors (the shards of a collective one: Note
// [Collective checkpoints]); empty when there is none. A name in two files is DataLoss.
absl::StatusOr<std::map<std::string, Tensor>> ReadShards(const fs::path& root,
                                                         const std::string& kind,
                                                         Allocator* allocator) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n == kind + ".safetensors" ||
        (absl::StartsWith(n, kind + "-") && absl::EndsWith(n, ".safetensors"))) {
      names.push_back(n);
    }
  }
  std::sort(names.begin(), names.end());
  std::map<std::string, Tensor> out;
  for (const std::string& n : names) {
    PW_ASSIGN_OR_RETURN(SafetensorsFile f, ReadSafetensors((root / n).string(), allocator));
    for (auto& [name, t] : f.tensors) {
      if (!out.emplace(name, std::move(t)).second) {
        return absl::DataLossError(absl::StrCat((root / n).string(), ": tensor '", name,
                                                "' is also in another ", kind, " file"));
      }
    }
  }
  return out;
}

// One checkpoint directory (manifest.json and its tensor files), verified.
absl::StatusOr<Checkpoint> ReadOneCheckpoint(const fs::path& root, Allocator* allocator) {
  std::error_code ec;
  const std::string manifest_path = (root / "manifest.json").string();
  if (!fs::exists(manifest_path, ec)) {
    return absl::NotFoundError(absl::StrCat("'", manifest_path, "' not found"));
  }
  Checkpoint ckpt;
  ckpt.path = root.string();
  PW_ASSIGN_OR_RETURN(ckpt.manifest_json, ReadTextFile(manifest_path));
  PW_RETURN_IF_ERROR(VerifyDigests(root, ckpt.manifest_json));
  PW_ASSIGN_OR_RETURN(ckpt.model, ReadShards(root, "model", allocator));
  if (ckpt.model.empty() && !fs::exists(root / "model.safetensors", ec)) {
    return absl::NotFoundError(
        absl::StrCat("'", (root / "model.safetensors").string(), "' not found"));
  }
  PW_ASSIGN_OR_RETURN(ckpt.optimizer, ReadShards(root, "optimizer", allocator));
  PW_ASSIGN_OR_RETURN(ckpt.grad_sync, ReadShards(root, "grad_sync", allocator));
  return ckpt;
}

// The step of a "step-NNNNNN" name, or -1.
int64_t StepOf(const std::string& name) {
  if (name.size() <= kStepPrefixLen || name.compare(0, kStepPrefixLen, kStepPrefix) != 0) {
    return -1;
  }
  int64_t step = 0;
  for (size_t i = kStepPrefixLen; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (int64_t{1} << 50)) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// The step checkpoints in a checkpoint directory, newest first.
std::vector<std::pair<int64_t, fs::path>> StepCheckpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = StepOf(e.path().filename().string());
    if (step >= 0 && e.is_directory(ec)) out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// What DIR/latest names ("" when it is missing or does not name a step checkpoint).
std::string LatestName(const fs::path& root) {
  absl::StatusOr<std::string> text = ReadTextFile((root / kLatest).string());
  if (!text.ok()) return "";
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return StepOf(name) >= 0 ? name : "";
}

}  // namespace

std::string StepCheckpointName(int64_t step) {
  std::string digits = std::to_string(step);
  if (digits.size() < 6) digits.insert(0, 6 - digits.size(), '0');
  return absl::StrCat(kStepPrefix, digits);
}

namespace {

// The checkpoints DIR offers, in the order to try them: DIR itself when it has a manifest.json;
// else the step checkpoint DIR/latest names, then every step checkpoint, newest first.
absl::StatusOr<std::vector<fs::path>> CheckpointCandidates(const std::string& dir) {
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory '", dir, "' not found"));
  }
  if (fs::exists(root / "manifest.json", ec)) return std::vector<fs::path>{root};
  std::vector<fs::path> candidates;
  if (const std::string latest = LatestName(root); !latest.empty()) {
    candidates.push_back(root / latest);
  }
  for (const auto& [step, path] : StepCheckpoints(root)) {
    if (candidates.empty() || path != candidates.front()) candidates.push_back(path);
  }
  if (candidates.empty()) {
    return absl::NotFoundError(
        absl::StrCat("'", (root / "manifest.json").string(),
                     "' not found, and no step checkpoint (step-NNNNNN) in '", dir, "'"));
  }
  return candidates;
}

}  // namespace

absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& dir) {
  PW_ASSIGN_OR_RETURN(std::vector<fs::path> candidates, CheckpointCandidates(dir));
  std::error_code ec;
  for (const fs::path& c : candidates) {
    if (fs::exists(c / "manifest.json", ec)) return c.string();
  }
  return absl::NotFoundError(absl::StrCat("no checkpoint in '", dir, "' has a manifest.json"));
}

absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir, Allocator* allocator) {
  PW_ASSIGN_OR_RETURN(std::vector<fs::path> candidates, CheckpointCandidates(dir));
  if (candidates.size() == 1 && candidates[0] == NormalizeDir(dir)) {
    return ReadOneCheckpoint(candidates[0], allocator);
  }
  std::vector<std::string> failures;
  for (const fs::path& c : candidates) {
    absl::StatusOr<Checkpoint> ck = ReadOneCheckpoint(c, allocator);
    if (!ck.ok()) {
      failures.emplace_back(ck.status().message());
      continue;
    }
    for (const std::string& f : failures) {
      ck->warnings.push_back(
          absl::StrCat("damaged checkpoint skipped: ", f, "; resuming from ", c.string()));
    }
    return ck;
  }
  std::string all;
  for (const std::string& f : failures) absl::StrAppend(&all, all.empty() ? "" : "; ", f);
  return absl::DataLossError(absl::StrCat("no usable checkpoint in '", dir, "': ", all));
}

absl::StatusOr<std::vector<std::string>> RemoveCheckpointDebris(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  auto is_debris = [](const std::string& name, const std::string& base) {
    return absl::StartsWith(name, base + ".tmp-") || absl::StartsWith(name, base + ".old-");
  };
  auto remove = [&](const fs::path& p) -> absl::Status {
    fs::remove_all(p, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("cannot remove '", p.string(),
                                              "' (left by an interrupted save): ", ec.message()));
    }
    removed.push_back(p.string());
    return absl::OkStatus();
  };
  // Beside DIR: an interrupted WriteCheckpoint(DIR).
  const fs::path parent = root.has_parent_path() ? root.parent_path() : fs::path(".");
  const std::string base = root.filename().string();
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    if (is_debris(e.path().filename().string(), base)) PW_RETURN_IF_ERROR(remove(e.path()));
  }
  // Inside DIR: interrupted step checkpoints and pointer updates.
  if (fs::is_directory(root, ec)) {
    for (const auto& e : fs::directory_iterator(root, ec)) {
      const std::string name = e.path().filename().string();
      const size_t dot = name.find('.');
      const bool step_debris = dot != std::string::npos && StepOf(name.substr(0, dot)) >= 0 &&
                               is_debris(name, name.substr(0, dot));
      if (step_debris || absl::StartsWith(name, absl::StrCat(kLatest, ".tmp-"))) {
        PW_RETURN_IF_ERROR(remove(e.path()));
      }
    }
  }
  return removed;
}

absl::Status SaveCheckpointStep(const std::string& dir, int64_t step, int keep,
                                const std::function<absl::Status(const std::string&)>& write,
                                bool is_root) {
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  if (fs::exists(root / "manifest.json", ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", dir,
                     "' is a single checkpoint (it has a manifest.json), not a directory of step "
                     "checkpoints: save into a new directory"));
  }
  fs::create_directories(root, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create directory '", root.string(), "': ", ec.message()));
  }
  const std::string name = StepCheckpointName(step);
  PW_RETURN_IF_ERROR(write((root / name).string()));
  if (!is_root) return absl::OkStatus();
  // The pointer: written beside, fsync'ed, renamed over (atomic), the directory fsync'ed.
  const std::string latest = (root / kLatest).string();
  const std::string tmp = absl::StrCat(latest, ".tmp-", static_cast<long>(::getpid()));
  const std::string line = name + "\n";
  PW_RETURN_IF_ERROR(WriteFileSynced(tmp, {{line.data(), line.size()}}));
  if (::rename(tmp.c_str(), latest.c_str()) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot rename the latest pointer into place", latest);
    fs::remove(tmp, ec);
    return s;
  }
  PW_RETURN_IF_ERROR(FsyncDir(root.string()));
  if (keep <= 0) return absl::OkStatus();
  // Only after the pointer names the new one: the newest `keep` stay, and never the one named.
  int kept = 0;
  for (const auto& [s, path] : StepCheckpoints(root)) {
    if (path.filename() == name || kept < keep) {
      ++kept;
      continue;
    }
    fs::remove_all(path, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("checkpoint written, but cannot remove the old '",
                                              path.string(), "': ", ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace pipewright
