// Timing helpers shared by the benchmark suites.
#ifndef PIPEWRIGHT_BENCH_BENCH_UTIL_H_
#define PIPEWRIGHT_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <vector>

#include "absl/time/clock.h"

namespace pipewright::bench {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Median wall time of `reps` calls of fn after one untimed warm-up call.
template <typename Fn>
double MedianSeconds(int reps, Fn&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    absl::Time s = absl::Now();
    fn();
    t.push_back(absl::ToDoubleSeconds(absl::Now() - s));
  }
  return Median(std::move(t));
}

}  // namespace pipewright::bench

#endif  // PIPEWRIGHT_BENCH_BENCH_UTIL_H_
