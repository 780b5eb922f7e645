// defines: Progress, rank 0's view of training: a progress bar with ETA
// when stdout is a terminal, plain log lines every few steps otherwise (so
// that logs captured by a launcher stay readable) or when COHORT_PROGRESS
// is "lines".
#pragma once

#include <chrono>
#include <cstdint>

#include "cohort/train/metrics_log.h"

namespace cohort {

/// The Trainer's progress output on rank 0: a bar on a terminal, log lines otherwise.
class Progress {
 public:
  /// enabled: rank 0 and the trainer's progress option. total_steps: the
  /// step the run will stop at (for the bar and the ETA). log_every: steps
  /// between log lines when stdout is not a terminal.
  Progress(bool enabled, int64_t first_step, int64_t total_steps, int64_t log_every);
  /// Shows step `m`.
  void update(const StepMetrics& m);
  /// Ends the bar's line; call before printing anything else.
  void finish();

 private:
  bool enabled_;
  bool tty_;
  int64_t first_step_;
  int64_t total_steps_;
  int64_t log_every_;
  bool bar_open_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace cohort
