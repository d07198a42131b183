// The file handling the checkpoint code shares (checkpoint_files.h).
#include "runtime/checkpoint_files.h"

#include <fcntl.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "pipewright/input.h"
#include "runtime/sha256.h"

namespace pipewright::internal {
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

// Strips a trailing separator so "a/b/" names the directory "a/b".
std::filesystem::path NormalizeDir(const std::string& dir) {
  std::filesystem::path p(dir);
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p;
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path, absl::string_view what,
                                         int64_t max_bytes) {
  return ReadRegularFile(path, what, max_bytes);
}

void CrashPoint(const char* name) {
  const char* at = std::getenv("PIPEWRIGHT_CRASH_AT");
  if (at == nullptr) return;
  const absl::string_view spec(at);
  const size_t colon = spec.rfind(':');
  int64_t nth = 1;
  absl::string_view point = spec;
  if (colon != absl::string_view::npos && absl::SimpleAtoi(spec.substr(colon + 1), &nth)) {
    point = spec.substr(0, colon);
  }
  if (point != name) return;
  static std::atomic<int64_t> reached{0};
  if (reached.fetch_add(1) + 1 == nth) ::raise(SIGKILL);
}

absl::StatusOr<FileDigest> DigestFile(const std::string& path, int64_t expected_bytes) {
  PW_ASSIGN_OR_RETURN(RegularFile file, RegularFile::Open(path, "checkpoint file"));
  if (expected_bytes >= 0 && file.size() != expected_bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", file.size(), " bytes, the manifest records ", expected_bytes));
  }
  Fd fd(file.Release());
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
    // A file that grows while hashed is not the file the manifest describes.
    if (expected_bytes >= 0 && d.bytes > static_cast<uint64_t>(expected_bytes)) break;
  }
  d.sha256 = h.HexDigest();
  return d;
}

}  // namespace pipewright::internal
