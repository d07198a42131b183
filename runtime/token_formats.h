// The ecosystem's token files behind OpenDataset (internal; runtime/token_formats.cc).
#ifndef PIPEWRIGHT_RUNTIME_TOKEN_FORMATS_H_
#define PIPEWRIGHT_RUNTIME_TOKEN_FORMATS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "pipewright/data.h"

namespace pipewright::internal {

// `spec` as one of the ecosystem's formats (OpenDataset's list in pipewright/data.h): sets
// *matched and returns the dataset or the error naming what is wrong; *matched false (and any
// status) when `spec` is none of them, for OpenDataset to try its own formats.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenEcosystemFormat(const std::string& spec,
                                                                  int64_t seq_len, uint64_t seed,
                                                                  bool* matched);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_TOKEN_FORMATS_H_
