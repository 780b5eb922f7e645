// defines: NoSyncGuard, the RAII scope of DistributedDataParallel::no_sync():
// while it lives, backward accumulates gradients locally (no communication);
// the first backward after it reduces the accumulated sum.
#pragma once

#include "cohort/ddp/gradient_reducer.h"

namespace cohort {

/// While it lives, backward passes accumulate gradients locally without reducing them
/// (DistributedDataParallel::no_sync()).
class NoSyncGuard {
 public:
  /// Enters a no_sync() region of `reducer`.
  explicit NoSyncGuard(GradientReducer& reducer) : reducer_(&reducer) {
    reducer_->push_no_sync();
  }
  ~NoSyncGuard() {
    if (reducer_) reducer_->pop_no_sync();
  }
  /// Takes over `other`'s region.
  NoSyncGuard(NoSyncGuard&& other) noexcept : reducer_(other.reducer_) {
    other.reducer_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  GradientReducer* reducer_;
};

}  // namespace cohort
