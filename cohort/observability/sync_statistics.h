// defines: SyncStatistics (what a gradient synchronizer measured: syncs,
// buckets, time, the share of communication hidden behind computation) and
// SyncRecorder, which the synchronizers (the fused optimizer, ZeRO) feed.
//
// A sync runs from the first bucket issued to the end of the last wait for
// one. The part of it the caller spent blocked in those waits is exposed;
// the rest ran while the caller computed (backward, the optimizer's update
// of earlier buckets), i.e. hidden.
#pragma once

#include <chrono>
#include <cstdint>

namespace cohort {

/// Totals over a synchronizer's life.
struct SyncStatistics {
  int64_t syncs = 0;           ///< gradient synchronizations finished
  int64_t buckets_synced = 0;  ///< buckets reduced over all syncs
  double total_seconds = 0;    ///< sum of first issue to last completion
  double exposed_seconds = 0;  ///< of that, the caller blocked in wait()

  /// total_seconds / syncs (0 before the first sync).
  double average_sync_seconds() const { return syncs ? total_seconds / syncs : 0.0; }
  /// The share of communication hidden behind computation, in [0, 1]
  /// (0 without communication).
  double communication_efficiency() const {
    return total_seconds > 0 ? 1.0 - exposed_seconds / total_seconds : 0.0;
  }
};

/// Feeds SyncStatistics: bucket_issued() at each launch, blocked() around
/// each wait, sync_done() after the last. Not thread-safe: one caller.
class SyncRecorder {
 public:
  /// The clock all durations are measured on.
  using Clock = std::chrono::steady_clock;

  /// A bucket's communication was issued (the first one opens a sync).
  void bucket_issued() {
    if (buckets_ == 0) start_ = Clock::now();
    ++buckets_;
  }
  /// Runs `wait` (a Work::wait call) and counts its time as exposed.
  template <typename Wait>
  void blocked(Wait&& wait) {
    const auto t = Clock::now();
    wait();
    exposed_ += Clock::now() - t;
  }
  /// Closes the sync opened by the first bucket_issued() (no-op if none).
  void sync_done() {
    if (buckets_ == 0) return;
    stats_.syncs += 1;
    stats_.buckets_synced += buckets_;
    stats_.total_seconds += std::chrono::duration<double>(Clock::now() - start_).count();
    stats_.exposed_seconds += std::chrono::duration<double>(exposed_).count();
    abandon();
  }
  /// Drops an open sync without counting it (an iteration never finished).
  void abandon() {
    buckets_ = 0;
    exposed_ = Clock::duration::zero();
  }
  /// The totals so far.
  const SyncStatistics& statistics() const { return stats_; }

 private:
  SyncStatistics stats_;
  int64_t buckets_ = 0;
  Clock::time_point start_;
  Clock::duration exposed_{};
};

}  // namespace cohort
