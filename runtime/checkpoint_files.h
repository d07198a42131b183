// The file handling the checkpoint code shares (runtime/checkpoint.cc, checkpoint_dir.cc,
// safetensors.cc): errors that name the path, durable writes (fsync of files and directories),
// whole-file reads, SHA-256 digests of files, and the one checkpoint directory read and
// verified. Internal.
#ifndef PIPEWRIGHT_RUNTIME_CHECKPOINT_FILES_H_
#define PIPEWRIGHT_RUNTIME_CHECKPOINT_FILES_H_

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/checkpoint.h"

namespace pipewright::internal {

// "<what> '<path>': <strerror>", with the code errno implies (NotFound, PermissionDenied,
// ResourceExhausted for a full disk, else Internal).
absl::Status ErrnoStatus(int err, absl::string_view what, const std::string& path);

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

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path);
absl::Status PreadAll(int fd, void* data, size_t size, uint64_t offset, const std::string& path);
// Writes `chunks` to `path` (created/truncated) and fsyncs it.
absl::Status WriteFileSynced(const std::string& path,
                             const std::vector<std::pair<const void*, size_t>>& chunks);
absl::Status FsyncDir(const std::string& path);
// Strips a trailing separator so "a/b/" names the directory "a/b".
std::filesystem::path NormalizeDir(const std::string& dir);
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

// A file written by WriteCheckpoint, as its manifest records it.
struct FileDigest {
  uint64_t bytes = 0;
  std::string sha256;
};

// The SHA-256 and size of the file at `path`, read in 1 MiB pieces.
absl::StatusOr<FileDigest> DigestFile(const std::string& path);
// WriteSafetensors, returning the digest of the bytes written when `digest` is not null.
absl::Status WriteSafetensorsFile(const std::string& path, const NamedTensors& tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  FileDigest* digest);

// One checkpoint directory (manifest.json and its tensor files), its files verified against the
// manifest's digests first (Note [Checkpoint digests] in checkpoint.cc).
absl::StatusOr<Checkpoint> ReadOneCheckpoint(const std::filesystem::path& root,
                                             Allocator* allocator);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_CHECKPOINT_FILES_H_
