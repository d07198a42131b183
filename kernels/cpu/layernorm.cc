// LayerNorm over the last dimension, with saved mean / rstd for backward.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"

namespace pipewright::cpu {

void LayerNormForward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                      float* rstd, int rows, int cols, float eps) {
  const double inv_n = 1.0 / cols;
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * cols;
    float* yr = y + static_cast<size_t>(r) * cols;
    double sum = 0.0;
    for (int c = 0; c < cols; ++c) sum += xr[c];
    const float mu = static_cast<float>(sum * inv_n);
    double sq = 0.0;  // two-pass variance: no cancellation for rows with a large mean
    for (int c = 0; c < cols; ++c) {
      const double d = static_cast<double>(xr[c]) - mu;
      sq += d * d;
    }
    const float rs = static_cast<float>(1.0 / std::sqrt(sq * inv_n + eps));
    for (int c = 0; c < cols; ++c) yr[c] = (xr[c] - mu) * rs * gamma[c] + beta[c];
    mean[r] = mu;
    rstd[r] = rs;
  }
}

void LayerNormBackwardInput(const float* x, const float* gamma, const float* mean,
                            const float* rstd, const float* dy, float* dx, int rows, int cols) {
  const float inv_n = 1.0f / static_cast<float>(cols);
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * cols;
    const float* dyr = dy + static_cast<size_t>(r) * cols;
    float* dxr = dx + static_cast<size_t>(r) * cols;
    const float mu = mean[r], rs = rstd[r];
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int c = 0; c < cols; ++c) {
      const float g = dyr[c] * gamma[c];
      const float xhat = (xr[c] - mu) * rs;
      sum_g += g;
      sum_gx += g * xhat;
    }
    const float mean_g = sum_g * inv_n, mean_gx = sum_gx * inv_n;
    for (int c = 0; c < cols; ++c) {
      const float g = dyr[c] * gamma[c];
      const float xhat = (xr[c] - mu) * rs;
      dxr[c] = rs * (g - mean_g - xhat * mean_gx);
    }
  }
}

void LayerNormBackwardWeight(const float* x, const float* mean, const float* rstd, const float* dy,
                             float* dgamma, float* dbeta, int rows, int cols) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * cols;
    const float* dyr = dy + static_cast<size_t>(r) * cols;
    const float mu = mean[r], rs = rstd[r];
    for (int c = 0; c < cols; ++c) {
      dgamma[c] += dyr[c] * (xr[c] - mu) * rs;
      dbeta[c] += dyr[c];
    }
  }
}

}  // namespace pipewright::cpu
