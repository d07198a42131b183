#include "pipewright/tensor.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace pipewright {
namespace {

// A device failure where the API has no Status to return: says what failed, then aborts.
void CheckOk(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "pipewright: %s failed: %s\n", what, std::string(status.ToString()).c_str());
  std::abort();
}

// Host to host is a memcpy; anything else goes through CopyBytes (see Tensor::CopyFrom).
bool BothHost(const Tensor& a, const Tensor& b) {
  return a.device().is_cpu() && b.device().is_cpu();
}

}  // namespace

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

struct CpuAllocator::Cache {
  absl::Mutex mu;
  std::unordered_map<size_t, std::vector<void*>> free ABSL_GUARDED_BY(mu);  // by rounded size
  int64_t cached ABSL_GUARDED_BY(mu) = 0;
  int64_t system_allocations ABSL_GUARDED_BY(mu) = 0;

  // A cached block of `rounded` bytes, or nullptr.
  void* Take(size_t rounded) {
    absl::MutexLock lock(&mu);
    auto it = free.find(rounded);
    if (it == free.end() || it->second.empty()) {
      ++system_allocations;
      return nullptr;
    }
    void* p = it->second.back();
    it->second.pop_back();
    cached -= static_cast<int64_t>(rounded);
    return p;
  }
};

CpuAllocator::CpuAllocator() : cache_(std::make_unique<Cache>()) {}
CpuAllocator::~CpuAllocator() { Trim(); }

namespace {
// Bytes rounded up to the 64-byte alignment; 0 when that overflows.
size_t RoundedSize(size_t bytes) { return bytes > SIZE_MAX - 63 ? 0 : (bytes + 63) / 64 * 64; }
}  // namespace

void* CpuAllocator::Allocate(size_t bytes) {
  absl::StatusOr<void*> p = TryAllocate(bytes);
  // Fatal, as documented; the runs that user input sizes are refused before they allocate
  // (CheckRunMemory), so this is the machine running out under a run that fitted.
  CheckOk(p.status(), "host allocation");
  return *p;
}

absl::StatusOr<void*> CpuAllocator::TryAllocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = RoundedSize(bytes);
  if (rounded == 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host allocation of ", bytes, " bytes overflows"));
  }
  void* p = cache_->Take(rounded);
  if (p == nullptr) p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    Trim();  // the cache may hold enough of other sizes
    p = std::aligned_alloc(64, rounded);
  }
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("out of host memory allocating ", bytes,
                                                     " bytes (", current_bytes(),
                                                     " bytes in use by this allocator)"));
  }
  RecordAlloc(bytes);
  return p;
}

void CpuAllocator::Free(void* ptr, size_t bytes) noexcept {
  if (ptr == nullptr) return;
  const size_t rounded = RoundedSize(bytes);
  {
    absl::MutexLock lock(&cache_->mu);
    cache_->free[rounded].push_back(ptr);
    cache_->cached += static_cast<int64_t>(rounded);
  }
  RecordFree(bytes);
}

int64_t CpuAllocator::cached_bytes() const {
  absl::MutexLock lock(&cache_->mu);
  return cache_->cached;
}

int64_t CpuAllocator::system_allocations() const {
  absl::MutexLock lock(&cache_->mu);
  return cache_->system_allocations;
}

void CpuAllocator::Trim() {
  absl::MutexLock lock(&cache_->mu);
  for (auto& [size, blocks] : cache_->free) {
    for (void* p : blocks) std::free(p);
  }
  cache_->free.clear();
  cache_->cached = 0;
}

CpuAllocator* DefaultCpuAllocator() {
  static CpuAllocator* allocator = new CpuAllocator();
  return allocator;
}

Tensor::Storage::~Storage() {
  if (allocator != nullptr) allocator->Free(ptr, bytes);
}

namespace {

// The element count of `shape` and its bytes in `dtype`; InvalidArgument for a negative
// dimension or a count that does not fit 64 bits (never a wrapped one).
absl::StatusOr<int64_t> CheckedNumElements(const std::vector<int64_t>& shape, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("negative dimension in tensor shape");
    if (__builtin_mul_overflow(n, d, &n)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor shape [", absl::StrJoin(shape, ", "),
                                                     "] has more than 2^63 elements"));
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(DTypeSize(dtype)), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor shape [", absl::StrJoin(shape, ", "),
                                                   "] ", DTypeName(dtype),
                                                   " has more than 2^63 bytes"));
  }
  return n;
}

}  // namespace

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    PW_CHECK(d >= 0);
    PW_CHECK(!__builtin_mul_overflow(n, d, &n));  // internal shapes fit 64 bits
  }
  return n;
}

