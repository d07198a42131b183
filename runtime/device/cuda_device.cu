// The CUDA device layer (include/pipewright/device.h, tensor.h): streams, events, device info,
// the stream-ordered pool allocator and the pinned host allocator, copies and memsets. Host code
// only (no kernels); it links cudart, never libcuda, so without a driver every entry point
// returns a Status instead of failing to start.
//
// Every call that names a device or a stream first makes that device current on the calling
// thread and restores the previous one afterwards (DeviceGuard), so the layer works from any
// thread whatever its current device is. A failed runtime call is also cleared from cudart's
// per-thread "last error", so that a later kernel launch check does not report it again.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.cuh"
#include "pipewright/device.h"
#include "pipewright/status.h"
#include "pipewright/tensor.h"

namespace pipewright {
namespace {

using cuda::DeviceGuard;

// "cpu:0", "cuda:1" (Device::ToString lives in the runtime library, which links this one).
std::string Name(Device d) { return absl::StrCat(d.is_cpu() ? "cpu" : "cuda", ":", d.index); }

// The failed call's error, with the last-error slot cleared when it holds this error.
absl::Status DeviceError(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  if (cudaPeekAtLastError() == err) (void)cudaGetLastError();
  return cuda::ToStatus(err, expr, file, line);
}

#define PW_DEV_RETURN_IF_ERROR(expr) \
  PW_RETURN_IF_ERROR(DeviceError((expr), #expr, __FILE__, __LINE__))

// Prefixes a failure with what was being done.
absl::Status Annotate(absl::Status status, const std::string& what) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

// OK when `device` is a visible CUDA device; otherwise says why not.
absl::Status CheckCudaDevice(int device, absl::string_view what) {
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": CUDA device ", device,
                     " is not available: no CUDA GPU is visible (no driver, no device, or "
                     "CUDA_VISIBLE_DEVICES hides them)"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": CUDA device ", device, " does not exist (", count, " visible)"));
  }
  return absl::OkStatus();
}

cudaStream_t Native(Stream s) { return static_cast<cudaStream_t>(s.handle); }
cudaEvent_t Native(void* e) { return static_cast<cudaEvent_t>(e); }

std::string Bytes(int64_t n) { return absl::StrCat(n, " bytes"); }

// cudaMallocFromPoolAsync / cudaFreeAsync on one stream of one device.
class CudaAllocator final : public Allocator {
 public:
  CudaAllocator(int device, Stream stream, cudaMemPool_t pool)
      : device_(device), stream_(stream), pool_(pool) {}

  Device device() const override { return Device::Cuda(device_); }
  Stream stream() const override { return stream_; }

  void* Allocate(size_t bytes) override {
    absl::StatusOr<void*> p = TryAllocate(bytes);
    if (!p.ok()) {
      std::fprintf(stderr, "pipewright: %s\n", std::string(p.status().message()).c_str());
      std::abort();
    }
    return *p;
  }

  absl::StatusOr<void*> TryAllocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    DeviceGuard guard(device_);
    void* p = nullptr;
    absl::Status s = DeviceError(cudaMallocFromPoolAsync(&p, bytes, pool_, Native(stream_)),
                                 "cudaMallocFromPoolAsync", __FILE__, __LINE__);
    if (!s.ok()) {
      return absl::Status(
          s.code(),
          absl::StrCat("CUDA allocator on cuda:", device_, ": allocating ",
                       Bytes(static_cast<int64_t>(bytes)), " failed (", Bytes(current_bytes()),
                       " in use, peak ", Bytes(peak_bytes()), "): ", s.message()));
    }
    RecordAlloc(bytes);
    return p;
  }

  void Free(void* ptr, size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    DeviceGuard guard(device_);
    // Ignored on failure: after a driver failure, or at process exit, the memory goes with the
    // context.
    if (cudaFreeAsync(ptr, Native(stream_)) != cudaSuccess) (void)cudaGetLastError();
    RecordFree(bytes);
  }

 private:
  const int device_;
  const Stream stream_;
  const cudaMemPool_t pool_;
};

class PinnedHostAllocator final : public Allocator {
 public:
  Device device() const override { return Device::Cpu(); }

  void* Allocate(size_t bytes) override {
    absl::StatusOr<void*> p = TryAllocate(bytes);
    if (!p.ok()) {
      std::fprintf(stderr, "pipewright: %s\n", std::string(p.status().message()).c_str());
      std::abort();
    }
    return *p;
  }

