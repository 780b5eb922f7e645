// defines: FusedTrainerOptimizer and ZeroTrainerOptimizer, the
// TrainerOptimizer adapters (cohort/train/trainer_optimizer.h) of the
// distributed optimizers.
//
// The trainer expects averaged gradients after its GradientSync and before
// the optimizer step (it computes the global norm and clips there):
//   - ZeroRedundancyOptimizer at stage 1 after cohort DDP
//     (reduce_gradients = false) fits as it is: DDP averages, the trainer
//     clips, ZeRO steps its shard and all-gathers the parameters;
//   - FusedDistributedOptimizer and ZeRO stage 2 average inside step(), so
//     the trainer's sync must not communicate, and clipping (which would
//     see local gradients) must stay off.
// ZeRO's state is sharded (replicated_state() false): save/load write and
// read this rank's shard only.
#pragma once

#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/train/trainer_optimizer.h"

namespace cohort {

class FusedTrainerOptimizer : public TrainerOptimizer {
 public:
  explicit FusedTrainerOptimizer(FusedDistributedOptimizer& optimizer) : optimizer_(optimizer) {}
  void zero_grad() override { optimizer_.zero_grad(); }
  void step() override { optimizer_.step(); }
  void set_lr(double lr) override { optimizer_.set_lr(lr); }
  void save(torch::serialize::OutputArchive& archive) const override { optimizer_.save(archive); }
  void load(torch::serialize::InputArchive& archive) override { optimizer_.load(archive); }

 private:
  FusedDistributedOptimizer& optimizer_;
};

class ZeroTrainerOptimizer : public TrainerOptimizer {
 public:
  explicit ZeroTrainerOptimizer(ZeroRedundancyOptimizer& optimizer) : optimizer_(optimizer) {}
  void zero_grad() override { optimizer_.zero_grad(); }
  void step() override { optimizer_.step(); }
  void set_lr(double lr) override { optimizer_.set_lr(lr); }
  // This rank's shard only.
  void save(torch::serialize::OutputArchive& archive) const override {
    optimizer_.save_shard(archive);
  }
  void load(torch::serialize::InputArchive& archive) override { optimizer_.load_shard(archive); }
  bool replicated_state() const override { return false; }

 private:
  ZeroRedundancyOptimizer& optimizer_;
};

}  // namespace cohort
