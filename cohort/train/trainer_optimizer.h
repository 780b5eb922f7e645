// defines: TrainerOptimizer (the seam between the trainer and an optimizer)
// and TorchOptimizer (any torch::optim::Optimizer: AdamW, SGD, ...).
//
// The fused optimizer and ZeRO plug in here by implementing the same five
// calls (cohort/optim/trainer_adapters.h). ZeRO's state is sharded: it
// answers replicated_state() false, and the trainer then has every rank save
// and load its own shard next to the checkpoint.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

namespace cohort {

class TrainerOptimizer {
 public:
  virtual ~TrainerOptimizer() = default;
  virtual void zero_grad() = 0;
  virtual void step() = 0;
  // Sets the rate of every parameter group (the schedule's value).
  virtual void set_lr(double lr) = 0;
  virtual void save(torch::serialize::OutputArchive& archive) const = 0;
  virtual void load(torch::serialize::InputArchive& archive) = 0;
  // True when every rank holds the same optimizer state (rank 0 saves it).
  virtual bool replicated_state() const { return true; }
};

class TorchOptimizer : public TrainerOptimizer {
 public:
  explicit TorchOptimizer(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {}
  void zero_grad() override { optimizer_.zero_grad(); }
  void step() override { optimizer_.step(); }
  void set_lr(double lr) override {
    for (auto& group : optimizer_.param_groups()) group.options().set_lr(lr);
  }
  void save(torch::serialize::OutputArchive& archive) const override {
    optimizer_.save(archive);
  }
  void load(torch::serialize::InputArchive& archive) override { optimizer_.load(archive); }

 private:
  torch::optim::Optimizer& optimizer_;
};

}  // namespace cohort
