// defines: GroupFailure, the Worker's part that holds the first error of
// its group: every later operation fails with it (the peers' state is
// unknown after a failed collective).
//
// Locking rule: mu_ guards why_ and mismatch_, and is held only to copy
// them (never across a call out); failed_ is stored with release after
// them, so a hot path reads failed() without the lock.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "cohort/core/error.h"

namespace cohort::ucx {

class GroupFailure {
 public:
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Records `why` unless the group failed already (the first error wins):
  // a MismatchError when `mismatch`, else a PeerError.
  void fail(const std::string& why, bool mismatch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!why_.empty()) return;
    why_ = why;
    mismatch_ = mismatch;
    failed_.store(true, std::memory_order_release);
  }
  [[noreturn]] void rethrow() const {
    std::string why;
    bool mismatch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      why = why_;
      mismatch = mismatch_;
    }
    if (mismatch) throw MismatchError(why);
    throw PeerError(why);
  }

 private:
  mutable std::mutex mu_;
  std::string why_;
  bool mismatch_ = false;
  std::atomic<bool> failed_{false};
};

}  // namespace cohort::ucx
