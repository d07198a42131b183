// SHA-256 (FIPS 180-4) for model fingerprints. Internal.
#ifndef PIPEWRIGHT_RUNTIME_SHA256_H_
#define PIPEWRIGHT_RUNTIME_SHA256_H_

#include <string>

#include "absl/strings/string_view.h"

namespace pipewright {
// Lower-case hex digest of `data`.
std::string Sha256Hex(absl::string_view data);
}  // namespace pipewright

#endif  // PIPEWRIGHT_RUNTIME_SHA256_H_
