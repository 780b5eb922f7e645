// defines: FSDPTrainerOptimizer, FSDPGradientSync and FSDPLayout, what the
// Trainer steps a fully sharded model (cohort::fully_shard) with (the
// interfaces of cohort/plan; TrainerWiring::fsdp puts them together).
//
// Sync: a fully sharded model reduce-scatters its gradients during backward
// (cohort/fsdp/fsdp_state.h), and its end-of-backward callback has waited
// for them, so finish_sync() has nothing to do; the non-final micro-batches
// run with set_requires_gradient_sync(false) (full gradients accumulate
// locally). Its communication time is the communicator's in-flight time of
// the all-gathers, reduce-scatters and buffer broadcasts.
//
// Optimizer: any LibTorch optimizer built over the sharded parameters. Each
// rank's .grad is its rows of the averaged gradient (padding is never part
// of a .grad), a disjoint part of the whole: the trainer's default norm is
// then ShardedGradNorm (squared partial norms all-reduced) and each rank
// clips its own rows. Its state is per rank (the shards' state), saved in
// the checkpoint's dcp folder.
#pragma once

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>

#include "cohort/fsdp/fully_shard.h"
#include "cohort/plan/gradient_sync.h"
#include "cohort/plan/trainer_layout.h"
#include "cohort/plan/trainer_optimizer.h"

namespace cohort {

/// A LibTorch optimizer over a fully sharded model's parameters (its shards).
class FSDPTrainerOptimizer : public TorchOptimizer {
 public:
  /// Adapts `optimizer`, which must outlive it.
  explicit FSDPTrainerOptimizer(torch::optim::Optimizer& optimizer) : TorchOptimizer(optimizer) {}
  /// Each rank's .grad are its rows of the parameters.
  bool sharded_gradients() const override { return true; }
};

/// The Trainer's GradientSync for a fully sharded model (see the file comment).
class FSDPGradientSync : public GradientSync {
 public:
  /// Syncs through the root `model`, which must outlive it.
  explicit FSDPGradientSync(FullyShard model);
  /// Backward accumulates full gradients without communicating while the
  /// guard lives; its end gives each unit back its own flag (a unit set to
  /// false with set_requires_gradient_sync stays so).
  std::shared_ptr<void> skip_sync() override;
  /// The last backward already reduce-scattered and waited. Throws
  /// InvalidArgument (on every rank: the flags are compared across ranks at
  /// each forward) when a unit's own flag is false: that unit's last
  /// backward kept full local gradients, which the optimizer cannot step on
  /// shards, and the Trainer's gradient norm would count once per rank.
  void finish_sync() override;
  /// In-flight seconds of the communicator's all-gathers, reduce-scatters
  /// and coalesced broadcasts since construction.
  double comm_seconds() const override;

 private:
  double seconds_now() const;

  FullyShard model_;
  double start_seconds_ = 0.0;
};

/// FSDP's shards on every rank: a checkpoint saves and loads the shards, so
/// parameters an evaluation forward left gathered are resharded first. Its
/// norm sums the shards' squared norms over the shard group (under HSDP the
/// replicas hold equal shards and must not count twice); over a model of
/// tensor-parallel layers TrainerWiring::fsdp replaces it
/// (ReplicaLayout::set_tensor_parallel).
class FSDPLayout : public ReplicaLayout {
 public:
  /// `sync` and `root` must outlive the layout.
  FSDPLayout(GradientSync& sync, FullyShardImpl& root);
  void before_checkpoint() override;

 private:
  FullyShardImpl& root_;
};

}  // namespace cohort
