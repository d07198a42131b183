// Training precision. fp32 runs everything in f32. bf16 and fp16 are mixed precision: every
// matrix product (the Linear layers: attention's qkv and projection, the MLP, the LM head)
// takes 16-bit inputs with fp32 accumulation and an fp32 result, as tensor cores do, and
// keeps its saved activations in 16 bits; master weights, gradients, their accumulation across
// micro-batches, the optimizer state and every other op (LayerNorm, softmax, GELU, residuals,
// the loss) stay fp32. The same rules hold on the CPU and on CUDA, so mixed precision is
// tested without a GPU (docs/precision.md).
//
// fp16 also needs dynamic loss scaling (its 5 exponent bits underflow small gradients): the
// loss gradient is multiplied by LossScaler::scale(), the weight gradients are divided by it
// before clipping, and a step whose gradients or loss are not all finite ON ANY RANK is
// skipped everywhere (weights and optimizer state untouched), the scale backing off; after
// `growth_interval` finite steps in a row the scale grows.
#ifndef PIPEWRIGHT_PRECISION_H_
#define PIPEWRIGHT_PRECISION_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "pipewright/precision_kind.h"
#include "pipewright/tensor.h"

namespace pipewright {

// The dtype matrix-product inputs are rounded to.
constexpr DType ComputeDType(Precision p) {
  return p == Precision::kBf16 ? DType::kBF16 : p == Precision::kFp16 ? DType::kF16 : DType::kF32;
}

struct LossScaleOptions {
  float initial_scale = 65536.0f;  // 2^16, PyTorch's GradScaler and Megatron default
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 1000;  // finite steps in a row before the scale grows
  float min_scale = 1.0f;
  float max_scale = 16777216.0f;  // 2^24
};

// Dynamic loss scaling state. Disabled (scale 1, nothing is ever skipped by it) unless built
// with options; the runtime enables it for fp16 only.
class LossScaler {
 public:
  LossScaler() = default;
  explicit LossScaler(const LossScaleOptions& options);

  // Checks the options (factors, interval, bounds); errors name the field.
  static absl::Status Validate(const LossScaleOptions& options);

  bool enabled() const { return enabled_; }
  float scale() const { return scale_; }
  int64_t good_steps() const { return good_steps_; }        // finite steps since the last change
  int64_t skipped_steps() const { return skipped_steps_; }  // over the whole run

  // After a step's agreement: `finite` is false when any rank saw a non-finite loss or
  // gradient. Returns true when the step must be applied (always true when disabled).
  bool Update(bool finite);

  // For checkpoints.
  void Restore(float scale, int64_t good_steps, int64_t skipped_steps);

 private:
  LossScaleOptions options_;
  bool enabled_ = false;
  float scale_ = 1.0f;
  int64_t good_steps_ = 0;
  int64_t skipped_steps_ = 0;
};

}  // namespace pipewright

#endif  // PIPEWRIGHT_PRECISION_H_
