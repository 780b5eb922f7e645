// defines: NoSyncGuard, the RAII scope of DistributedDataParallel::no_sync():
// while it lives, backward accumulates gradients locally (no communication);
// the first backward after it reduces the accumulated sum.
#pragma once

#include "cohort/ddp/gradient_reducer.h"

namespace cohort {

class NoSyncGuard {
 public:
  explicit NoSyncGuard(GradientReducer& reducer) : reducer_(&reducer) {
    reducer_->push_no_sync();
  }
  ~NoSyncGuard() {
    if (reducer_) reducer_->pop_no_sync();
  }
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
