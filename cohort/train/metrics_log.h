// defines: StepMetrics (what one optimizer step reports) and MetricsLog,
// which appends JSON lines to a file (one object per line, rank 0 only).
//
// Lines have "kind": "train" (per step) or "eval" (whatever the caller
// measured, e.g. test accuracy). cohort-plot reads this file.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace cohort {

/// What one optimizer step reports; the Trainer fills it on every rank and logs it on rank 0.
struct StepMetrics {
  int64_t step = 0;            ///< optimizer steps done, this one included
  int64_t epoch = 0;           ///< epoch the step belongs to (0-based)
  double loss = 0.0;           ///< mean loss over the step's samples of all ranks
  double lr = 0.0;             ///< learning rate used by this step
  double grad_norm = 0.0;      ///< global L2 gradient norm before clipping
  bool clipped = false;        ///< whether clipping scaled the gradients
  int64_t samples = 0;         ///< samples in this step over all ranks
  double step_seconds = 0.0;   ///< wall time of the step on this rank
  double samples_per_s = 0.0;  ///< samples / step_seconds
  double comm_seconds = 0.0;   ///< gradient communication time in this step
  /// Seconds this rank was blocked in tensor parallelism's collectives during the step's
  /// forwards and backwards (the activations' all-reduces and all-gathers, their gradients'
  /// conjugates, the vocabulary-parallel loss), which comm_seconds leaves out; set when the
  /// wiring has a "tp" dimension (a mesh), absent otherwise.
  std::optional<double> tp_comm_seconds;
  int64_t comm_bytes = 0;  ///< bytes this rank sent in this step (Communicator::stats)
  /// The part of comm_bytes sent over each dimension's groups ("tp", "pp", "dp", and a mesh's
  /// "ep" and "cp") when the wiring names them (a pipeline, a mesh); logged as
  /// "comm_bytes_<dimension>".
  std::map<std::string, int64_t> comm_bytes_by_dimension;
};

nlohmann::json to_json(const StepMetrics& m);

/// Appends whole lines: a line that cannot be written entirely (a full disk)
/// is cut back off the file, so the file never holds half a line. A failed
/// write prints one warning and the job goes on, or throws Error when
/// `strict`.
class MetricsLog {
 public:
  /// Disabled (writes nothing) when `path` is empty or `enabled` is false:
  /// pass enabled = (rank == 0).
  MetricsLog(std::string path, bool enabled, bool strict = false);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  /// Whether lines are written (a non-empty path on the enabled rank).
  bool enabled() const { return enabled_; }
  /// Keeps only lines whose "step" is at most `step` (all lines are dropped
  /// for a negative step): a resumed job rewrites the steps it redoes instead
  /// of logging them twice.
  void keep_until(int64_t step);
  /// Appends one line with one write (no buffering), whole or not at all.
  void append(const nlohmann::json& line);
  /// Lines that could not be written.
  int64_t lines_lost() const { return lines_lost_; }

 private:
  // Writes `text` at the end of the file; on failure cuts the file back to
  // where it was and reports (warning or Error).
  void write_whole(const std::string& text);
  void failed(const std::string& what);
  void close();

  std::string path_;
  bool enabled_;
  bool strict_;
  int fd_ = -1;
  bool warned_ = false;
  int64_t lines_lost_ = 0;
};

}  // namespace cohort
