// defines: TrainerOptimizer (the seam between the trainer and an optimizer)
// and TorchOptimizer (any torch::optim::Optimizer: AdamW, SGD, ...).
//
// The fused optimizer and ZeRO plug in here (cohort/optim/trainer_adapters.h).
// The trainer checkpoints every optimizer's state through the plan's dcp
// state dict (TrainingPlan::dcp_state_dict), not through this seam.
// Optimizers that average the gradients inside step() (fused, ZeRO stage 2)
// average them in gradients() instead, which the trainer calls before
// clipping.
#pragma once

#include <torch/optim/optimizer.h>

#include <vector>

namespace cohort {

/// The optimizer interface the Trainer drives (TorchOptimizer, FusedTrainerOptimizer,
/// ZeroTrainerOptimizer).
class TrainerOptimizer {
 public:
  virtual ~TrainerOptimizer() = default;
  /// Clears the gradients.
  virtual void zero_grad() = 0;
  /// Applies one update.
  virtual void step() = 0;
  /// Each parameter group's learning rate, in group order.
  virtual std::vector<double> lrs() const = 0;
  /// Sets each parameter group's learning rate (as many as lrs() has, in its order).
  virtual void set_lrs(const std::vector<double>& lrs) = 0;
  /// Called after the trainer's gradient sync, before step(): the tensors
  /// whose .grad are the averaged gradients, which the trainer measures and
  /// clips. By default the model's parameters (DDP or the all-reduce sync
  /// averaged them). An optimizer that averages inside step() finishes its
  /// reduction here and returns where the averages are (ZeRO: its shard).
  virtual std::vector<torch::Tensor> gradients(const std::vector<torch::Tensor>& model_params) {
    return model_params;
  }
  /// True when gradients() returns a disjoint part of the gradients on each
  /// rank (ZeRO): the trainer's default norm is then ShardedGradNorm.
  virtual bool sharded_gradients() const { return false; }
  /// True when step() sends nothing (a LibTorch optimizer's): a rank whose
  /// step() threw can still meet the others in the Trainer's loss all-reduce,
  /// which tells them. False: the exception leaves at once.
  virtual bool local_step() const { return false; }
  /// Seconds the optimizer spent reducing gradients itself since
  /// construction (the fused optimizer, ZeRO); 0 when it does not.
  virtual double comm_seconds() const { return 0.0; }
};

/// Each group's learning rate.
inline std::vector<double> group_lrs(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<double> out;
  for (const auto& group : groups) out.push_back(group.options().get_lr());
  return out;
}
/// Sets group i's learning rate to lrs[i] (one per group).
inline void set_group_lrs(std::vector<torch::optim::OptimizerParamGroup>& groups,
                          const std::vector<double>& lrs) {
  for (size_t i = 0; i < groups.size() && i < lrs.size(); ++i) groups[i].options().set_lr(lrs[i]);
}

/// Any LibTorch optimizer (SGD, AdamW, ...) as the Trainer's optimizer.
class TorchOptimizer : public TrainerOptimizer {
 public:
  /// Adapts `optimizer`, which must outlive it.
  explicit TorchOptimizer(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {}
  void zero_grad() override { optimizer_.zero_grad(); }
  void step() override { optimizer_.step(); }
  bool local_step() const override { return true; }
  std::vector<double> lrs() const override { return group_lrs(optimizer_.param_groups()); }
  void set_lrs(const std::vector<double>& lrs) override {
    set_group_lrs(optimizer_.param_groups(), lrs);
  }

 private:
  torch::optim::Optimizer& optimizer_;
};

}  // namespace cohort
