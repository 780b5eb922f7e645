#include "cohort/train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cohort/core/error.h"

namespace cohort {

double lr_at(const LrSchedule& s, int64_t step) {
  if (!s.base_lr) {
    throw InvalidArgument(
        "lr_at: the schedule has no base_lr (the optimizer's rate): pass the peak rate");
  }
  return lr_at(s, step, *s.base_lr);
}

double lr_at(const LrSchedule& s, int64_t step, double peak) {
  if (step < 0) throw InvalidArgument("lr_at: negative step " + std::to_string(step));
  const double base_lr = s.base_lr.value_or(peak);
  if (s.kind == LrScheduleKind::Constant) return base_lr;
  if (s.warmup_steps < 0 || s.total_steps <= s.warmup_steps) {
    throw InvalidArgument("lr_at: warm-up cosine schedule needs 0 <= warmup_steps (" +
                          std::to_string(s.warmup_steps) + ") < total_steps (" +
                          std::to_string(s.total_steps) + ")");
  }
  if (step < s.warmup_steps) {
    // step + 1 so that the first step already moves the weights.
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  const double progress = std::min(
      1.0, static_cast<double>(step - s.warmup_steps) /
               static_cast<double>(s.total_steps - s.warmup_steps));
  const double pi = std::acos(-1.0);
  return s.min_lr + 0.5 * (base_lr - s.min_lr) * (1.0 + std::cos(pi * progress));
}

}  // namespace cohort
