// Which training precision a run uses (fp32, bf16 or fp16), its name and its parser: the part of
// pipewright/precision.h that the partitioner's memory model needs, with no tensor or device
// type, so it sits in the partitioner's layer (docs/architecture.md, "Layers").
// pipewright/precision.h includes it and says what each precision computes in.
#ifndef PIPEWRIGHT_PRECISION_KIND_H_
#define PIPEWRIGHT_PRECISION_KIND_H_

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pipewright {

enum class Precision { kFp32, kBf16, kFp16 };

inline absl::StatusOr<Precision> ParsePrecision(absl::string_view name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "bf16") return Precision::kBf16;
  if (name == "fp16") return Precision::kFp16;
  return absl::InvalidArgumentError(
      absl::StrCat("precision must be fp32, bf16 or fp16, not '", name, "'"));
}

inline const char* PrecisionName(Precision p) {
  switch (p) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "?";
}

}  // namespace pipewright

#endif  // PIPEWRIGHT_PRECISION_KIND_H_