  absl::StatusOr<void*> TryAllocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    absl::Status s = DeviceError(cudaMallocHost(&p, bytes), "cudaMallocHost", __FILE__, __LINE__);
    if (!s.ok()) {
      return absl::Status(
          s.code(),
          absl::StrCat("pinned host allocator: allocating ", Bytes(static_cast<int64_t>(bytes)),
                       " failed (", Bytes(current_bytes()), " in use): ", s.message()));
    }
    RecordAlloc(bytes);
    return p;
  }

  void Free(void* ptr, size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    if (cudaFreeHost(ptr) != cudaSuccess) (void)cudaGetLastError();
    RecordFree(bytes);
  }
};

}  // namespace

// ---- CudaStream ----

absl::StatusOr<CudaStream> CudaStream::Create(Device device) {
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaStream::Create: ", Name(device), " is not a CUDA device"));
  }
  PW_RETURN_IF_ERROR(CheckCudaDevice(device.index, "CudaStream::Create"));
  DeviceGuard guard(device.index);
  cudaStream_t s = nullptr;
  PW_DEV_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CudaStream out;
  out.stream_ = Stream{device, s};
  return out;
}

CudaStream::~CudaStream() {
  if (stream_.handle == nullptr) return;
  // Queued work still completes; the stream's resources go when it has.
  if (cudaStreamDestroy(Native(stream_)) != cudaSuccess) (void)cudaGetLastError();
}

CudaStream::CudaStream(CudaStream&& other) noexcept : stream_(other.stream_) {
  other.stream_ = Stream{};
}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    CudaStream old(std::move(*this));  // destroys our stream
    stream_ = other.stream_;
    other.stream_ = Stream{};
  }
  return *this;
}

absl::Status CudaStream::Synchronize() const { return SynchronizeStream(stream_); }

// ---- CudaEvent ----

absl::StatusOr<CudaEvent> CudaEvent::Create(Device device, bool timing) {
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaEvent::Create: ", Name(device), " is not a CUDA device"));
  }
  PW_RETURN_IF_ERROR(CheckCudaDevice(device.index, "CudaEvent::Create"));
  DeviceGuard guard(device.index);
  cudaEvent_t e = nullptr;
  PW_DEV_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  CudaEvent out;
  out.device_ = device;
  out.handle_ = e;
  return out;
}

CudaEvent::~CudaEvent() {
  if (handle_ == nullptr) return;
  // A recorded event that is not done yet is released once the device reaches it.
  if (cudaEventDestroy(Native(handle_)) != cudaSuccess) (void)cudaGetLastError();
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : device_(other.device_), handle_(other.handle_) {
  other.handle_ = nullptr;
}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    CudaEvent old(std::move(*this));
    device_ = other.device_;
    handle_ = other.handle_;
    other.handle_ = nullptr;
  }
  return *this;
}

absl::Status CudaEvent::Record(Stream stream) {
  if (handle_ == nullptr) return absl::FailedPreconditionError("CudaEvent::Record: empty event");
  if (!stream.device.is_cuda()) {
    return absl::InvalidArgumentError("CudaEvent::Record: cannot record on a CPU stream");
  }
  if (stream.device != device_) {
    return absl::InvalidArgumentError(absl::StrCat("CudaEvent::Record: event of ", Name(device_),
                                                   " on a stream of ", Name(stream.device)));
  }
  DeviceGuard guard(device_.index);
  PW_DEV_RETURN_IF_ERROR(cudaEventRecord(Native(handle_), Native(stream)));
  return absl::OkStatus();
}

absl::Status CudaEvent::MakeStreamWait(Stream stream) const {
  if (handle_ == nullptr) {
    return absl::FailedPreconditionError("CudaEvent::MakeStreamWait: empty event");
  }
  if (stream.is_cpu()) return Synchronize();
  DeviceGuard guard(stream.device.index);
  PW_DEV_RETURN_IF_ERROR(cudaStreamWaitEvent(Native(stream), Native(handle_), 0));
  return absl::OkStatus();
}

absl::Status CudaEvent::Synchronize() const {
  if (handle_ == nullptr)
    return absl::FailedPreconditionError("CudaEvent::Synchronize: empty event");
  PW_DEV_RETURN_IF_ERROR(cudaEventSynchronize(Native(handle_)));
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaEvent::Query() const {
  if (handle_ == nullptr) return absl::FailedPreconditionError("CudaEvent::Query: empty event");
  const cudaError_t err = cudaEventQuery(Native(handle_));
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    return false;
  }
  return DeviceError(err, "cudaEventQuery", __FILE__, __LINE__);
}

absl::StatusOr<double> CudaEvent::ElapsedSeconds(const CudaEvent& start) const {
  if (handle_ == nullptr || start.handle_ == nullptr) {
    return absl::FailedPreconditionError("CudaEvent::ElapsedSeconds: empty event");
  }
  float ms = 0;
  const cudaError_t err = cudaEventElapsedTime(&ms, Native(start.handle_), Native(handle_));
  if (err == cudaErrorNotReady) {
    if (cudaPeekAtLastError() == err) (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        "CudaEvent::ElapsedSeconds: the events are not both done yet (Synchronize first)");
  }
  PW_DEV_RETURN_IF_ERROR(err);
  return static_cast<double>(ms) * 1e-3;
}

