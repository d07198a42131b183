// Tensor: shape, dtype, device and shared storage from an Allocator. Dense and row-major; no
// views with strides (a stage's tensors are always contiguous). Copies share storage; Clone()
// deep-copies. No hidden host/device copies: data<T>() on a CUDA tensor is a device pointer, and
// moving data between host and device is explicit (CopyTo, CopyFrom). Work on a CUDA tensor is
// ordered on the stream of its allocator (stream()).
#ifndef PIPEWRIGHT_TENSOR_H_
#define PIPEWRIGHT_TENSOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/device.h"
#include "pipewright/status.h"

namespace pipewright {

enum class DType { kF32, kBF16, kF16, kI32, kF64 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);  // "f32", "bf16", "f16", "i32", "f64"
// Safetensors spelling: "F32", "BF16", "F16", "I32", "F64".
const char* DTypeSafetensorsName(DType dtype);
absl::StatusOr<DType> ParseDType(absl::string_view name);  // accepts both spellings

// Allocator: raw byte allocation on one device with current/peak accounting. Thread-safe.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // The stream the memory is ordered on: a stream-ordered allocator hands out memory that is
  // ready for work queued on this stream, and frees it in its order. A CPU stream for host
  // allocators.
  virtual Stream stream() const { return {}; }
  // Returns nullptr only for bytes == 0. Memory is 64-byte aligned. Running out of memory is
  // fatal (it prints what failed and aborts); use TryAllocate to get a Status instead.
  virtual void* Allocate(size_t bytes) = 0;
  // Like Allocate, but out of memory (or a device failure) is ResourceExhausted (or the device
  // error) instead of fatal. The default calls Allocate.
  virtual absl::StatusOr<void*> TryAllocate(size_t bytes) { return Allocate(bytes); }
  virtual void Free(void* ptr, size_t bytes) noexcept = 0;

  int64_t current_bytes() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  // Restarts the peak from the current usage (e.g. at the start of a measured step).
  void ResetPeak() { peak_.store(current_bytes(), std::memory_order_relaxed); }

 protected:
  // Inline so that allocators outside the runtime library (kernels/cuda) need nothing from it.
  void RecordAlloc(size_t bytes) {
    const int64_t now = current_.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed) +
                        static_cast<int64_t>(bytes);
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void RecordFree(size_t bytes) {
    current_.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  }

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

// Host memory allocator. Each rank of the runtime gets its own so memory is reported per rank.
//
// A caching allocator: a freed block goes to a free list of its (64-byte rounded) size and the
// next allocation of that size takes it back, so a training step, which allocates the same
// sizes every micro-batch and every step, touches the system allocator (and takes page faults
// on fresh memory) only in its first step. current_bytes()/peak_bytes() count the bytes in use,
// exactly as without the cache; cached_bytes() the blocks kept for reuse. Thread-safe: a tensor
// may be freed by another thread than the one that made it.
class CpuAllocator final : public Allocator {
 public:
  CpuAllocator();
  ~CpuAllocator() override;  // returns the cached blocks; every tensor of it must be gone
  Device device() const override { return Device::Cpu(); }
  void* Allocate(size_t bytes) override;
  absl::StatusOr<void*> TryAllocate(size_t bytes) override;
  void Free(void* ptr, size_t bytes) noexcept override;

  // Bytes held in free lists for reuse (not in use, not in current_bytes()).
  int64_t cached_bytes() const;
  // Allocations the cache could not serve (each one a call to the system allocator).
  int64_t system_allocations() const;
  // Returns every cached block to the system.
  void Trim();

