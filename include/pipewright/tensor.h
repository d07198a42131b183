// Tensor: shape, dtype, device and shared storage from an Allocator. Dense and row-major; no
// views with strides (a stage's tensors are always contiguous). Copies share storage; Clone()
// deep-copies. No hidden host/device copies: data<T>() on a CUDA tensor is a device pointer.
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
  // Returns nullptr only for bytes == 0. Memory is 64-byte aligned.
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr, size_t bytes) noexcept = 0;

  int64_t current_bytes() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  // Restarts the peak from the current usage (e.g. at the start of a measured step).
  void ResetPeak() { peak_.store(current_bytes(), std::memory_order_relaxed); }

 protected:
  void RecordAlloc(size_t bytes);
  void RecordFree(size_t bytes);

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

// Host memory allocator. Each rank of the runtime gets its own so memory is reported per rank.
class CpuAllocator final : public Allocator {
 public:
  Device device() const override { return Device::Cpu(); }
  void* Allocate(size_t bytes) override;
  void Free(void* ptr, size_t bytes) noexcept override;
};

// The process-wide default CPU allocator (used when none is given).
CpuAllocator* DefaultCpuAllocator();

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised tensor. CHECK-fails on negative dims (shapes are internal values).
  static Tensor Empty(std::vector<int64_t> shape, DType dtype = DType::kF32,
                      Allocator* allocator = nullptr);
  static Tensor Zeros(std::vector<int64_t> shape, DType dtype = DType::kF32,
                      Allocator* allocator = nullptr);
  // f32 tensor from values (host); size must match the shape.
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
  size_t nbytes() const { return static_cast<size_t>(numel_) * DTypeSize(dtype_); }

  void* raw() { return storage_ ? storage_->ptr : nullptr; }
  const void* raw() const { return storage_ ? storage_->ptr : nullptr; }
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
  // Deep copy (same device, optionally another allocator).
  Tensor Clone(Allocator* allocator = nullptr) const;
  void SetZero();
  void Fill(float value);  // f32 only
  // Copies the f32 contents into a host vector (host tensors only).
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
};

int64_t NumElements(const std::vector<int64_t>& shape);

}  // namespace pipewright

#endif  // PIPEWRIGHT_TENSOR_H_
