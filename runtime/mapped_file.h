// A data file mapped read-only, and where a sample's window starts (internal; pipewright/data.h):
// what the text, token-file and ecosystem-format datasets share (runtime/data.cc,
// runtime/token_formats.cc).
#ifndef PIPEWRIGHT_RUNTIME_MAPPED_FILE_H_
#define PIPEWRIGHT_RUNTIME_MAPPED_FILE_H_

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "pipewright/input.h"
#include "pipewright/status.h"
#include "runtime/random.h"

namespace pipewright::internal {

// A whole file mapped read-only (MAP_PRIVATE, PROT_READ). Note [Memory-mapped data]: the
// datasets keep the mapping and read samples straight from it, so a corpus costs address space,
// not memory: the kernel pages in what the samples touch and may drop those pages again, and
// the ranks of a process (and the processes of a node) share one copy in the page cache.
// Pages a sample touched stay mapped, though, and count in the process's RSS (as file-backed
// RSS): a fault maps the whole page-cache folio around the address, up to 2 MiB on file
// systems with large folios, so on a 1 GiB file RSS grew by ~370 MiB over 20 steps of
// gpt-tiny. Every kSamplesPerRelease samples the dataset therefore unmaps what it touched
// (MADV_DONTNEED on the whole mapping). That is safe while other threads read: the mapping is
// private, read-only and never written, so a later access refaults the same page-cache page.
// Peak RSS then does not grow with the file (docs/benchmarks.md, "Data loading").
inline constexpr int64_t kSamplesPerRelease = 16;
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    // A FIFO, a device or a directory is refused without blocking (pipewright/input.h).
    PW_ASSIGN_OR_RETURN(RegularFile file, RegularFile::Open(path, "data file"));
    const int fd = file.Release();
    auto m = std::unique_ptr<MappedFile>(new MappedFile());
    m->size_ = static_cast<size_t>(file.size());
    if (m->size_ > 0) {
      void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        return absl::InternalError(
            absl::StrCat("cannot map data file '", path, "': ", std::strerror(errno)));
      }
      m->data_ = static_cast<const unsigned char*>(p);
      // Samples are windows at random positions: read-ahead would page in what no sample uses.
      ::madvise(p, m->size_, MADV_RANDOM);
    }
    ::close(fd);  // the mapping keeps the file
    return m;
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  // Called after each sample read from the mapping (Note [Memory-mapped data]).
  void SampleRead() {
    if (reads_.fetch_add(1, std::memory_order_relaxed) % kSamplesPerRelease ==
            kSamplesPerRelease - 1 &&
        data_ != nullptr) {
      ::madvise(const_cast<unsigned char*>(data_), size_, MADV_DONTNEED);
    }
  }

 private:
  MappedFile() = default;
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
  std::atomic<int64_t> reads_{0};
};

// The window start of sample `index` among `positions` (> 0) possible starts. Text files and
// token files draw it alike, so a text file and its byte-level token file give the same samples.
inline uint64_t WindowStart(uint64_t seed, int64_t index, uint64_t positions) {
  return HashCombine(seed ^ 0x7465787400ull, static_cast<uint64_t>(index)) % positions;
}

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_MAPPED_FILE_H_
