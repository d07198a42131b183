// Helpers shared by the CPU kernel tests.
#ifndef PIPEWRIGHT_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define PIPEWRIGHT_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace pipewright::kernel_test {

// n floats uniform in [lo, hi), the same for the same seed.
inline std::vector<float> RandomVec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// v rounded to bfloat16 (is_bf16) or IEEE half bits.
inline std::vector<uint16_t> To16Bits(bool is_bf16, const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  if (is_bf16) {
    cpu::FloatToBf16(v.data(), bits.data(), v.size());
  } else {
    cpu::FloatToHalf(v.data(), bits.data(), v.size());
  }
  return bits;
}

}  // namespace pipewright::kernel_test

#endif  // PIPEWRIGHT_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
