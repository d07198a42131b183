// SHA-256 (FIPS 180-4) for model fingerprints and checkpoint file checksums. Internal.
#ifndef PIPEWRIGHT_RUNTIME_SHA256_H_
#define PIPEWRIGHT_RUNTIME_SHA256_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace pipewright {

// Incremental: Update with the data in any pieces, then HexDigest once.
class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t n);
  std::string HexDigest();  // lower-case hex; the object is spent afterwards

 private:
  void Block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buffer_[64] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

// Lower-case hex digest of `data`.
std::string Sha256Hex(absl::string_view data);
}  // namespace pipewright

#endif  // PIPEWRIGHT_RUNTIME_SHA256_H_
