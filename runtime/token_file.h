// Writing token files (docs/data.md, "Token files"), shared by the byte-level `data prepare`
// (runtime/data.cc) and the SentencePiece one (runtime/tokenizer.cc). Internal.
#ifndef PIPEWRIGHT_RUNTIME_TOKEN_FILE_H_
#define PIPEWRIGHT_RUNTIME_TOKEN_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/data.h"
#include "pipewright/input.h"

namespace pipewright::internal {

// Writes up to `capacity` tokens into `buffer` and returns how many it wrote: 0 at the end.
using TokenFill = absl::FunctionRef<absl::StatusOr<size_t>(uint32_t* buffer, size_t capacity)>;

// Writes the header of `info` (its dtype and vocab_size) and then the tokens `fill` produces,
// block by block, into `path` + ".tmp", rewrites the header's token count and renames the file
// to `path`: the file appears only when complete, and a failure (fill's error included) removes
// it. *written is the token count.
absl::Status WriteTokenStream(const std::string& path, TokenFileInfo info, TokenFill fill,
                              int64_t* written);

// The text input of `data prepare`, open: a regular file (RegularFile::Open, `input_what` naming
// it in errors) that is not the file at `output`, and `output` a path a token file may replace
// (CheckOutputPath, `output_what`).
absl::StatusOr<RegularFile> OpenPrepareInput(const std::string& input, absl::string_view input_what,
                                             const std::string& output,
                                             absl::string_view output_what);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_TOKEN_FILE_H_
