// defines: LrSchedule (constant, or linear warm-up then cosine decay) and
// lr_at(schedule, step), a pure function of the optimizer step.
//
// Because the rate is a function of the step alone, a checkpoint needs only
// the step to restore the schedule, and resume cannot drift.
#pragma once

#include <cstdint>

namespace cohort {

enum class LrScheduleKind { Constant, WarmupCosine };

/// The learning rate as a function of the step (lr_at()).
struct LrSchedule {
  /// Constant: always base_lr. WarmupCosine: linear warm-up, then cosine.
  LrScheduleKind kind = LrScheduleKind::Constant;
  /// Peak rate (the optimizer's lr).
  double base_lr = 1e-3;
  /// WarmupCosine: steps of linear warm-up, lr = base_lr * (step + 1) / warmup_steps.
  int64_t warmup_steps = 0;
  /// WarmupCosine: step at which the cosine reaches min_lr (and stays there).
  int64_t total_steps = 0;
  /// WarmupCosine: rate at the end of the decay.
  double min_lr = 0.0;
};

/// The rate for optimizer step `step` (0-based: the first step is 0).
/// Throws InvalidArgument for a malformed schedule (negative steps, or
/// total_steps not past warmup_steps for WarmupCosine).
double lr_at(const LrSchedule& schedule, int64_t step);

}  // namespace cohort
