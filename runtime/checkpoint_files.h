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
#include "pipewright/input.h"

namespace pipewright::internal {

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
// A small text file of the checkpoint format (manifest, digest line, pointer): a regular file of
// at most `max_bytes` (pipewright/input.h), `what` naming its role in errors.
absl::StatusOr<std::string> ReadTextFile(const std::string& path, absl::string_view what,
                                         int64_t max_bytes);
// The limits of those files.
inline constexpr int64_t kMaxDigestLineBytes = 4096;
inline constexpr int64_t kMaxPointerBytes = 4096;

// Note [Crash points]. A test hook: when the environment variable PIPEWRIGHT_CRASH_AT is `name`
// (or `name:N`, the N-th time this process reaches it, from 1), the process kills itself with
// SIGKILL there. The checkpoint code names a point between every two steps that change the
// disk (docs/checkpoint.md lists them), so tests can stop a save exactly between two renames.
void CrashPoint(const char* name);

// A file written by WriteCheckpoint, as its manifest records it.
struct FileDigest {
  uint64_t bytes = 0;
  std::string sha256;
};

// The SHA-256 and size of the regular file at `path`, read in 1 MiB pieces. A file whose size is
// not `expected_bytes` (when >= 0) is DataLoss before a byte is read.
absl::StatusOr<FileDigest> DigestFile(const std::string& path, int64_t expected_bytes = -1);
// WriteSafetensors, returning the digest of the bytes written when `digest` is not null.
absl::Status WriteSafetensorsFile(const std::string& path, const NamedTensors& tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  FileDigest* digest);

// One checkpoint directory (manifest.json and its tensor files), its files verified against the
// manifest's digests first (Note [Checkpoint digests] in checkpoint.cc).
absl::StatusOr<Checkpoint> ReadOneCheckpoint(const std::filesystem::path& root,
                                             Allocator* allocator);
// Whether `root` is a complete checkpoint: its manifest (and, when it has them, every digest)
// verifies. The manifest's text on success. Reads every file once; loads no tensor.
absl::StatusOr<std::string> VerifyCheckpointFiles(const std::filesystem::path& root);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_CHECKPOINT_FILES_H_
