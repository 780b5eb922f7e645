// defines: DDPGradientSync, the GradientSync of a model wrapped in
// cohort::DistributedDataParallel: DDP reduces the gradient buckets during
// backward, no_sync() keeps non-final micro-batches local, and DDP's stats
// give the communication time.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "cohort/core/error.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/plan/gradient_sync.h"

namespace cohort {

/// The Trainer's GradientSync for a DistributedDataParallel model: no_sync() for the non-final
/// micro-batches.
template <typename ModuleHolder>
class DDPGradientSync : public GradientSync {
 public:
  /// Syncs through `ddp`, which must outlive it.
  explicit DDPGradientSync(DistributedDataParallel<ModuleHolder>& ddp)
      : ddp_(ddp), reduced_(ddp.stats().iterations) {}

  std::shared_ptr<void> skip_sync() override {
    return std::make_shared<NoSyncGuard>(ddp_.no_sync());
  }
  /// DDP's backward already left averaged gradients on every rank; that it
  /// ran is checked: a loss that calls the wrapped module (not DDP's
  /// forward), or a DDP of SyncStrategy::NoSync, reduces nothing, and each
  /// rank would clip and step by its own gradients. InvalidArgument, naming
  /// the rank; the same loss does the same on every rank.
  void finish_sync() override {
    const int64_t reduced = ddp_.stats().iterations;
    if (reduced == reduced_) {
      const auto& comm = *ddp_.reducer().process_group();
      throw InvalidArgument(
          "Trainer over DistributedDataParallel on rank " + std::to_string(comm.rank()) + " of " +
          std::to_string(comm.size()) +
          ": DDP reduced no gradients in this step (the final micro-batch's forward did not run "
          "through DDP, or its strategy is SyncStrategy::NoSync), so each rank would step by its "
          "own gradients. Call the DistributedDataParallel module in the LossFn, not the module "
          "it wraps, and use SyncStrategy::Overlapped or Synchronous");
    }
    reduced_ = reduced;
  }
  double comm_seconds() const override { return ddp_.stats().total_comm_seconds; }
  /// A stateful comm hook (a compressor with error feedback) is saved per
  /// rank with the checkpoint.
  bool has_state() const override { return ddp_.comm_hook() && ddp_.comm_hook()->stateful(); }
  /// The comm hook's tensors, and DDP's bucket layout they are keyed by
  /// (GradientReducer::layout_state, names "ddp_layout...").
  std::map<std::string, torch::Tensor> state() const override {
    auto out = ddp_.comm_hook()->state();
    for (auto& [name, t] : ddp_.reducer().layout_state()) out[name] = t;
    return out;
  }
  /// Refuses (ConfigError) hook state without the layout it is keyed by
  /// (written before the layout was saved with it), or a layout that does
  /// not fit the model.
  void check_state(const std::map<std::string, torch::Tensor>& state) const override {
    const auto [layout, hook] = split(state);
    if (layout.empty() && !hook.empty()) {
      throw ConfigError(
          "DistributedDataParallel on rank " +
          std::to_string(ddp_.reducer().process_group()->rank()) +
          ": the checkpoint holds the comm hook's state without the bucket layout it is keyed by "
          "(an earlier cohort saved none); applied to this run's buckets it could add one "
          "parameter's error feedback to another's gradients: resume from a checkpoint of this "
          "version");
    }
    if (!layout.empty()) ddp_.reducer().check_layout_state(layout);
  }
  /// Adopts the saved bucket layout at once, then hands the rest to the comm hook.
  void load_state(const std::map<std::string, torch::Tensor>& state) override {
    check_state(state);
    const auto [layout, hook] = split(state);
    if (!layout.empty()) ddp_.reducer().load_layout_state(layout);
    ddp_.comm_hook()->load_state(hook);
  }

 private:
  using Tensors = std::map<std::string, torch::Tensor>;
  // DDP's layout entries and the comm hook's.
  static std::pair<Tensors, Tensors> split(const Tensors& state) {
    std::pair<Tensors, Tensors> out;
    for (const auto& [name, t] : state) {
      (name.rfind("ddp_layout", 0) == 0 ? out.first : out.second)[name] = t;
    }
    return out;
  }

  DistributedDataParallel<ModuleHolder>& ddp_;
  int64_t reduced_;  // DDP's reduced iterations at the last finish_sync()
};

}  // namespace cohort
