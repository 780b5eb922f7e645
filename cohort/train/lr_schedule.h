// defines: LrSchedule (constant, or linear warm-up then cosine decay) and
// lr_at(schedule, step), a pure function of the optimizer step.
//
// Because the rate is a function of the step alone, a checkpoint needs only
// the step to restore the schedule, and resume cannot drift.
//
// The Trainer applies a schedule as PyTorch's LambdaLR does: it scales each
// parameter group's own initial rate (the group's lr when the Trainer was
// made, kept in its checkpoints) by the schedule's factor at the step,
// lr_at(schedule, step, peak) / peak, where peak is base_lr, or the first
// group's initial rate when base_lr is unset. With one rate for every group
// (the usual case) each group's rate is lr_at(schedule, step, that rate).
#pragma once

#include <cstdint>
#include <optional>

namespace cohort {

/// How the learning rate follows the step (lr_at()).
enum class LrScheduleKind { Constant, WarmupCosine };

/// The learning rate as a function of the step (lr_at()).
struct LrSchedule {
  /// Constant: always the peak. WarmupCosine: linear warm-up, then cosine.
  LrScheduleKind kind = LrScheduleKind::Constant;
  /// The peak rate. Unset (the default): each parameter group's own rate
  /// when the Trainer was made, so groups with different rates keep their
  /// ratios. Set: every group's peak is this rate, replacing the optimizer's
  /// (the Trainer refuses it, InvalidArgument, when the groups' rates differ).
  std::optional<double> base_lr;
  /// WarmupCosine: steps of linear warm-up, lr = peak * (step + 1) / warmup_steps.
  int64_t warmup_steps = 0;
  /// WarmupCosine: step at which the cosine reaches min_lr (and stays there).
  int64_t total_steps = 0;
  /// WarmupCosine: the rate at the end of the decay of a group whose peak is
  /// base_lr (unset: the first group's initial rate); every other group ends
  /// at the same fraction min_lr / peak of its own peak.
  double min_lr = 0.0;
};

/// The rate for optimizer step `step` (0-based: the first step is 0) of a
/// group whose peak is `peak` (schedule.base_lr when set, else `peak`).
/// Throws InvalidArgument for a malformed schedule (negative steps, or
/// total_steps not past warmup_steps for WarmupCosine).
double lr_at(const LrSchedule& schedule, int64_t step, double peak);

/// lr_at with the schedule's base_lr, which must be set (InvalidArgument otherwise).
double lr_at(const LrSchedule& schedule, int64_t step);

}  // namespace cohort
