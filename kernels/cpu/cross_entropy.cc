// Fused softmax + cross-entropy, stable: max-subtracted exponentials, log-sum-exp in double.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"

namespace pipewright::cpu {
namespace {

inline float RowMax(const float* row, int vocab) {
  float mx = row[0];
  for (int j = 1; j < vocab; ++j) mx = row[j] > mx ? row[j] : mx;
  return mx;
}

inline double SumExp(const float* row, int vocab, float mx) {
  double sum = 0.0;
  for (int j = 0; j < vocab; ++j) sum += static_cast<double>(std::exp(row[j] - mx));
  return sum;
}

}  // namespace

double SoftmaxCrossEntropyForward(const float* logits, const int32_t* targets, int rows, int vocab,
                                  int64_t* count) {
  double total = 0.0;
  int64_t n = 0;
  for (int r = 0; r < rows; ++r) {
    const int32_t t = targets[r];
    if (t < 0) continue;
    const float* row = logits + static_cast<size_t>(r) * vocab;
    const float mx = RowMax(row, vocab);
    const double lse = std::log(SumExp(row, vocab, mx)) + static_cast<double>(mx);
    total += lse - static_cast<double>(row[t]);
    ++n;
  }
  if (count != nullptr) *count = n;
  return total;
}

void SoftmaxCrossEntropyBackward(const float* logits, const int32_t* targets, int rows, int vocab,
                                 float scale, float* dlogits) {
  for (int r = 0; r < rows; ++r) {
    const int32_t t = targets[r];
    const float* row = logits + static_cast<size_t>(r) * vocab;
    float* drow = dlogits + static_cast<size_t>(r) * vocab;
    if (t < 0) {
      for (int j = 0; j < vocab; ++j) drow[j] = 0.0f;
      continue;
    }
    const float mx = RowMax(row, vocab);
    const float k = static_cast<float>(scale / SumExp(row, vocab, mx));
    for (int j = 0; j < vocab; ++j) drow[j] = std::exp(row[j] - mx) * k;
    drow[t] -= scale;
  }
}

}  // namespace pipewright::cpu
