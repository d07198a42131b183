#include "bench/cuda_suite.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_check.cuh"
#include "kernels/cuda/gemm.cuh"
#include "pipewright/device.h"
#include "pipewright/status.h"

namespace pipewright::bench {
namespace {

constexpr int kInputSets = 2;  // rotated so consecutive runs never find their inputs in L2
constexpr size_t kCopyBytes = size_t{1} << 30;

// Owning device allocation (teardown ignores errors).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(size_t bytes) {
    PW_CUDA_RETURN_IF_ERROR(cudaMalloc(&p_, bytes));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

class StreamAndEvents {
 public:
  ~StreamAndEvents() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  absl::Status Init(int reps) {
    PW_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    events_.resize(2 * static_cast<size_t>(reps), nullptr);
    for (cudaEvent_t& e : events_) PW_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    return absl::OkStatus();
  }
  cudaStream_t stream() const { return stream_; }

  // Median seconds of `reps` runs of fn(rep) (each bracketed by its own event pair), after
  // `warmup` untimed runs fn(0), fn(1), ...
  template <typename Fn>
  absl::StatusOr<double> Time(int reps, int warmup, Fn&& fn) {
    for (int i = 0; i < warmup; ++i) PW_RETURN_IF_ERROR(fn(i));
    for (int i = 0; i < reps; ++i) {
      PW_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2 * i], stream_));
      PW_RETURN_IF_ERROR(fn(i));
      PW_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2 * i + 1], stream_));
    }
    PW_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    std::vector<double> seconds;
    for (int i = 0; i < reps; ++i) {
      float ms = 0;
      PW_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]));
      seconds.push_back(ms / 1e3);
    }
    return Median(std::move(seconds));
  }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

// Uniform values in [-1, 1) excluding zero, from a xorshift generator (fast enough for 8192^2).
void FillRandom(std::vector<float>& v, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x = 2.0f * u - 1.0f;
    if (x == 0.0f) x = 0.5f;
  }
}

enum class GemmKind { kBf16, kFp16, kTf32, kFp32 };

absl::StatusOr<CudaGemmRow> GemmRow(StreamAndEvents& se, cuda::Blas& blas, GemmKind kind,
                                    bool half_out, int n, int reps) {
  const bool is16 = kind == GemmKind::kBf16 || kind == GemmKind::kFp16;
  const size_t elems = static_cast<size_t>(n) * n;
  const size_t in_bytes = elems * (is16 ? 2 : 4);
  DeviceBuffer a[kInputSets], b[kInputSets], c;
  std::vector<float> host(elems);
  std::vector<uint16_t> host16(is16 ? elems : 0);
  uint64_t seed = 1;
  for (int set = 0; set < kInputSets; ++set) {
    for (DeviceBuffer* buf : {&a[set], &b[set]}) {
      PW_RETURN_IF_ERROR(buf->Allocate(in_bytes));
      FillRandom(host, seed++);
      const void* src = host.data();
      if (kind == GemmKind::kBf16) {
        cpu::FloatToBf16(host.data(), host16.data(), elems);
        src = host16.data();
      } else if (kind == GemmKind::kFp16) {
        cpu::FloatToHalf(host.data(), host16.data(), elems);
        src = host16.data();
      }
      PW_CUDA_RETURN_IF_ERROR(cudaMemcpy(buf->get(), src, in_bytes, cudaMemcpyHostToDevice));
    }
  }
  PW_RETURN_IF_ERROR(c.Allocate(elems * (half_out ? 2 : 4)));

  auto run = [&](int rep) -> absl::Status {
    const int set = rep % kInputSets;
    // Row-major C = A * B^T (the layout of a linear layer's forward).
    switch (kind) {
      case GemmKind::kBf16:
      case GemmKind::kFp16: {
        const bool bf16 = kind == GemmKind::kBf16;
        const auto* pa = static_cast<const uint16_t*>(a[set].get());
        const auto* pb = static_cast<const uint16_t*>(b[set].get());
        if (half_out) {
          return cuda::GemmHalfOut(se.stream(), blas, bf16, false, true, n, n, n, 1.0f, pa, n, pb,
                                   n, 0.0f, static_cast<uint16_t*>(c.get()), n);
        }
        return cuda::GemmHalf(se.stream(), blas, bf16, false, true, n, n, n, 1.0f, pa, n, pb, n,
                              0.0f, static_cast<float*>(c.get()), n);
      }
      case GemmKind::kTf32:
      case GemmKind::kFp32:
        return cuda::Gemm(se.stream(), blas, false, true, n, n, n, 1.0f,
                          static_cast<const float*>(a[set].get()), n,
                          static_cast<const float*>(b[set].get()), n, 0.0f,
                          static_cast<float*>(c.get()), n, kind == GemmKind::kTf32);
    }
    return absl::InternalError("unreachable");
  };
  PW_ASSIGN_OR_RETURN(const double seconds, se.Time(reps, /*warmup=*/2 * kInputSets, run));

  CudaGemmRow row;
  const char* dtype = kind == GemmKind::kBf16   ? "bf16"
                      : kind == GemmKind::kFp16 ? "fp16"
                      : kind == GemmKind::kTf32 ? "tf32"
                                                : "fp32";
  row.dtype = dtype;
  row.m = row.n = row.k = n;
  row.name = absl::StrFormat("gemm %s %dx%dx%d -> %s", dtype, n, n, n, half_out ? dtype : "fp32");
  row.seconds = seconds;
  row.tflops_per_s = 2.0 * n * static_cast<double>(n) * n / seconds / 1e12;
  return row;
}

