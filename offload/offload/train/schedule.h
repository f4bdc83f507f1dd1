// The learning-rate schedule and the fp16 loss scaler: small pure state machines, counted in
// samples (not steps) so a run resumed with another number of processes, or another micro-batch,
// keeps the same schedule (shared/reference/engine.md §5).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ucp::offload {

/// Linear warm-up from 0 to `lr` over `warmup_samples`, then a half cosine from `lr` down to
/// `min_lr` at `decay_samples`, then `min_lr`. The step that brings the consumed-sample count to
/// s trains at At(s): the first step of a run with warm-up already moves (Megatron's first step
/// trains at lr 0).
struct LrSchedule {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_samples = 0;
  int64_t decay_samples = 0;  ///< <= warmup_samples: constant lr after warm-up

  double At(int64_t samples) const {
    if (warmup_samples > 0 && samples < warmup_samples) {
      return lr * static_cast<double>(samples) / static_cast<double>(warmup_samples);
    }
    if (decay_samples <= warmup_samples) return lr;
    if (samples >= decay_samples) return min_lr;
    const double progress = static_cast<double>(samples - warmup_samples) /
                            static_cast<double>(decay_samples - warmup_samples);
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
};

/// Dynamic loss scaling for fp16 (DeepSpeed's and Megatron's rule): a step whose scaled gradients
/// overflow is skipped and the scale halves (not below min_scale); after `window` clean steps in
/// a row the scale doubles. bf16 and fp32 use a constant scale of 1 (enabled = false), and a step
/// with non-finite gradients is still skipped.
struct LossScaler {
  bool enabled = false;
  double scale = 1.0;
  double min_scale = 1.0;
  int64_t window = 1000;
  int64_t good_steps = 0;  ///< clean steps since the last change

  /// Records a step's outcome; returns true when the step may be applied.
  bool Update(bool overflow) {
    if (overflow) {
      if (enabled) scale = std::max(min_scale, scale * 0.5);
      good_steps = 0;
      return false;
    }
    if (enabled && ++good_steps >= window) {
      scale *= 2.0;
      good_steps = 0;
    }
    return true;
  }
};

}  // namespace ucp::offload