 private:
  struct Cache;
  std::unique_ptr<Cache> cache_;
};

// The process-wide default CPU allocator (used when none is given).
CpuAllocator* DefaultCpuAllocator();

// A stream-ordered pool on CUDA device `device`: cudaMallocAsync / cudaFreeAsync on `stream`,
// from the device's default memory pool, whose release threshold is raised so that freed memory
// stays in the pool and is reused instead of going back to the driver at every synchronisation.
// Memory it hands out is ready for work on `stream`; using it on another stream needs an event
// (CudaEvent) first. `stream` is a stream of `device` (a null handle: the legacy default stream
// of `device`; a CPU stream also means that) and must outlive the allocator and its memory.
// current_bytes()/peak_bytes() count the bytes asked for.
absl::StatusOr<std::unique_ptr<Allocator>> CreateCudaAllocator(int device, Stream stream);
// Page-locked host memory (cudaMallocHost): device() is the CPU, copies to and from it are truly
// asynchronous. Free is cudaFreeHost, which waits for the device's work in flight.
absl::StatusOr<std::unique_ptr<Allocator>> CreatePinnedHostAllocator();

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised tensor. Fatal (it prints what failed and aborts) on a negative dimension or a
  // shape whose bytes overflow 64 bits (shapes are internal values) and when the allocator runs
  // out of memory. TryEmpty reports all three as a Status instead: InvalidArgument for the
  // shape, ResourceExhausted (or the device's error) for the memory.
  static Tensor Empty(std::vector<int64_t> shape, DType dtype = DType::kF32,
                      Allocator* allocator = nullptr);
  static absl::StatusOr<Tensor> TryEmpty(std::vector<int64_t> shape, DType dtype = DType::kF32,
                                         Allocator* allocator = nullptr);
  // On a CUDA allocator the zeroing is queued on its stream.
  static Tensor Zeros(std::vector<int64_t> shape, DType dtype = DType::kF32,
                      Allocator* allocator = nullptr);
  // f32 tensor from host values; size must match the shape. On a CUDA allocator the values are
  // copied to the device and the copy is complete on return.
  static Tensor FromVector(std::vector<int64_t> shape, const std::vector<float>& values,
                           Allocator* allocator = nullptr);
  static Tensor FromVectorI32(std::vector<int64_t> shape, const std::vector<int32_t>& values,
                              Allocator* allocator = nullptr);

  bool defined() const { return !shape_.empty(); }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? shape_.size() + i : i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  Device device() const;
  // The allocator of the storage (nullptr for an undefined tensor) and its stream: the stream
  // work on this tensor is ordered on (a CPU stream for host tensors).
  Allocator* allocator() const { return storage_ ? storage_->allocator : nullptr; }
  Stream stream() const;
  size_t nbytes() const { return static_cast<size_t>(numel_) * DTypeSize(dtype_); }

  void* raw() { return storage_ ? static_cast<char*>(storage_->ptr) + offset_ : nullptr; }
  const void* raw() const {
    return storage_ ? static_cast<const char*>(storage_->ptr) + offset_ : nullptr;
  }
  template <typename T>
  T* data() {
    return static_cast<T*>(raw());
  }
  template <typename T>
  const T* data() const {
    return static_cast<const T*>(raw());
  }

  // Same storage, new shape with the same element count.
  absl::StatusOr<Tensor> Reshape(std::vector<int64_t> shape) const;
  // Elements [offset, offset + numel(shape)) of this tensor's storage as a tensor of `shape`
  // sharing it (writes through either are seen by both; the storage lives while any view does).
  // InvalidArgument when the range is outside this tensor.
  absl::StatusOr<Tensor> View(int64_t offset, std::vector<int64_t> shape) const;
  // Deep copy (with this tensor's allocator, or another one, of any device: then as CopyTo).
  // A CUDA failure is fatal (it prints the error and aborts); CopyTo returns it instead.
  Tensor Clone(Allocator* allocator = nullptr) const;
  // A copy with `allocator` (nullptr: DefaultCpuAllocator()), on any device:
  //  - a copy that involves host memory is complete on return (the CUDA stream used is
  //    synchronised), so a host result can be read at once;
  //  - device to device is queued on the streams, not waited for: on the destination
  //    allocator's stream, after the work already queued on this tensor's stream, which in turn
  //    waits for the copy before its later work (so this tensor may be freed or overwritten at
  //    once).
  absl::StatusOr<Tensor> CopyTo(Allocator* allocator) const;
  // Copies `src`'s bytes into this tensor (same nbytes; shapes may differ), with CopyTo's
  // ordering. Fails with InvalidArgument when the sizes differ.
  absl::Status CopyFrom(const Tensor& src);
  // Zeroes the bytes: memset on the host, queued on the allocator's stream on CUDA (a CUDA
  // failure is fatal: it prints the error and aborts).
  void SetZero();
  void Fill(float value);  // f32 host tensors only (CHECK-fails on a device tensor)
  // Copies the f32 contents into a host vector. Host tensors only: on a CUDA tensor it is an
  // internal-invariant failure (PW_CHECK aborts) rather than a hidden device read; callers copy
  // device tensors to the host first (CopyTo(nullptr)).
  std::vector<float> ToVector() const;
  // "[2, 3] f32"
  std::string ShapeString() const;

 private:
  struct Storage {
    Allocator* allocator = nullptr;
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Storage();
  };
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kF32;
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes from storage_->ptr (a View)
};

int64_t NumElements(const std::vector<int64_t>& shape);

}  // namespace pipewright

#endif  // PIPEWRIGHT_TENSOR_H_
