// Token + learned position embedding.
#include "kernels/cpu/cpu_kernels.h"

namespace pipewright::cpu {

void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* out, int B,
                      int T, int C) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const size_t bt = static_cast<size_t>(b) * T + t;
      const float* tok = wte + static_cast<size_t>(tokens[bt]) * C;
      const float* pos = wpe + static_cast<size_t>(t) * C;
      float* o = out + bt * C;
      for (int c = 0; c < C; ++c) o[c] = tok[c] + pos[c];
    }
  }
}

void EmbeddingBackward(const float* dout, const int32_t* tokens, float* dwte, float* dwpe, int B,
                       int T, int C) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const size_t bt = static_cast<size_t>(b) * T + t;
      const float* d = dout + bt * C;
      float* tok = dwte + static_cast<size_t>(tokens[bt]) * C;
      float* pos = dwpe + static_cast<size_t>(t) * C;
      for (int c = 0; c < C; ++c) tok[c] += d[c];
      for (int c = 0; c < C; ++c) pos[c] += d[c];
    }
  }
}

}  // namespace pipewright::cpu
