// Bounded input (pipewright/input.h).
#include "pipewright/input.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

absl::Status NotRegular(absl::string_view what, const std::string& path, unsigned mode) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, " '", path, "' is ", FileKindName(mode), ", not a regular file"));
}

}  // namespace

absl::Status ErrnoStatus(int err, absl::string_view what, const std::string& path) {
  std::string msg = absl::StrCat(what, " '", path, "': ", std::strerror(err));
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
    case ELOOP:
    case ENAMETOOLONG:
    case EISDIR:
    case ENXIO:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

const char* FileKindName(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO";
    case S_IFSOCK:
      return "a socket";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFLNK:
      return "a symbolic link";
    default:
      return "a special file";
  }
}

absl::StatusOr<RegularFile> RegularFile::Open(const std::string& path, absl::string_view what) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    return ErrnoStatus(errno, absl::StrCat("cannot open ", what), path);
  if (!S_ISREG(st.st_mode)) return NotRegular(what, path, st.st_mode);
  // O_NONBLOCK: should a FIFO have taken the file's place since the stat, open returns at once
  // instead of waiting for a writer; the fstat below then refuses it.
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("cannot open ", what), path);
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const unsigned mode = st.st_mode;
    ::close(fd);
    return NotRegular(what, path, mode);
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return RegularFile(fd, static_cast<int64_t>(st.st_size), path);
}

RegularFile::RegularFile(RegularFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_), path_(std::move(other.path_)) {}

RegularFile& RegularFile::operator=(RegularFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    path_ = std::move(other.path_);
  }
  return *this;
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

int RegularFile::Release() { return std::exchange(fd_, -1); }

absl::StatusOr<std::string> ReadRegularFile(const std::string& path, absl::string_view what,
                                            int64_t max_bytes) {
  PW_ASSIGN_OR_RETURN(RegularFile f, RegularFile::Open(path, what));
  auto too_big = [&](int64_t bytes, bool at_least) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' is ",
                                                   at_least ? "more than " : "", bytes,
                                                   " bytes; a ", what, " is at most ", max_bytes));
  };
  if (f.size() > max_bytes) return too_big(f.size(), false);
  std::string out;
  out.resize(static_cast<size_t>(f.size()));
  size_t have = 0;
  // The size is a hint (the file may grow or shrink while read; /proc reports 0): read to the
  // end, but never past one byte beyond the limit.
  while (true) {
    if (have == out.size()) {
      if (static_cast<int64_t>(out.size()) > max_bytes) return too_big(max_bytes, true);
      out.resize(std::min<size_t>(std::max<size_t>(out.size() * 2, 4096),
                                  static_cast<size_t>(max_bytes) + 1));
    }
    const ssize_t n = ::read(f.fd(), out.data() + have, out.size() - have);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("cannot read ", what), path);
    }
    if (n == 0) break;
    have += static_cast<size_t>(n);
  }
  out.resize(have);
  return out;
}

absl::Status CheckJsonNesting(absl::string_view text, absl::string_view what, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": JSON nested deeper than ",
                                                         max_depth, " levels (at byte ", i, ")"));
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOutputPath(const std::string& path, absl::string_view what) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::OkStatus();  // absent: created by the writer
  if (S_ISREG(st.st_mode) || S_ISCHR(st.st_mode)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("cannot write ", what, " '", path, "': it is ", FileKindName(st.st_mode)));
}

}  // namespace pipewright
