// defines: CheckpointDir, a folder of numbered checkpoints
// ("ckpt-0000000500.cohort" for step 500): writes new ones, keeps the last
// few, and finds the newest one that verifies.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

/// A folder of numbered checkpoint files: writes them atomically, keeps the newest few, finds the
/// newest that verifies.
class CheckpointDir {
 public:
  /// Creates `dir` (and its parents) when missing. keep_last >= 1.
  CheckpointDir(std::string dir, int keep_last);

  /// The folder.
  const std::string& dir() const { return dir_; }
  /// The file of the checkpoint at `step`.
  std::string path_for(int64_t step) const;

  /// Writes the checkpoint of `step` atomically, then deletes all but the
  /// newest keep_last checkpoints and any temporary files left by crashes.
  void write(int64_t step, const std::string& payload) const;

  /// Steps that have a checkpoint file, newest first (not verified).
  std::vector<int64_t> steps() const;

  /// A checkpoint read back.
  struct Loaded {
    /// False when no checkpoint verifies (or none exists).
    bool found = false;
    /// The step it was written at.
    int64_t step = 0;
    /// Its verified contents.
    std::string payload;
    /// One message per newer checkpoint that failed to verify (which file,
    /// what is wrong), newest first.
    std::vector<std::string> skipped;
  };
  /// The newest checkpoint that verifies, with what was wrong with newer ones.
  Loaded load_latest() const;
  /// The payload of `step`'s checkpoint; throws CheckpointError.
  std::string load(int64_t step) const;

 private:
  std::string dir_;
  int keep_last_;
};

}  // namespace cohort
