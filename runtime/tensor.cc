#include "pipewright/tensor.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pipewright {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kF64:
      return "f64";
  }
  return "?";
}

const char* DTypeSafetensorsName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
    case DType::kF64:
      return "F64";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "f32" || name == "F32" || name == "fp32") return DType::kF32;
  if (name == "bf16" || name == "BF16") return DType::kBF16;
  if (name == "f16" || name == "F16" || name == "fp16") return DType::kF16;
  if (name == "i32" || name == "I32") return DType::kI32;
  if (name == "f64" || name == "F64") return DType::kF64;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

void Allocator::RecordAlloc(size_t bytes) {
  int64_t now = current_.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed) +
                static_cast<int64_t>(bytes);
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void Allocator::RecordFree(size_t bytes) {
  current_.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
}

void* CpuAllocator::Allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  PW_CHECK(p != nullptr);
  RecordAlloc(bytes);
  return p;
}

void CpuAllocator::Free(void* ptr, size_t bytes) noexcept {
  if (ptr == nullptr) return;
  std::free(ptr);
  RecordFree(bytes);
}

CpuAllocator* DefaultCpuAllocator() {
  static CpuAllocator* allocator = new CpuAllocator();
  return allocator;
}

Tensor::Storage::~Storage() {
  if (allocator != nullptr) allocator->Free(ptr, bytes);
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    PW_CHECK(d >= 0);
    n *= d;
  }
  return n;
}

Tensor Tensor::Empty(std::vector<int64_t> shape, DType dtype, Allocator* allocator) {
  if (allocator == nullptr) allocator = DefaultCpuAllocator();
  Tensor t;
  t.numel_ = NumElements(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->allocator = allocator;
  t.storage_->bytes = t.nbytes();
  t.storage_->ptr = allocator->Allocate(t.storage_->bytes);
  return t;
}

Tensor Tensor::Zeros(std::vector<int64_t> shape, DType dtype, Allocator* allocator) {
  Tensor t = Empty(std::move(shape), dtype, allocator);
  t.SetZero();
  return t;
}

Tensor Tensor::FromVector(std::vector<int64_t> shape, const std::vector<float>& values,
                          Allocator* allocator) {
  Tensor t = Empty(std::move(shape), DType::kF32, allocator);
  PW_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  if (!values.empty()) std::memcpy(t.raw(), values.data(), t.nbytes());
  return t;
}

Tensor Tensor::FromVectorI32(std::vector<int64_t> shape, const std::vector<int32_t>& values,
                             Allocator* allocator) {
  Tensor t = Empty(std::move(shape), DType::kI32, allocator);
  PW_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  if (!values.empty()) std::memcpy(t.raw(), values.data(), t.nbytes());
  return t;
}

Device Tensor::device() const {
  return storage_ && storage_->allocator ? storage_->allocator->device() : Device::Cpu();
}

absl::StatusOr<Tensor> Tensor::Reshape(std::vector<int64_t> shape) const {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("negative dimension in reshape");
  }
  if (NumElements(shape) != numel_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot reshape ", ShapeString(), " to [", absl::StrJoin(shape, ", "), "]"));
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::Clone(Allocator* allocator) const {
  PW_CHECK(device().is_cpu());
  Tensor t =
      Empty(shape_, dtype_, allocator ? allocator : (storage_ ? storage_->allocator : nullptr));
  if (nbytes() > 0) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

void Tensor::SetZero() {
  PW_CHECK(device().is_cpu());
  if (nbytes() > 0) std::memset(raw(), 0, nbytes());
}

void Tensor::Fill(float value) {
  PW_CHECK(dtype_ == DType::kF32 && device().is_cpu());
  float* p = data<float>();
  for (int64_t i = 0; i < numel_; ++i) p[i] = value;
}

std::vector<float> Tensor::ToVector() const {
  PW_CHECK(dtype_ == DType::kF32 && device().is_cpu());
  std::vector<float> out(numel_);
  if (numel_ > 0) std::memcpy(out.data(), raw(), nbytes());
  return out;
}

std::string Tensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape_, ", "), "] ", DTypeName(dtype_));
}

}  // namespace pipewright
