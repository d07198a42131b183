#include "pipewright/precision.h"

#include <algorithm>
#include <cmath>

namespace pipewright {

LossScaler::LossScaler(const LossScaleOptions& options)
    : options_(options), enabled_(true), scale_(options.initial_scale) {}

absl::Status LossScaler::Validate(const LossScaleOptions& o) {
  auto positive = [](float v) { return std::isfinite(v) && v > 0; };
  if (!positive(o.min_scale) || !positive(o.max_scale) || o.min_scale > o.max_scale) {
    return absl::InvalidArgumentError(absl::StrCat("LossScaleOptions.min_scale and max_scale [",
                                                   o.min_scale, ", ", o.max_scale,
                                                   "] are not a positive range"));
  }
  if (!positive(o.initial_scale) || o.initial_scale < o.min_scale ||
      o.initial_scale > o.max_scale) {
    return absl::InvalidArgumentError(
        absl::StrCat("LossScaleOptions.initial_scale = ", o.initial_scale, ": must lie in [",
                     o.min_scale, ", ", o.max_scale, "]"));
  }
  if (!(o.growth_factor >= 1) || !std::isfinite(o.growth_factor)) {
    return absl::InvalidArgumentError("LossScaleOptions.growth_factor must be >= 1");
  }
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1)) {
    return absl::InvalidArgumentError("LossScaleOptions.backoff_factor must be in (0, 1)");
  }
  if (o.growth_interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("LossScaleOptions.growth_interval = ", o.growth_interval, ": must be >= 1"));
  }
  return absl::OkStatus();
}

bool LossScaler::Update(bool finite) {
  if (!enabled_) return true;
  if (!finite) {
    scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
    good_steps_ = 0;
    ++skipped_steps_;
    return false;
  }
  if (++good_steps_ >= options_.growth_interval) {
    scale_ = std::min(options_.max_scale, scale_ * options_.growth_factor);
    good_steps_ = 0;
  }
  return true;
}

void LossScaler::Restore(float scale, int64_t good_steps, int64_t skipped_steps) {
  scale_ = scale;
  good_steps_ = good_steps;
  skipped_steps_ = skipped_steps;
}

}  // namespace pipewright