Tensor Tensor::Empty(std::vector<int64_t> shape, DType dtype, Allocator* allocator) {
  if (allocator == nullptr) allocator = DefaultCpuAllocator();
  // Shapes here are internal values (the runtime checks what user input sizes first): one whose
  // bytes overflow is a broken invariant, never a wrapped small allocation.
  const absl::StatusOr<int64_t> numel = CheckedNumElements(shape, dtype);
  CheckOk(numel.status(), "Tensor::Empty");
  Tensor t;
  t.numel_ = *numel;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->allocator = allocator;
  t.storage_->bytes = t.nbytes();
  t.storage_->ptr = allocator->Allocate(t.storage_->bytes);
  return t;
}

absl::StatusOr<Tensor> Tensor::TryEmpty(std::vector<int64_t> shape, DType dtype,
                                        Allocator* allocator) {
  if (allocator == nullptr) allocator = DefaultCpuAllocator();
  PW_ASSIGN_OR_RETURN(const int64_t numel, CheckedNumElements(shape, dtype));
  Tensor t;
  t.numel_ = numel;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  const size_t bytes = t.nbytes();
  PW_ASSIGN_OR_RETURN(void* ptr, allocator->TryAllocate(bytes));
  t.storage_ = std::make_shared<Storage>();
  t.storage_->allocator = allocator;
  t.storage_->bytes = bytes;
  t.storage_->ptr = ptr;
  return t;
}

Tensor Tensor::Zeros(std::vector<int64_t> shape, DType dtype, Allocator* allocator) {
  Tensor t = Empty(std::move(shape), dtype, allocator);
  t.SetZero();
  return t;
}

namespace {

// Copies host values into a new tensor's storage (uploading, and waiting, on a device).
void Upload(Tensor& t, const void* values) {
  if (t.nbytes() == 0) return;
  if (t.device().is_cpu()) {
    std::memcpy(t.raw(), values, t.nbytes());
    return;
  }
  CheckOk(CopyBytes(t.raw(), t.device(), values, Device::Cpu(), t.nbytes(), t.stream()),
          "Tensor::FromVector upload");
  CheckOk(SynchronizeStream(t.stream()), "Tensor::FromVector upload");
}

}  // namespace

Tensor Tensor::FromVector(std::vector<int64_t> shape, const std::vector<float>& values,
                          Allocator* allocator) {
  Tensor t = Empty(std::move(shape), DType::kF32, allocator);
  PW_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  Upload(t, values.data());
  return t;
}

Tensor Tensor::FromVectorI32(std::vector<int64_t> shape, const std::vector<int32_t>& values,
                             Allocator* allocator) {
  Tensor t = Empty(std::move(shape), DType::kI32, allocator);
  PW_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  Upload(t, values.data());
  return t;
}

Device Tensor::device() const {
  return storage_ && storage_->allocator ? storage_->allocator->device() : Device::Cpu();
}

Stream Tensor::stream() const {
  return storage_ && storage_->allocator ? storage_->allocator->stream() : Stream{};
}

absl::StatusOr<Tensor> Tensor::Reshape(std::vector<int64_t> shape) const {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("negative dimension in reshape");
  }
  if (absl::StatusOr<int64_t> n = CheckedNumElements(shape, dtype_); !n.ok() || *n != numel_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot reshape ", ShapeString(), " to [", absl::StrJoin(shape, ", "), "]"));
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

absl::StatusOr<Tensor> Tensor::View(int64_t offset, std::vector<int64_t> shape) const {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("negative dimension in view");
  }
  const absl::StatusOr<int64_t> n = CheckedNumElements(shape, dtype_);
  if (!n.ok() || offset < 0 || offset > numel_ || *n > numel_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("a view of [", absl::StrJoin(shape, ", "),
                                                   "] at element ", offset, " is outside ",
                                                   ShapeString()));
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  t.numel_ = *n;
  t.offset_ = offset_ + static_cast<size_t>(offset) * DTypeSize(dtype_);
  return t;
}

