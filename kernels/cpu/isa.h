// Run-time instruction-set selection for the CPU kernels (internal).
//
// The default build targets baseline x86-64 (or aarch64), so a kernel that wants AVX2 or AVX-512
// is compiled as extra variants with GCC target attributes and chosen per call from
// KernelIsa(), which the CPU's features decide once per process (cpu.h). The pattern:
//
//   // The body, written once: plain loops the compiler vectorises for the caller's target.
//   PW_KERNEL_BODY void GeluBody(const float* x, float* y, size_t n) { ... }
//   PW_TARGET_AVX512 void GeluAvx512(const float* x, float* y, size_t n) { GeluBody(x, y, n); }
//   PW_TARGET_AVX2 void GeluAvx2(const float* x, float* y, size_t n) { GeluBody(x, y, n); }
//   void Gelu(const float* x, float* y, size_t n) {
//     PW_DISPATCH(GeluAvx512, GeluAvx2, GeluBody)(x, y, n);
//   }
//
// An always-inline body with no target of its own inlines into each variant and is compiled
// for that variant's instruction set; hand-written intrinsics go in the variant itself.
// Variants may round differently from each other (FMA contraction, vector reductions), so one
// process always uses one ISA: every rank then computes identical bits.
#ifndef PIPEWRIGHT_KERNELS_CPU_ISA_H_
#define PIPEWRIGHT_KERNELS_CPU_ISA_H_

namespace pipewright::cpu {

enum class Isa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest ISA this CPU supports, or a narrower one forced by the environment variable
// PIPEWRIGHT_CPU_ISA=baseline|avx2|avx512 (for tests and benchmarks; a wider one than the CPU
// supports is ignored). Decided once per process.
Isa KernelIsa();
const char* IsaName(Isa isa);  // "baseline", "avx2", "avx512"

}  // namespace pipewright::cpu

#define PW_KERNEL_BODY static inline __attribute__((always_inline))
#if defined(__x86_64__) || defined(__i386__)
#define PW_HAVE_X86_VARIANTS 1
#define PW_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define PW_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")))
// The variant for KernelIsa(): PW_DISPATCH(avx512_fn, avx2_fn, baseline_fn).
#define PW_DISPATCH(avx512, avx2, baseline)                                     \
  (::pipewright::cpu::KernelIsa() == ::pipewright::cpu::Isa::kAvx512 ? (avx512) \
   : ::pipewright::cpu::KernelIsa() == ::pipewright::cpu::Isa::kAvx2 ? (avx2)   \
                                                                     : (baseline))
#else
#define PW_HAVE_X86_VARIANTS 0
#define PW_DISPATCH(avx512, avx2, baseline) (baseline)
#endif

#endif  // PIPEWRIGHT_KERNELS_CPU_ISA_H_
