// CPU feature detection, the OpenBLAS kernel choice, and the kernels' thread count (cpu.h).
//
// Note [OpenBLAS kernel choice]. A DYNAMIC_ARCH OpenBLAS picks its kernels when it loads, from
// the CPU's family and model. A CPU newer than the OpenBLAS release (Debian 12 ships 0.3.21) is
// unknown to it and gets "Prescott" (SSE3) kernels: measured here, on a Xeon with AVX-512 and
// AVX512_BF16 behind a hypervisor, 29 GFLOP/s single-thread sgemm against 150 with the
// "Cooperlake" kernels OPENBLAS_CORETYPE selects. The variable is read only at load, so the CLI
// sets it and re-executes itself (ReexecForBlasCore) before anything else runs.
#include <cblas.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/isa.h"
#include "pipewright/cpu.h"

extern "C" char* openblas_get_corename(void);
extern "C" char* openblas_get_config(void);

namespace pipewright {
namespace {

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  f.avx512fp16 = __builtin_cpu_supports("avx512fp16");
#endif
  return f;
}

// How good an OpenBLAS x86 kernel set is: 3 AVX-512 with bf16, 2 AVX-512, 1 AVX2, 0 older.
int CoreRank(const std::string& core) {
  if (core == "Cooperlake" || core == "SapphireRapids") return 3;
  if (core == "SkylakeX") return 2;
  if (core == "Haswell" || core == "Zen" || core == "Excavator") return 1;
  return 0;
}

}  // namespace

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures f = Detect();
  return f;
}

std::string CpuKernelIsa() {
  const cpu::Isa isa = cpu::KernelIsa();
  std::string name = cpu::IsaName(isa);
  if (isa == cpu::Isa::kAvx512 && GetCpuFeatures().avx512bf16) name += "+bf16";
  return name;
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "";
}

std::string CpuGemmName() { return cpu::OwnF32Gemm() ? "pipewright" : "OpenBLAS"; }

std::string PreferredBlasCore() {
  const char* config = openblas_get_config();
  if (config == nullptr || std::strstr(config, "DYNAMIC_ARCH") == nullptr) return "";
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
  const CpuFeatures& f = GetCpuFeatures();
  std::string want;
  if (f.avx512() && f.avx512bf16) {
    want = "Cooperlake";
  } else if (f.avx512()) {
    want = "SkylakeX";
  } else if (f.avx2 && f.fma) {
    want = "Haswell";
  } else {
    return "";
  }
  return CoreRank(BlasCoreName()) < CoreRank(want) ? want : "";
}

void ReexecForBlasCore(char** argv) {
  const char* keep = std::getenv("PIPEWRIGHT_BLAS_CORE");
  if (keep != nullptr && std::strcmp(keep, "keep") == 0) return;
  const std::string core = PreferredBlasCore();
  if (core.empty() || argv == nullptr) return;
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: the re-exec failed (no /proc); carry on with OpenBLAS's own choice.
  std::fprintf(stderr, "pipewright: could not re-execute with OPENBLAS_CORETYPE=%s (%s)\n",
               core.c_str(), std::strerror(errno));
  unsetenv("OPENBLAS_CORETYPE");
}

namespace cpu {

Isa KernelIsa() {
  static const Isa isa = [] {
    const CpuFeatures& f = GetCpuFeatures();
    Isa best = Isa::kBaseline;
    if (f.avx2 && f.fma) best = Isa::kAvx2;
    if (f.avx512() && f.fma) best = Isa::kAvx512;
    const char* force = std::getenv("PIPEWRIGHT_CPU_ISA");
    if (force == nullptr) return best;
    Isa want = best;
    if (std::strcmp(force, "baseline") == 0) want = Isa::kBaseline;
    if (std::strcmp(force, "avx2") == 0) want = Isa::kAvx2;
    if (std::strcmp(force, "avx512") == 0) want = Isa::kAvx512;
    return static_cast<int>(want) < static_cast<int>(best) ? want : best;
  }();
  return isa;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kBaseline:
      break;
  }
  return "baseline";
}

}  // namespace cpu

void SetCpuKernelThreads(int threads) { openblas_set_num_threads(threads < 1 ? 1 : threads); }

}  // namespace pipewright
