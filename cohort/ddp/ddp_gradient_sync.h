// defines: DDPGradientSync, the GradientSync of a model wrapped in
// cohort::DistributedDataParallel: DDP reduces the gradient buckets during
// backward, no_sync() keeps non-final micro-batches local, and DDP's stats
// give the communication time.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/plan/gradient_sync.h"

namespace cohort {

/// The Trainer's GradientSync for a DistributedDataParallel model: no_sync() for the non-final
/// micro-batches.
template <typename ModuleHolder>
class DDPGradientSync : public GradientSync {
 public:
  /// Syncs through `ddp`, which must outlive it.
  explicit DDPGradientSync(DistributedDataParallel<ModuleHolder>& ddp) : ddp_(ddp) {}

  std::shared_ptr<void> skip_sync() override {
    return std::make_shared<NoSyncGuard>(ddp_.no_sync());
  }
  /// DDP's backward already left averaged gradients on every rank.
  void finish_sync() override {}
  double comm_seconds() const override { return ddp_.stats().total_comm_seconds; }
  /// A stateful comm hook (a compressor with error feedback) is saved per
  /// rank with the checkpoint.
  bool has_state() const override { return ddp_.comm_hook() && ddp_.comm_hook()->stateful(); }
  /// The comm hook's tensors.
  std::map<std::string, torch::Tensor> state() const override { return ddp_.comm_hook()->state(); }
  /// Hands the tensors back to the comm hook.
  void load_state(const std::map<std::string, torch::Tensor>& state) override {
    ddp_.comm_hook()->load_state(state);
  }

 private:
  DistributedDataParallel<ModuleHolder>& ddp_;
};

}  // namespace cohort
