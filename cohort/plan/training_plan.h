// defines: TrainingPlan, what a Trainer trains with, whatever the mode: the
// communicator, the model whose parameters get the gradients, the optimizer
// adapter (trainer_optimizer.h), the gradient sync (gradient_sync.h), the
// layout (trainer_layout.h), the state dict a checkpoint saves and loads,
// the determinism settings and the communicators whose traffic it reports.
//
// The Trainer knows a mode only through this. Each mode keeps its parts in
// its own folder (ddp/ddp_gradient_sync.h, optim/trainer_adapters.h,
// fsdp/fsdp_adapters.h, pipeline/pipeline_layout.h), and TrainerWiring's
// factories (cohort/wiring, one per valid pairing) put them together with
// the mode's state dict: they sit above dcp/state_dict, which knows every
// mode, so that this module and the Trainer sit below every mode.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/dcp/dcp.h"
#include "cohort/grad_sync/leaf_tree.h"
#include "cohort/plan/gradient_sync.h"
#include "cohort/plan/trainer_layout.h"
#include "cohort/plan/trainer_optimizer.h"

namespace cohort {

/// What a Trainer trains with (see the file comment); made by TrainerWiring's factories.
class TrainingPlan {
 public:
  /// A plan moves (the Trainer takes one by value, a TrainerWiring converts to one); it owns
  /// its adapters, so it does not copy.
  TrainingPlan(TrainingPlan&&) = default;
  /// Moves, as the constructor.
  TrainingPlan& operator=(TrainingPlan&&) = default;

  /// The communicator every rank's trainer runs over.
  const std::shared_ptr<Communicator>& process_group() const { return comm_; }
  /// The earlier name.
  [[deprecated("use process_group()")]] const std::shared_ptr<Communicator>& communicator() const {
    return comm_;
  }
  /// The module whose parameters get the gradients.
  const std::shared_ptr<torch::nn::Module>& model() const { return model_; }
  /// The optimizer adapter.
  TrainerOptimizer& optimizer() const { return *optimizer_; }
  /// The gradient sync.
  GradientSync& sync() const { return *sync_; }
  /// This rank's model and optimizer state as a dcp::StateDict, under the
  /// bare model's names (cohort/dcp/state_dict/state_dict.h); for_load: the checkpoint's
  /// metadata when loading. Every plan has one: the Trainer saves it with
  /// dcp::save and loads it resharded at any world size, into any plan
  /// where the names agree.
  dcp::StateDict dcp_state_dict(const dcp::Metadata* for_load) const {
    return dcp_state_(for_load);
  }
  /// Every communicator a step's traffic goes over, each once: process_group(), and under PP x DP
  /// also the pipeline group and the data-parallel group (a subgroup counts its own traffic).
  const std::vector<std::shared_ptr<Communicator>>& traffic() const { return traffic_; }
  /// How the model is laid out over the ranks (trainer_layout.h): what the Trainer calls to run
  /// a step's micro-batches, for the norm, the loss's copies and the traffic per dimension.
  TrainerLayout& layout() const { return *layout_; }

  /// Determinism::WorldSizeInvariant when the plan's DDP (alone or with a
  /// ZeRO built from it) or FSDP root was built with it; Default otherwise,
  /// and for every other plan, which cannot honour it.
  Determinism determinism() const { return determinism_; }
  /// Whether the plan's mode sums leaves in the canonical tree (DDP, ZeRO over DDP, FSDP), so
  /// that it can be built WorldSizeInvariant; false for every other mode.
  bool can_be_world_size_invariant() const { return can_be_invariant_; }
  /// The leaf count of the global batch (WorldSizeInvariant; 0 otherwise).
  int64_t leaves() const { return leaves_; }
  /// The leaves this rank computes per step (WorldSizeInvariant; 1 otherwise).
  int64_t local_leaves() const { return local_leaves_; }
  /// WorldSizeInvariant with sharded gradients (ZeRO, FSDP): measures the
  /// global norm in the canonical order and clips to its argument
  /// (collective; returns the norm). Null otherwise: replicated gradients
  /// are the same bits on every rank, and so is their local norm.
  const std::function<double(double)>& canonical_clip() const { return canonical_clip_; }
  /// What the plan trains with ("DDP", "FSDP", "a pipeline", ...), for messages.
  const std::string& mode() const { return mode_; }
  /// Whether the plan makes every rank's buffers (BatchNorm's running statistics) rank 0's
  /// before each training forward: DDP with DDPOptions::broadcast_buffers (alone or under a
  /// ZeRO), FSDP. Elsewhere each rank keeps the buffers its own batches gave it, and a
  /// checkpoint saves each rank's.
  bool broadcasts_buffers() const { return broadcasts_buffers_; }

 private:
  friend class TrainerWiring;  // its factories are the only way to make a plan

  /// The state dict function: for_load null when saving, else the checkpoint's metadata.
  using StateFn = std::function<dcp::StateDict(const dcp::Metadata*)>;

  /// `comm` and `model` must not be null (InvalidArgument); the layout is a ReplicaLayout over
  /// `sync` until a factory sets another; `more_traffic` adds to traffic() (each once).
  TrainingPlan(std::shared_ptr<Communicator> comm, std::shared_ptr<torch::nn::Module> model,
               std::unique_ptr<TrainerOptimizer> optimizer, std::unique_ptr<GradientSync> sync,
               std::vector<std::shared_ptr<Communicator>> more_traffic = {});

  /// Records the determinism of the plan's DDP or FSDP root (a mode that can be
  /// WorldSizeInvariant); with WorldSizeInvariant, each micro-batch is a leaf
  /// (trainer_layout.h).
  void set_leaves(Determinism determinism, int64_t leaves, int64_t local_leaves,
                  std::function<double(double)> canonical_clip);

  /// `state`, or with for_load its targets for loading that checkpoint (the
  /// Trainer checks them against the checkpoint before it loads).
  static dcp::StateDict saving_or_loading(dcp::StateDict state, const dcp::Metadata* for_load) {
    return for_load ? state.load_targets(*for_load) : state;
  }

  std::shared_ptr<Communicator> comm_;                  ///< process_group()
  std::shared_ptr<torch::nn::Module> model_;            ///< model()
  std::unique_ptr<TrainerOptimizer> optimizer_;         ///< optimizer()
  std::unique_ptr<GradientSync> sync_;                  ///< sync()
  std::unique_ptr<TrainerLayout> layout_;               ///< layout()
  StateFn dcp_state_;                                   ///< dcp_state_dict()
  std::vector<std::shared_ptr<Communicator>> traffic_;  ///< traffic()
  Determinism determinism_ = Determinism::Default;      ///< determinism()
  bool can_be_invariant_ = false;                       ///< can_be_world_size_invariant()
  int64_t leaves_ = 0;                                  ///< leaves()
  int64_t local_leaves_ = 1;                            ///< local_leaves()
  std::function<double(double)> canonical_clip_;        ///< canonical_clip()
  std::string mode_;                                    ///< mode()
  bool broadcasts_buffers_ = false;                     ///< broadcasts_buffers()
};

}  // namespace cohort
