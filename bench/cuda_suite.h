// `pipewright bench --suite cuda`: what one GPU delivers, measured with CUDA events —
//   GEMM TFLOP/s through kernels/cuda/gemm.cuh (bf16 and fp16 at 4096^3 and 8192^3, with fp32
//   and 16-bit C; tf32 and plain fp32 at 4096^3). The best bf16 figure is the "measured bf16
//   peak" that cost models should use instead of the datasheet number;
//   device-to-device copy bandwidth (cudaMemcpyAsync of 1 GiB, bytes read + written per second);
//   with two or more GPUs, cudaMemcpyPeerAsync bandwidth from device 0 to device 1 (bytes
//   copied per second).
// Every row: untimed warm-up, then the median of `repetitions` individually timed runs; inputs
// are random, non-zero, and rotate between two sets so the L2 cache never holds them.
// Only built with CUDA (bench/CMakeLists.txt).
#ifndef PIPEWRIGHT_BENCH_CUDA_SUITE_H_
#define PIPEWRIGHT_BENCH_CUDA_SUITE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pipewright::bench {

struct CudaGemmRow {
  std::string name;   // e.g. "bf16 4096x4096x4096 -> fp32"
  std::string dtype;  // "bf16" | "fp16" | "tf32" | "fp32"
  int m = 0, n = 0, k = 0;
  double seconds = 0;  // median time of one GEMM
  double tflops_per_s = 0;
};

struct CudaCopyRow {
  std::string name;
  double bytes = 0;    // counted bytes per repetition (see the header comment)
  double seconds = 0;  // median
  double gb_per_s = 0;
};

struct CudaSuiteResult {
  std::string device_name;
  int device_count = 0;
  std::vector<CudaGemmRow> gemm_rows;
  std::vector<CudaCopyRow> copy_rows;
  double measured_bf16_peak_tflops = 0;  // best bf16 GEMM row
  double d2d_gb_per_s = 0;
  double peer_gb_per_s = -1;  // -1: fewer than two GPUs
  bool peer_access = false;   // direct peer access was enabled for the peer copy
};

// Unavailable ("no CUDA device ...") when no GPU is usable.
absl::StatusOr<CudaSuiteResult> RunCudaSuite(int repetitions);

}  // namespace pipewright::bench

#endif  // PIPEWRIGHT_BENCH_CUDA_SUITE_H_
