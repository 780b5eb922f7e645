// defines: CheckpointDir, a folder of numbered checkpoints
// ("ckpt-0000000500.cohort" for step 500): writes new ones, keeps the last
// few, and finds the newest one that verifies.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace cohort {

/// A folder of numbered checkpoint files, one per saved step, written atomically and verified on
/// load (CheckpointError on a bad file). The Trainer uses one on rank 0 and one per rank for
/// shards.
class CheckpointDir {
 public:
  /// Throws CheckpointError when a checkpoint whose file verifies is still
  /// not whole (its distributed part, see dcp_checkpoint.h).
  using Check = std::function<void(int64_t step, const std::string& payload)>;

  /// Creates `dir` (and its parents) when missing. keep_last >= 1. `whole`
  /// (may be empty): what else a checkpoint needs besides a file that
  /// verifies; one that fails it counts for nothing in write()'s rotation
  /// and is skipped by load_latest().
  CheckpointDir(std::string dir, int keep_last, Check whole = {});

  /// The folder.
  const std::string& dir() const { return dir_; }
  /// The file of `step`'s checkpoint in dir() ("ckpt-0000000500.cohort" for step 500).
  std::string path_for(int64_t step) const { return path_in(dir_, step); }
  /// The same in the folder `dir`.
  static std::string path_in(const std::string& dir, int64_t step);

  /// Writes the checkpoint of `step` atomically, then deletes all but the
  /// newest keep_last checkpoints that verify and are whole (never `step`
  /// itself, never one that does not verify or is not whole) and any
  /// temporary files left by crashes.
  void write(int64_t step, const std::string& payload) const;

  /// Steps that have a checkpoint file, newest first (not verified).
  std::vector<int64_t> steps() const;

  /// What load_latest() found.
  struct Loaded {
    /// False when no checkpoint verifies (or none exists).
    bool found = false;
    /// The checkpoint's step (when found).
    int64_t step = 0;
    /// The checkpoint's bytes, verified (when found).
    std::string payload;
    /// One message per newer checkpoint that failed to verify (which file,
    /// what is wrong), newest first, after one per file whose name has a step
    /// out of range.
    std::vector<std::string> skipped;
  };
  /// The newest checkpoint below step `below` that verifies, is whole and
  /// passes `check`, with what was wrong with newer ones.
  Loaded load_latest(const Check& check = {},
                     int64_t below = std::numeric_limits<int64_t>::max()) const;
  /// The payload of `step`'s checkpoint; throws CheckpointError.
  std::string load(int64_t step) const;

 private:
  // Reads and verifies `step`'s file, and whether it is whole, once;
  // remembered afterwards.
  bool verifies(int64_t step) const;

  std::string dir_;
  int keep_last_;
  Check whole_;
  mutable std::set<int64_t> verified_;  // steps known to verify and be whole
};

}  // namespace cohort