absl::StatusOr<CudaCopyRow> DeviceCopyRow(StreamAndEvents& se, int reps) {
  DeviceBuffer src, dst;
  PW_RETURN_IF_ERROR(src.Allocate(kCopyBytes));
  PW_RETURN_IF_ERROR(dst.Allocate(kCopyBytes));
  PW_CUDA_RETURN_IF_ERROR(cudaMemset(src.get(), 0x3C, kCopyBytes));
  PW_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the timing stream does not wait for it
  auto run = [&](int) -> absl::Status {
    PW_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.get(), src.get(), kCopyBytes, cudaMemcpyDeviceToDevice, se.stream()));
    return absl::OkStatus();
  };
  PW_ASSIGN_OR_RETURN(const double seconds, se.Time(reps, /*warmup=*/1, run));
  CudaCopyRow row;
  row.name = "device-to-device cudaMemcpyAsync 1 GiB (read + write)";
  row.bytes = 2.0 * static_cast<double>(kCopyBytes);
  row.seconds = seconds;
  row.gb_per_s = row.bytes / seconds / 1e9;
  return row;
}

absl::StatusOr<CudaCopyRow> PeerCopyRow(StreamAndEvents& se, int reps, bool* peer_access) {
  int can = 0;
  PW_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, 0, 1));
  *peer_access = false;
  if (can) {
    const cudaError_t err = cudaDeviceEnablePeerAccess(1, 0);  // current device is 0
    if (err == cudaSuccess || err == cudaErrorPeerAccessAlreadyEnabled) {
      *peer_access = true;
    }
    cudaGetLastError();
  }
  DeviceBuffer src, dst;
  PW_RETURN_IF_ERROR(src.Allocate(kCopyBytes));
  PW_CUDA_RETURN_IF_ERROR(cudaMemset(src.get(), 0x3C, kCopyBytes));
  PW_CUDA_RETURN_IF_ERROR(cudaSetDevice(1));
  const absl::Status alloc = dst.Allocate(kCopyBytes);
  PW_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  PW_RETURN_IF_ERROR(alloc);
  PW_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  auto run = [&](int) -> absl::Status {
    PW_CUDA_RETURN_IF_ERROR(
        cudaMemcpyPeerAsync(dst.get(), 1, src.get(), 0, kCopyBytes, se.stream()));
    return absl::OkStatus();
  };
  PW_ASSIGN_OR_RETURN(const double seconds, se.Time(reps, /*warmup=*/1, run));
  if (*peer_access) {
    cudaDeviceDisablePeerAccess(1);
    cudaGetLastError();
  }
  CudaCopyRow row;
  row.name = absl::StrFormat("peer cudaMemcpyPeerAsync 1 GiB, device 0 -> 1 (%s)",
                             *peer_access ? "peer access" : "staged, no peer access");
  row.bytes = static_cast<double>(kCopyBytes);
  row.seconds = seconds;
  row.gb_per_s = row.bytes / seconds / 1e9;
  return row;
}

}  // namespace

absl::StatusOr<CudaSuiteResult> RunCudaSuite(int repetitions) {
  CudaSuiteResult out;
  out.device_count = CudaDeviceCount();
  if (out.device_count == 0) {
    return absl::UnavailableError(
        "no CUDA device: `bench --suite cuda` needs a GPU (none found, or no driver)");
  }
  PW_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  cudaDeviceProp prop;
  PW_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  out.device_name = prop.name;

  StreamAndEvents se;
  PW_RETURN_IF_ERROR(se.Init(repetitions));
  PW_ASSIGN_OR_RETURN(std::unique_ptr<cuda::Blas> blas, cuda::Blas::Create(0));

  struct Config {
    GemmKind kind;
    bool half_out;
    int n;
  };
  const Config configs[] = {
      {GemmKind::kBf16, false, 4096}, {GemmKind::kBf16, true, 4096},
      {GemmKind::kBf16, false, 8192}, {GemmKind::kBf16, true, 8192},
      {GemmKind::kFp16, false, 4096}, {GemmKind::kFp16, true, 4096},
      {GemmKind::kFp16, false, 8192}, {GemmKind::kFp16, true, 8192},
      {GemmKind::kTf32, false, 4096}, {GemmKind::kFp32, false, 4096},
  };
  for (const Config& cfg : configs) {
    PW_ASSIGN_OR_RETURN(CudaGemmRow row,
                        GemmRow(se, *blas, cfg.kind, cfg.half_out, cfg.n, repetitions));
    if (cfg.kind == GemmKind::kBf16 && row.tflops_per_s > out.measured_bf16_peak_tflops) {
      out.measured_bf16_peak_tflops = row.tflops_per_s;
    }
    out.gemm_rows.push_back(std::move(row));
  }

  PW_ASSIGN_OR_RETURN(CudaCopyRow d2d, DeviceCopyRow(se, repetitions));
  out.d2d_gb_per_s = d2d.gb_per_s;
  out.copy_rows.push_back(std::move(d2d));
  if (out.device_count >= 2) {
    PW_ASSIGN_OR_RETURN(CudaCopyRow peer, PeerCopyRow(se, repetitions, &out.peer_access));
    out.peer_gb_per_s = peer.gb_per_s;
    out.copy_rows.push_back(std::move(peer));
  }
  return out;
}

}  // namespace pipewright::bench
