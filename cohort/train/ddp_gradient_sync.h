// defines: DDPGradientSync, the GradientSync of a model wrapped in
// cohort::DistributedDataParallel: DDP reduces the gradient buckets during
// backward, no_sync() keeps non-final micro-batches local, and DDP's stats
// give the communication time.
#pragma once

#include <torch/serialize/archive.h>

#include <map>
#include <memory>
#include <string>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/gradient_sync.h"

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
  /// A stateful comm hook (a compressor with error feedback) is saved in
  /// each rank's checkpoint shard, its tensors under "comm_hook_".
  bool has_state() const override { return ddp_.comm_hook() && ddp_.comm_hook()->stateful(); }
  /// Writes the comm hook's tensors under "comm_hook_<name>".
  void save_state(torch::serialize::OutputArchive& archive) const override {
    for (auto& [name, t] : ddp_.comm_hook()->state()) archive.write(kPrefix + name, t);
  }
  /// Hands the "comm_hook_" tensors of the archive back to the comm hook.
  void load_state(torch::serialize::InputArchive& archive) override {
    std::map<std::string, torch::Tensor> state;
    for (const auto& key : archive.keys()) {
      if (key.rfind(kPrefix, 0) != 0) continue;
      torch::Tensor t;
      archive.read(key, t);
      state[key.substr(kPrefix.size())] = t;
    }
    ddp_.comm_hook()->load_state(state);
  }

 private:
  inline static const std::string kPrefix = "comm_hook_";
  DistributedDataParallel<ModuleHolder>& ddp_;
};

}  // namespace cohort
