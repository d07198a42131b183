// Device: a small value type naming where memory lives and where kernels run.
#ifndef PIPEWRIGHT_DEVICE_H_
#define PIPEWRIGHT_DEVICE_H_

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pipewright {

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static constexpr Device Cpu(int index = 0) noexcept { return {DeviceKind::kCpu, index}; }
  static constexpr Device Cuda(int index) noexcept { return {DeviceKind::kCuda, index}; }
  constexpr bool is_cpu() const noexcept { return kind == DeviceKind::kCpu; }
  constexpr bool is_cuda() const noexcept { return kind == DeviceKind::kCuda; }
  friend constexpr bool operator==(const Device&, const Device&) = default;

  // "cpu", "cpu:1", "cuda:0"
  std::string ToString() const;
  // Parses "cpu", "cpu:N", "cuda", "cuda:N".
  static absl::StatusOr<Device> Parse(absl::string_view text);
};

// Number of usable CUDA devices; 0 when built without CUDA or when no driver/GPU is present.
int CudaDeviceCount();

}  // namespace pipewright

template <>
struct std::hash<pipewright::Device> {
  size_t operator()(const pipewright::Device& d) const noexcept {
    return (static_cast<size_t>(d.kind) << 16) ^ static_cast<size_t>(d.index);
  }
};

#endif  // PIPEWRIGHT_DEVICE_H_
