// defines: StepMetrics (what one optimizer step reports) and MetricsLog,
// which appends JSON lines to a file (one object per line, rank 0 only).
//
// Lines have "kind": "train" (per step) or "eval" (whatever the caller
// measured, e.g. test accuracy). cohort-plot reads this file.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace cohort {

struct StepMetrics {
  int64_t step = 0;            // optimizer steps done, this one included
  int64_t epoch = 0;           // epoch the step belongs to (0-based)
  double loss = 0.0;           // mean micro-batch loss, averaged over ranks
  double lr = 0.0;             // learning rate used by this step
  double grad_norm = 0.0;      // global L2 gradient norm before clipping
  bool clipped = false;        // whether clipping scaled the gradients
  int64_t samples = 0;         // samples in this step over all ranks
  double step_seconds = 0.0;   // wall time of the step on this rank
  double samples_per_s = 0.0; // samples / step_seconds
  double comm_seconds = 0.0;   // gradient communication time in this step
  int64_t comm_bytes = 0;      // bytes this rank sent in this step (Communicator::stats)
};

nlohmann::json to_json(const StepMetrics& m);

class MetricsLog {
 public:
  // Disabled (writes nothing) when `path` is empty or `enabled` is false:
  // pass enabled = (rank == 0).
  MetricsLog(std::string path, bool enabled);

  bool enabled() const { return enabled_; }
  // Keeps only lines whose "step" is at most `step` (all lines are dropped
  // for a negative step): a resumed job rewrites the steps it redoes instead
  // of logging them twice.
  void keep_until(int64_t step);
  // Appends one line and flushes it.
  void append(const nlohmann::json& line);

 private:
  std::string path_;
  bool enabled_;
  std::ofstream out_;
};

}  // namespace cohort
