// defines: DdpGradientSync, the GradientSync of a model wrapped in
// cohort::DistributedDataParallel: DDP reduces the gradient buckets during
// backward, no_sync() keeps non-final micro-batches local, and DDP's stats
// give the communication time.
#pragma once

#include <memory>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/gradient_sync.h"

namespace cohort {

/// The Trainer's GradientSync for a DistributedDataParallel model: no_sync() for the non-final
/// micro-batches.
template <typename ModuleHolder>
class DdpGradientSync : public GradientSync {
 public:
  /// Syncs through `ddp`, which must outlive it.
  explicit DdpGradientSync(DistributedDataParallel<ModuleHolder>& ddp) : ddp_(ddp) {}

  std::shared_ptr<void> skip_sync() override {
    return std::make_shared<NoSyncGuard>(ddp_.no_sync());
  }
  /// DDP's backward already left averaged gradients on every rank.
  void finish_sync() override {}
  double comm_seconds() const override { return ddp_.stats().total_comm_seconds; }

 private:
  DistributedDataParallel<ModuleHolder>& ddp_;
};

}  // namespace cohort
