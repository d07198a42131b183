// Deterministic counter-based random numbers: the value at (key, index) never depends on the
// order of calls, so parameters initialise identically on any stage or rank.
#ifndef PIPEWRIGHT_RUNTIME_RANDOM_H_
#define PIPEWRIGHT_RUNTIME_RANDOM_H_

#include <cmath>
#include <cstdint>

namespace pipewright {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t HashCombine(uint64_t a, uint64_t b) { return SplitMix64(a ^ SplitMix64(b)); }

// Uniform in (0, 1).
inline double UniformAt(uint64_t key, uint64_t index) {
  return (static_cast<double>(HashCombine(key, index) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Standard normal by Box-Muller from two uniforms at (key, 2i) and (key, 2i+1).
inline float NormalAt(uint64_t key, uint64_t index) {
  double u1 = UniformAt(key, 2 * index), u2 = UniformAt(key, 2 * index + 1);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace pipewright

#endif  // PIPEWRIGHT_RUNTIME_RANDOM_H_