// ---- devices ----

absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(int device) {
  PW_RETURN_IF_ERROR(CheckCudaDevice(device, "GetCudaDeviceInfo"));
  cudaDeviceProp prop;
  std::memset(&prop, 0, sizeof(prop));
  PW_DEV_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  CudaDeviceInfo info;
  info.index = device;
  info.name = prop.name;
  info.compute_capability_major = prop.major;
  info.compute_capability_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  DeviceGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  PW_DEV_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  info.total_memory_bytes = static_cast<int64_t>(total_bytes);
  info.free_memory_bytes = static_cast<int64_t>(free_bytes);
  return info;
}

absl::Status SetCudaDevice(int device) {
  PW_RETURN_IF_ERROR(CheckCudaDevice(device, "SetCudaDevice"));
  PW_DEV_RETURN_IF_ERROR(cudaSetDevice(device));
  return absl::OkStatus();
}

// ---- copies ----

absl::Status CopyBytes(void* dst, Device dst_device, const void* src, Device src_device,
                       size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  const std::string what = absl::StrCat("CopyBytes ", Name(src_device), " -> ", Name(dst_device),
                                        " (", Bytes(bytes), ")");
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": null pointer"));
  }
  if (stream.is_cpu()) {
    DeviceGuard guard(dst_device.is_cuda() ? dst_device.index : src_device.index);
    return Annotate(DeviceError(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy",
                                __FILE__, __LINE__),
                    what);
  }
  DeviceGuard guard(stream.device.index);
  return Annotate(DeviceError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, Native(stream)),
                              "cudaMemcpyAsync", __FILE__, __LINE__),
                  what);
}

absl::Status MemsetBytes(void* dst, Device device, int value, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (device.is_cpu()) {
    std::memset(dst, value, bytes);
    return absl::OkStatus();
  }
  const std::string what = absl::StrCat("MemsetBytes on ", Name(device), " (", Bytes(bytes), ")");
  if (stream.is_cpu()) {
    DeviceGuard guard(device.index);
    return Annotate(DeviceError(cudaMemset(dst, value, bytes), "cudaMemset", __FILE__, __LINE__),
                    what);
  }
  DeviceGuard guard(stream.device.index);
  return Annotate(DeviceError(cudaMemsetAsync(dst, value, bytes, Native(stream)), "cudaMemsetAsync",
                              __FILE__, __LINE__),
                  what);
}

absl::Status SynchronizeStream(Stream stream) {
  if (stream.is_cpu()) return absl::OkStatus();
  DeviceGuard guard(stream.device.index);
  return Annotate(DeviceError(cudaStreamSynchronize(Native(stream)), "cudaStreamSynchronize",
                              __FILE__, __LINE__),
                  absl::StrCat("SynchronizeStream on ", Name(stream.device)));
}

// ---- allocators ----

absl::StatusOr<std::unique_ptr<Allocator>> CreateCudaAllocator(int device, Stream stream) {
  PW_RETURN_IF_ERROR(CheckCudaDevice(device, "CreateCudaAllocator"));
  if (stream.is_cpu()) {
    stream = Stream{Device::Cuda(device), nullptr};  // the legacy default stream
  } else if (stream.device != Device::Cuda(device)) {
    return absl::InvalidArgumentError(absl::StrCat("CreateCudaAllocator(cuda:", device,
                                                   "): the stream is on ", Name(stream.device)));
  }
  DeviceGuard guard(device);
  int pools = 0;
  PW_DEV_RETURN_IF_ERROR(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
  if (!pools) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CreateCudaAllocator: cuda:", device, " does not support stream-ordered memory pools"));
  }
  cudaMemPool_t pool = nullptr;
  PW_DEV_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device));
  // Keep freed memory in the pool (the default threshold, 0, returns it to the driver at every
  // synchronisation, which makes a training step re-map its activations each time).
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  PW_DEV_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  return std::unique_ptr<Allocator>(new CudaAllocator(device, stream, pool));
}

absl::StatusOr<std::unique_ptr<Allocator>> CreatePinnedHostAllocator() {
  if (CudaDeviceCount() == 0) {
    return absl::FailedPreconditionError(
        "CreatePinnedHostAllocator: page-locked host memory needs a CUDA GPU and driver, and no "
        "CUDA GPU is visible");
  }
  return std::unique_ptr<Allocator>(new PinnedHostAllocator());
}

}  // namespace pipewright
