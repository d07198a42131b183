// Whole-file reads and writes for the subcommands, with errors that name the file. Every file a
// subcommand is handed goes through here, and so through pipewright/input.h: regular files
// only, opened without blocking, never more bytes than the format allows.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "pipewright/input.h"
#include "pipewright/status.h"
#include "tools/commands.h"

namespace pipewright::tools {
namespace {

// Writes all of `text` to `fd`; false (errno set) on failure.
bool WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

absl::Status CannotWrite(absl::string_view what, const std::string& path, int err) {
  std::string msg = absl::StrCat("cannot write ", what, " '", path, "': ", std::strerror(err));
  if (err == ENOSPC || err == EIO || err == EDQUOT) return absl::DataLossError(msg);
  return absl::NotFoundError(msg);
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what,
                                     int64_t max_bytes) {
  return ReadRegularFile(path, what, max_bytes);
}

absl::StatusOr<std::string> ReadJsonFile(const std::string& path, absl::string_view what) {
  PW_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, what, kMaxJsonFileBytes));
  PW_RETURN_IF_ERROR(CheckJsonNesting(text, absl::StrCat(what, " '", path, "'")));
  return text;
}

absl::Status WriteFile(const std::string& path, const std::string& text, absl::string_view what) {
  // A FIFO, socket, block device or directory is refused before anything opens it.
  PW_RETURN_IF_ERROR(CheckOutputPath(path, what));
  struct stat st;
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (exists && !S_ISREG(st.st_mode)) {
    // A character device (/dev/null, a terminal): written in place; O_NONBLOCK so that the open
    // itself never waits, should something else have taken the path's place since the check.
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return CannotWrite(what, path, errno);
    struct stat now {};
    if (::fstat(fd, &now) != 0 || !S_ISCHR(now.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write ", what, " '", path, "': it is ", FileKindName(now.st_mode)));
    }
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    const bool ok = WriteAll(fd, text);
    const int err = errno;
    ::close(fd);
    if (!ok) return CannotWrite(what, path, err);
    return absl::OkStatus();
  }
  // A regular file, or a new one: written to a temporary file beside it and renamed over it, so
  // that a failed write (a full disk, an interrupted run) never leaves a truncated file where a
  // good one was. Through a symbolic link, the file it names is replaced (the link stays).
  std::string target = path;
  if (exists) {
    if (char* real = ::realpath(path.c_str(), nullptr)) {
      target = real;
      std::free(real);
    }
  }
  static std::atomic<int> counter{0};
  const std::string tmp = absl::StrCat(target, ".tmp-", ::getpid(), "-",
                                       counter.fetch_add(1, std::memory_order_relaxed));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOCTTY | O_CLOEXEC, 0666);
  if (fd < 0) return CannotWrite(what, path, errno);
  if (exists) (void)::fchmod(fd, st.st_mode & 07777);  // the replaced file's permissions
  bool ok = WriteAll(fd, text);
  int err = errno;
  if (::close(fd) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (ok && ::rename(tmp.c_str(), target.c_str()) != 0) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    return CannotWrite(what, path, err);
  }
  return absl::OkStatus();
}

}  // namespace pipewright::tools
