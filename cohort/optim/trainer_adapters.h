// defines: FusedTrainerOptimizer and ZeroTrainerOptimizer, the
// TrainerOptimizer adapters (cohort/plan/trainer_optimizer.h) of the
// distributed optimizers, and InStepGradientSync, the trainer's gradient
// sync for an optimizer that averages the gradients itself.
//
// Which sync goes with which optimizer:
//   - ZeRO (stage 1 or 2) with cohort DDP: DDPGradientSync. At stage 1 DDP
//     averages in backward and ZeRO steps its shard; at stage 2 DDP hands
//     its reduction to ZeRO (reduce-scatter into the shards) and no_sync()
//     keeps the non-final micro-batches local as usual;
//   - FusedDistributedOptimizer, or ZeRO alone: InStepGradientSync (the
//     trainer's sync does not communicate; ZeRO-2's non-final micro-batches
//     run under its no_sync()).
// Clipping: the trainer asks gradients() for the averaged gradients before
// the step. The fused optimizer averages them there (its all-reduce then no
// longer overlaps its update); ZeRO finishes its reduction and answers its
// shard's pieces, a disjoint part of the gradients on each rank, so the
// trainer measures with ShardedGradNorm (squared partial norms all-reduced)
// and each rank clips its own part.
// Both checkpoint through the wiring's dcp state dict
// (cohort/dcp/state_dict/state_dict.h), not through these adapters.
#pragma once

#include <memory>
#include <vector>

#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/plan/gradient_sync.h"
#include "cohort/plan/trainer_optimizer.h"

namespace cohort {

/// FusedDistributedOptimizer as the Trainer's optimizer.
class FusedTrainerOptimizer : public TrainerOptimizer {
 public:
  /// Adapts `optimizer`, which must outlive it.
  explicit FusedTrainerOptimizer(FusedDistributedOptimizer& optimizer) : optimizer_(optimizer) {}
  void zero_grad() override { optimizer_.zero_grad(); }
  void step() override { optimizer_.step(); }
  /// One group: the AdamW options' rate.
  std::vector<double> lrs() const override { return {optimizer_.options().lr()}; }
  void set_lrs(const std::vector<double>& lrs) override { optimizer_.set_lr(lrs.at(0)); }
  /// The .grad (views into the buckets) hold the averages afterwards.
  std::vector<torch::Tensor> gradients(const std::vector<torch::Tensor>& model_params) override {
    optimizer_.finish_gradients();
    return model_params;
  }
  /// Seconds of the optimizer's gradient all-reduces (its sync statistics).
  double comm_seconds() const override { return optimizer_.sync_statistics().total_seconds; }

 private:
  FusedDistributedOptimizer& optimizer_;
};

/// ZeroRedundancyOptimizer as the Trainer's optimizer (sharded state and gradients).
class ZeroTrainerOptimizer : public TrainerOptimizer {
 public:
  /// Adapts `optimizer`, which must outlive it.
  explicit ZeroTrainerOptimizer(ZeroRedundancyOptimizer& optimizer) : optimizer_(optimizer) {}
  void zero_grad() override { optimizer_.zero_grad(); }
  void step() override { optimizer_.step(); }
  /// The caller's groups (the inner optimizer's, index for index).
  std::vector<double> lrs() const override { return group_lrs(optimizer_.param_groups()); }
  void set_lrs(const std::vector<double>& lrs) override {
    set_group_lrs(optimizer_.param_groups(), lrs);
  }
  /// The shard's pieces, whose .grad are this rank's averaged gradients.
  std::vector<torch::Tensor> gradients(const std::vector<torch::Tensor>&) override {
    optimizer_.finish_gradients();
    return optimizer_.shard_pieces();
  }
  bool sharded_gradients() const override { return true; }
  /// Seconds of the optimizer's gradient reductions (its sync statistics).
  double comm_seconds() const override { return optimizer_.sync_statistics().total_seconds; }

 private:
  ZeroRedundancyOptimizer& optimizer_;
};

/// The trainer's sync for FusedDistributedOptimizer or ZeRO without DDP:
/// the optimizer averages in its step (or in gradients()), so this never
/// communicates; comm_seconds() is 0 (the optimizer adapter reports the
/// time, which the trainer adds).
class InStepGradientSync : public GradientSync {
 public:
  /// The fused optimizer: autograd accumulates into its buckets as it is.
  InStepGradientSync() = default;
  /// ZeRO alone: non-final micro-batches run under its no_sync().
  explicit InStepGradientSync(ZeroRedundancyOptimizer& zero) : zero_(&zero) {}
  std::shared_ptr<void> skip_sync() override {
    if (!zero_) return nullptr;
    return std::make_shared<ZeroRedundancyOptimizer::NoSync>(zero_->no_sync());
  }
  void finish_sync() override {}
  double comm_seconds() const override { return 0.0; }

 private:
  ZeroRedundancyOptimizer* zero_ = nullptr;
};

}  // namespace cohort