Tensor Tensor::Clone(Allocator* allocator) const {
  Tensor t =
      Empty(shape_, dtype_, allocator ? allocator : (storage_ ? storage_->allocator : nullptr));
  if (BothHost(t, *this)) {
    if (nbytes() > 0) std::memcpy(t.raw(), raw(), nbytes());
  } else {
    CheckOk(t.CopyFrom(*this), "Tensor::Clone");
  }
  return t;
}

absl::StatusOr<Tensor> Tensor::CopyTo(Allocator* allocator) const {
  PW_ASSIGN_OR_RETURN(Tensor t, TryEmpty(shape_, dtype_, allocator));
  PW_RETURN_IF_ERROR(t.CopyFrom(*this));
  return t;
}

absl::Status Tensor::CopyFrom(const Tensor& src) {
  if (nbytes() != src.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyFrom: cannot copy ", src.ShapeString(),
                                                   " (", src.nbytes(), " bytes) into ",
                                                   ShapeString(), " (", nbytes(), " bytes)"));
  }
  if (nbytes() == 0 || raw() == src.raw()) return absl::OkStatus();
  const Device dst_device = device(), src_device = src.device();
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(raw(), src.raw(), nbytes());
    return absl::OkStatus();
  }
  const Stream dst_stream = stream(), src_stream = src.stream();
  if (dst_device.is_cpu() || src_device.is_cpu()) {
    // Host <-> device: on the device side's stream (after the work queued there), then waited
    // for, so the host side may be read, freed or overwritten at once.
    const Stream s = src_device.is_cuda() ? src_stream : dst_stream;
    PW_RETURN_IF_ERROR(CopyBytes(raw(), dst_device, src.raw(), src_device, nbytes(), s));
    return SynchronizeStream(s);
  }
  if (dst_stream == src_stream) {
    return CopyBytes(raw(), dst_device, src.raw(), src_device, nbytes(), dst_stream);
  }
  if (dst_stream.is_cpu() || src_stream.is_cpu()) {
    // An allocator without a CUDA stream: drain both sides, then copy synchronously.
    PW_RETURN_IF_ERROR(SynchronizeStream(src_stream));
    PW_RETURN_IF_ERROR(SynchronizeStream(dst_stream));
    return CopyBytes(raw(), dst_device, src.raw(), src_device, nbytes(), Stream{});
  }
  // Device to device across streams: the destination stream waits for the source's queued work
  // (its producers), copies, and the source stream waits for the copy before its later work (a
  // later write, or the stream-ordered free of the source).
  PW_ASSIGN_OR_RETURN(CudaEvent produced, CudaEvent::Create(src_device, /*timing=*/false));
  PW_RETURN_IF_ERROR(produced.Record(src_stream));
  PW_RETURN_IF_ERROR(produced.MakeStreamWait(dst_stream));
  PW_RETURN_IF_ERROR(CopyBytes(raw(), dst_device, src.raw(), src_device, nbytes(), dst_stream));
  PW_ASSIGN_OR_RETURN(CudaEvent copied, CudaEvent::Create(dst_device, /*timing=*/false));
  PW_RETURN_IF_ERROR(copied.Record(dst_stream));
  return copied.MakeStreamWait(src_stream);
}

void Tensor::SetZero() {
  if (nbytes() == 0) return;
  if (device().is_cpu()) {
    std::memset(raw(), 0, nbytes());
    return;
  }
  CheckOk(MemsetBytes(raw(), device(), 0, nbytes(), stream()), "Tensor::SetZero");
}

void Tensor::Fill(float value) {
  PW_CHECK(dtype_ == DType::kF32 && device().is_cpu());
  float* p = data<float>();
  for (int64_t i = 0; i < numel_; ++i) p[i] = value;
}

std::vector<float> Tensor::ToVector() const {
  // Host tensors only (an internal invariant: callers copy device tensors with CopyTo first).
  PW_CHECK(dtype_ == DType::kF32 && device().is_cpu());
  std::vector<float> out(numel_);
  if (numel_ > 0) std::memcpy(out.data(), raw(), nbytes());
  return out;
}

std::string Tensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape_, ", "), "] ", DTypeName(dtype_));
}

}  // namespace pipewright
