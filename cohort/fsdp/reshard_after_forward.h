// defines: ReshardAfterForward, fully_shard's reshard_after_forward (FSDP2's
// bool or int):
//
//   true    free the full parameters after the unit's forward and gather
//           them again over the shard group for its backward (ZeRO-3);
//   false   keep them until the end of backward (one all-gather per step);
//   N       after forward, keep 1/N of the full parameters, as if sharded
//           over groups of N consecutive ranks of the shard group, and
//           gather them for backward within that group (ZeRO++'s hpZ: the
//           backward's all-gather stays inside a node when N is its size).
//           1 <= N <= the shard group's size and N divides it; N = 1 is
//           false, N = the shard group's size is true (as FSDP2).
#pragma once

#include <cstdint>
#include <string>

#include "cohort/core/error.h"

namespace cohort {

/// fully_shard's reshard_after_forward: a bool or a number of ranks (see the
/// file comment).
class ReshardAfterForward {
 public:
  /// true (the default) or false.
  ReshardAfterForward(bool reshard = true)  // NOLINT: implicit, as FSDP2's bool
      : is_int_(false), flag_(reshard) {}
  /// Reshard to groups of `ranks` ranks (checked by fully_shard against the
  /// shard group's size).
  ReshardAfterForward(int ranks)  // NOLINT: implicit, as FSDP2's int
      : is_int_(true), ranks_(ranks) {}

  /// "true", "false", or the number given.
  std::string to_string() const {
    return is_int_ ? std::to_string(ranks_) : (flag_ ? "true" : "false");
  }
  /// One word for the ranks' agreement: false 0, true 1, an int N 2^32 + N
  /// (distinct from both, whatever N is).
  int64_t code() const { return is_int_ ? (int64_t{1} << 32) + ranks_ : (flag_ ? 1 : 0); }
  /// The value code() encodes.
  static ReshardAfterForward from_code(int64_t code) {
    if (code == 0 || code == 1) return ReshardAfterForward(code == 1);
    return ReshardAfterForward(static_cast<int>(code - (int64_t{1} << 32)));
  }

  /// What the unit does after forward with a shard group of `shard_size`
  /// ranks: 0 keeps the full parameters (false, or N = 1), 1 frees them
  /// (true, or N = shard_size), N >= 2 keeps a shard of groups of N ranks.
  /// InvalidArgument naming `who` unless 1 <= N <= shard_size and N divides
  /// shard_size (the same on every rank once the ranks agreed on N).
  int resolve(int shard_size, const std::string& who) const {
    if (!is_int_) return flag_ ? 1 : 0;
    if (ranks_ < 1 || ranks_ > shard_size || shard_size % ranks_ != 0) {
      throw InvalidArgument(who + ": reshard_after_forward = " + std::to_string(ranks_) +
                            " must be a number of ranks from 1 to the shard group's size (" +
                            std::to_string(shard_size) + ") that divides it, or true or false");
    }
    return ranks_ == 1 ? 0 : ranks_ == shard_size ? 1 : ranks_;
  }

 private:
  bool is_int_;
  bool flag_ = true;
  int ranks_ = 0;
};

}  // namespace cohort
