// Device: a small value type naming where memory lives and where kernels run.
#ifndef PIPEWRIGHT_DEVICE_H_
#define PIPEWRIGHT_DEVICE_H_

#include <cstddef>
#include <cstdint>
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

// ---- The CUDA device layer (docs/cuda.md) ----
//
// Every function below returns a Status: FailedPrecondition "pipewright was built without CUDA"
// in a build without CUDA, FailedPrecondition naming the device when no GPU is visible, and the
// CUDA error (expression, file:line, cudaGetErrorName/String) when a CUDA call fails. Host-only
// work (a CPU stream, host-to-host copies) works in every build.

// Where asynchronous work is ordered. Non-owning: CudaStream owns CUDA streams. A CPU stream
// (`Stream{}`) has a null handle and its work is synchronous on the calling thread. A CUDA
// stream with a null handle is the legacy default stream of `device`.
struct Stream {
  Device device;
  void* handle = nullptr;  // cudaStream_t for CUDA

  bool is_cpu() const { return device.is_cpu(); }
  friend bool operator==(const Stream&, const Stream&) = default;
};

// Owns a CUDA stream created with cudaStreamNonBlocking (it never synchronises implicitly with
// the legacy default stream). Move-only; the destructor destroys the stream (work already queued
// on it still completes) and ignores errors, e.g. after a driver failure or at process exit.
class CudaStream {
 public:
  CudaStream() = default;  // empty: get() is a CPU stream
  // `device` must be a CUDA device.
  static absl::StatusOr<CudaStream> Create(Device device);
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Stream get() const { return stream_; }
  Device device() const { return stream_.device; }
  bool valid() const { return stream_.handle != nullptr; }
  // Blocks until all work queued on the stream is done.
  absl::Status Synchronize() const;

 private:
  Stream stream_;
};

// Owns a CUDA event of one device. Move-only; the destructor ignores errors.
class CudaEvent {
 public:
  CudaEvent() = default;  // empty
  // `timing` = false creates a lighter event (cudaEventDisableTiming) for ordering only;
  // ElapsedSeconds then fails.
  static absl::StatusOr<CudaEvent> Create(Device device, bool timing = true);
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  // Captures the work queued so far on `stream` (a stream of the event's device).
  absl::Status Record(Stream stream);
  // Work queued on `stream` after this call waits until the recorded work is done (the host
  // does not block). `stream` may be on another device. A CPU stream blocks the host instead.
  absl::Status MakeStreamWait(Stream stream) const;
  // Blocks the host until the recorded work is done (OK at once if never recorded).
  absl::Status Synchronize() const;
  // True once the recorded work is done (or the event was never recorded).
  absl::StatusOr<bool> Query() const;
  // Seconds from `start` to this event; both recorded and done, both created with timing.
  absl::StatusOr<double> ElapsedSeconds(const CudaEvent& start) const;

  Device device() const { return device_; }
  void* handle() const { return handle_; }  // cudaEvent_t
  bool valid() const { return handle_ != nullptr; }

 private:
  Device device_;
  void* handle_ = nullptr;
};

struct CudaDeviceInfo {
  int index = 0;
  std::string name;                  // "NVIDIA H200"
  int compute_capability_major = 0;  // 9 for sm_90
  int compute_capability_minor = 0;
  int sm_count = 0;
  int64_t total_memory_bytes = 0;
  int64_t free_memory_bytes = 0;  // at the time of the call
};
absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(int device);

// Makes `device` current on the calling thread (CUDA's current device is per thread).
absl::Status SetCudaDevice(int device);

// Copies `bytes` from `src` (memory of `src_device`) to `dst` (memory of `dst_device`).
//  - host to host: memcpy on the calling thread, whatever `stream` is;
//  - anything touching a GPU: with a CUDA `stream`, queued on it (cudaMemcpyAsync) and
//    asynchronous: the source must stay valid and unchanged, and a host destination must not
//    be read, until the stream has reached the copy (SynchronizeStream); with a CPU stream,
//    synchronous (cudaMemcpy), but not ordered after work on other streams.
// Device to device may cross GPUs (a peer copy).
absl::Status CopyBytes(void* dst, Device dst_device, const void* src, Device src_device,
                       size_t bytes, Stream stream);
// Sets `bytes` bytes at `dst` (memory of `device`) to `value`: memset on the host, queued on a
// CUDA `stream` (cudaMemsetAsync), or synchronous with a CPU stream.
absl::Status MemsetBytes(void* dst, Device device, int value, size_t bytes, Stream stream);
// Blocks until all work queued on `stream` is done; OK at once for a CPU stream.
absl::Status SynchronizeStream(Stream stream);

}  // namespace pipewright

template <>
struct std::hash<pipewright::Device> {
  size_t operator()(const pipewright::Device& d) const noexcept {
    return (static_cast<size_t>(d.kind) << 16) ^ static_cast<size_t>(d.index);
  }
};

#endif  // PIPEWRIGHT_DEVICE_H_
