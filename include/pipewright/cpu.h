// The CPU the kernels run on: its vector instruction sets, detected at run time (a binary built
// for baseline x86-64 or aarch64 picks its kernels for the machine it runs on), the OpenBLAS
// kernels in use, and how many threads the CPU kernels use.
#ifndef PIPEWRIGHT_CPU_H_
#define PIPEWRIGHT_CPU_H_

#include <string>

namespace pipewright {

// What this CPU (and the OS, which must save the wider registers) supports. All false on
// non-x86 machines.
struct CpuFeatures {
  bool avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false;  // vdpbf16ps: bf16 dot products with fp32 accumulation
  bool avx512fp16 = false;
  // The AVX-512 subset the kernels use (F, BW, VL, DQ).
  bool avx512() const { return avx512f && avx512bw && avx512vl && avx512dq; }
};
const CpuFeatures& GetCpuFeatures();
// "avx512+bf16", "avx512", "avx2", or "baseline": the kernels this process runs (the widest the
// CPU supports, or a narrower one forced by PIPEWRIGHT_CPU_ISA=baseline|avx2|avx512).
std::string CpuKernelIsa();

// The OpenBLAS kernel set in use ("Cooperlake", "Haswell", "Prescott", ...).
std::string BlasCoreName();
// The fp32 GEMM the CPU kernels run: "pipewright" (its own AVX-512 GEMM) or "OpenBLAS"
// (PIPEWRIGHT_GEMM=openblas, or no AVX-512).
std::string CpuGemmName();
// The OpenBLAS kernel set this CPU should use when OpenBLAS's own detection chose an older one
// (a CPU model newer than the OpenBLAS release, often behind a hypervisor, falls back to
// "Prescott", SSE3 kernels several times slower); empty when the choice is right, when
// OPENBLAS_CORETYPE is set, or when OpenBLAS was built for one target only.
std::string PreferredBlasCore();
// For programs (the pipewright CLI calls it first thing in main): when PreferredBlasCore() is
// not empty, sets OPENBLAS_CORETYPE to it and re-executes this program with the same arguments
// (OpenBLAS reads the variable only when it loads), so it does not return; otherwise returns.
// PIPEWRIGHT_BLAS_CORE=keep disables it.
void ReexecForBlasCore(char** argv);

// Threads OpenBLAS uses inside one matrix product, process-wide. The engine sets 1 for a CPU run
// (Engine::Create): each rank splits its products over its own threads instead
// (TrainOptions::threads_per_rank), which keeps results independent of the thread count.
void SetCpuKernelThreads(int threads);

}  // namespace pipewright

#endif  // PIPEWRIGHT_CPU_H_
