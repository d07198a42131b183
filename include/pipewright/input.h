// Bounded input: how pipewright opens and reads every file it is handed (plans, layer graphs,
// programs, checkpoints, data, tokenizer and Hugging Face inputs) and checks every JSON text.
//
// - Regular files only. A FIFO, a device (/dev/zero), a socket or a directory where a file is
//   expected is refused before anything blocks on it: the path is stat'ed first and opened with
//   O_NONBLOCK, and the open file is checked again (it may have been swapped in between).
// - Never more bytes than the format allows: a reader says its limit and the file's size is
//   checked before a byte is read (a 1 GiB sparse `latest` pointer is refused at once), and the
//   read itself stops one byte past the limit (a file that grows while being read).
// - JSON no deeper than kMaxJsonDepth, checked by a linear scan before a parser (recursive in
//   places) sees the text.
//
// Errors are InvalidArgument (a usage error: the CLI exits 2) naming what the file was for and
// its path, e.g. "--plan 'p.json' is a FIFO, not a regular file"; NotFound / PermissionDenied
// when it cannot be opened. docs/input-limits.md, "Input limits", lists every reader's limit.
#ifndef PIPEWRIGHT_INPUT_H_
#define PIPEWRIGHT_INPUT_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pipewright {

// The deepest JSON nesting any pipewright format uses is 6 (a plan's stage memory); 64 leaves
// room for user extensions and stays far below what a recursive parser's stack survives.
inline constexpr int kMaxJsonDepth = 64;
// Plans, layer graphs, programs, checkpoint manifests, Hugging Face config.json: 64 MiB holds a
// layer graph of 100,000 layers with room to spare.
inline constexpr int64_t kMaxJsonFileBytes = int64_t{64} << 20;

// An open regular file (closed on destruction).
class RegularFile {
 public:
  // Opens `path` for reading. InvalidArgument when it is not a regular file, naming `what` (the
  // file's role: "--plan", "checkpoint pointer", ...) and the kind of file it is.
  static absl::StatusOr<RegularFile> Open(const std::string& path, absl::string_view what);
  RegularFile(RegularFile&& other) noexcept;
  RegularFile& operator=(RegularFile&& other) noexcept;
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  ~RegularFile();

  int fd() const { return fd_; }
  int64_t size() const { return size_; }  // at open
  const std::string& path() const { return path_; }
  // Gives up ownership of the descriptor (the caller closes it).
  int Release();

 private:
  RegularFile(int fd, int64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  int fd_ = -1;
  int64_t size_ = 0;
  std::string path_;
};

// The whole of the regular file `path`, at most `max_bytes` of it: a larger file is
// InvalidArgument ("<what> '<path>' is N bytes; a <what> is at most M").
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, absl::string_view what,
                                            int64_t max_bytes);

// InvalidArgument when `text` nests arrays and objects deeper than `max_depth` (outside strings),
// naming `what` and the byte offset. Linear in the text; says nothing of JSON validity.
absl::Status CheckJsonNesting(absl::string_view text, absl::string_view what,
                              int max_depth = kMaxJsonDepth);

// A path pipewright is about to write: absent, a regular file, or a character device such as
// /dev/null. A FIFO (opening one for writing blocks until a reader comes), a socket, a block
// device or a directory is InvalidArgument naming `what`.
absl::Status CheckOutputPath(const std::string& path, absl::string_view what);

// "<what> '<path>': <strerror(err)>" with the code `err` implies: NotFound (ENOENT, ENOTDIR),
// PermissionDenied (EACCES, EPERM, EROFS), ResourceExhausted (a full disk or quota),
// InvalidArgument (a path that cannot name a file: ELOOP, ENAMETOOLONG, EISDIR, ENXIO), else
// Internal.
absl::Status ErrnoStatus(int err, absl::string_view what, const std::string& path);

// "a FIFO", "a directory", "a character device", ... for a stat(2) mode.
const char* FileKindName(unsigned mode);

}  // namespace pipewright

#endif  // PIPEWRIGHT_INPUT_H_
