// Built when PIPEWRIGHT_CUDA=OFF (or AUTO without nvcc): there are no CUDA devices. Every CUDA
// entry point of the device layer returns FailedPrecondition "pipewright was built without
// CUDA"; host-only work (CPU streams, host-to-host copies and memsets) still works.
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "pipewright/device.h"
#include "pipewright/tensor.h"

namespace pipewright {
namespace {

// "cpu:0", "cuda:1" (Device::ToString lives in the runtime library, which links this one).
std::string Name(Device d) { return absl::StrCat(d.is_cpu() ? "cpu" : "cuda", ":", d.index); }

absl::Status NoCuda(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      ": pipewright was built without CUDA (reconfigure with -DPIPEWRIGHT_CUDA=ON where the "
      "CUDA toolkit is installed)"));
}

}  // namespace

int CudaDeviceCount() { return 0; }

absl::StatusOr<CudaStream> CudaStream::Create(Device device) {
  return NoCuda(absl::StrCat("CudaStream::Create(", Name(device), ")"));
}
CudaStream::~CudaStream() = default;
CudaStream::CudaStream(CudaStream&& other) noexcept : stream_(other.stream_) {
  other.stream_ = Stream{};
}
CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  stream_ = other.stream_;
  other.stream_ = Stream{};
  return *this;
}
absl::Status CudaStream::Synchronize() const { return SynchronizeStream(stream_); }

absl::StatusOr<CudaEvent> CudaEvent::Create(Device device, bool) {
  return NoCuda(absl::StrCat("CudaEvent::Create(", Name(device), ")"));
}
CudaEvent::~CudaEvent() = default;
CudaEvent::CudaEvent(CudaEvent&& other) noexcept : device_(other.device_), handle_(other.handle_) {
  other.handle_ = nullptr;
}
CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  device_ = other.device_;
  handle_ = other.handle_;
  other.handle_ = nullptr;
  return *this;
}
absl::Status CudaEvent::Record(Stream) { return NoCuda("CudaEvent::Record"); }
absl::Status CudaEvent::MakeStreamWait(Stream) const { return NoCuda("CudaEvent::MakeStreamWait"); }
absl::Status CudaEvent::Synchronize() const { return NoCuda("CudaEvent::Synchronize"); }
absl::StatusOr<bool> CudaEvent::Query() const { return NoCuda("CudaEvent::Query"); }
absl::StatusOr<double> CudaEvent::ElapsedSeconds(const CudaEvent&) const {
  return NoCuda("CudaEvent::ElapsedSeconds");
}

absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(int device) {
  return NoCuda(absl::StrCat("GetCudaDeviceInfo(cuda:", device, ")"));
}

absl::Status SetCudaDevice(int device) {
  return NoCuda(absl::StrCat("SetCudaDevice(cuda:", device, ")"));
}

absl::Status CopyBytes(void* dst, Device dst_device, const void* src, Device src_device,
                       size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  return NoCuda(absl::StrCat("CopyBytes ", Name(src_device), " -> ", Name(dst_device)));
}

absl::Status MemsetBytes(void* dst, Device device, int value, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (device.is_cpu()) {
    std::memset(dst, value, bytes);
    return absl::OkStatus();
  }
  return NoCuda(absl::StrCat("MemsetBytes on ", Name(device)));
}

absl::Status SynchronizeStream(Stream stream) {
  if (stream.is_cpu()) return absl::OkStatus();
  return NoCuda(absl::StrCat("SynchronizeStream on ", Name(stream.device)));
}

absl::StatusOr<std::unique_ptr<Allocator>> CreateCudaAllocator(int device, Stream) {
  return NoCuda(absl::StrCat("CreateCudaAllocator(cuda:", device, ")"));
}

absl::StatusOr<std::unique_ptr<Allocator>> CreatePinnedHostAllocator() {
  return NoCuda("CreatePinnedHostAllocator");
}

}  // namespace pipewright
