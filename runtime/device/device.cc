#include "pipewright/device.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pipewright {

std::string Device::ToString() const { return absl::StrCat(is_cpu() ? "cpu" : "cuda", ":", index); }

absl::StatusOr<Device> Device::Parse(absl::string_view text) {
  absl::string_view kind = text;
  int index = 0;
  if (size_t colon = text.find(':'); colon != absl::string_view::npos) {
    kind = text.substr(0, colon);
    if (!absl::SimpleAtoi(text.substr(colon + 1), &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad device index in '", text, "'"));
    }
  }
  if (kind == "cpu") return Device::Cpu(index);
  if (kind == "cuda") return Device::Cuda(index);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", text, "' (expected cpu, cpu:N, cuda or cuda:N)"));
}

}  // namespace pipewright
