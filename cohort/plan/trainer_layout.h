// defines: TrainerLayout, what differs between the ways a Trainer's model is
// laid out over the ranks: how one optimizer step's micro-batches run
// forward and backward, which global norm clips them, how many ranks see
// the same samples, which communicators carry each dimension's traffic, and
// whether each rank holds its own part of the model. The
// Trainer calls it and never asks which layout it has. One implementation
// per layout (made by TrainerWiring's factories, cohort/wiring):
//
//   ReplicaLayout    the whole model on every rank (DDP, ZeRO, the fused
//                    optimizer, all-reduce): the Trainer's LossFn per
//                    micro-batch, all but the last under
//                    GradientSync::skip_sync(); or each TP rank's part of a
//                    model of TP layers (DDP, all-reduce, FSDP), one Trainer
//                    per TP rank over its data-parallel group
//   FSDPLayout       FSDP's shards: a ReplicaLayout whose checkpoints hold
//                    the shards (TrainerWiring::fsdp;
//                    cohort/fsdp/fsdp_adapters.h)
//   PipelineLayout   a pipeline's stages on each rank
//                    (cohort/pipeline/pipeline_layout.h; TrainerWiring::pipeline,
//                    and ::mesh, whose stages are TP shards): one
//                    PipelineRuntime step over the micro-batches; the norm,
//                    ranks per sample and dimensions come from the factory
#pragma once

#include <torch/data/example.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/plan/grad_norm.h"
#include "cohort/plan/gradient_sync.h"

namespace cohort {

class Communicator;
class Tracer;

/// Computes the scalar loss of one micro-batch (forward through the DDP
/// module, then the criterion). Must return a tensor that requires grad.
using LossFn = std::function<torch::Tensor(const torch::data::Example<>&)>;

/// Each dimension's name ("tp", "pp", "dp", "ep", "cp") and the communicators its traffic goes
/// over.
using TrafficDimensions =
    std::vector<std::pair<std::string, std::vector<std::shared_ptr<Communicator>>>>;

/// How the model is laid out over the ranks (file comment).
class TrainerLayout {
 public:
  virtual ~TrainerLayout() = default;
  /// InvalidArgument naming `rank` when the Trainer's LossFn or accumulation steps do not fit.
  virtual void check(const LossFn& loss_fn, int64_t accumulation_steps, int rank) const = 0;
  /// Forward and backward over one step's micro-batches, the gradients those of their mean
  /// loss times `weight` (the Trainer's weight for a rank whose batch is larger or smaller
  /// than its peers', 1 when every rank's is as large); returns this rank's mean loss,
  /// unweighted.
  virtual double step(const std::vector<torch::data::Example<>>& micro_batches,
                      const LossFn& loss_fn, Tracer* tracer, double weight) = 0;
  /// True when step() sends nothing over the sync's groups, so that a rank
  /// whose step() threw can still meet the others in the sync, which tells
  /// them (GradientSync::finish_sync_unless_failed): a pipeline's replicas.
  /// False (DDP's backward all-reduces, FSDP's gathers): the exception leaves.
  virtual bool sync_hears_failures() const { return false; }
  /// Seconds step() communicated so far, beyond the sync's and the optimizer's.
  virtual double comm_seconds() const { return 0.0; }
  /// The global norm this layout needs, or null: the Trainer picks one from the optimizer.
  virtual std::shared_ptr<GradNorm> norm() const { return nullptr; }
  /// Ranks that see the same samples and report the same loss.
  virtual int ranks_per_sample() const { return 1; }
  /// Groups whose ranks must draw the same samples each step (a pipeline's
  /// ranks: stage 0's inputs train against the last stage's targets; a
  /// mesh's TP groups; its CP groups, whose ranks each hold part of every
  /// sequence); fit() checks that once per epoch. Empty for replicas.
  virtual std::vector<std::shared_ptr<Communicator>> same_samples_groups() const { return {}; }
  /// Those of same_samples_groups() whose ranks must also see the same
  /// inputs (a mesh's TP groups: a column-parallel layer reads its whole
  /// input on each rank); fit() checks those too. Not a pipeline's: only
  /// stage 0 reads the inputs.
  virtual std::vector<std::shared_ptr<Communicator>> same_inputs_groups() const { return {}; }
  /// Those of same_samples_groups() whose ranks hold different positions of
  /// the same samples (a mesh's context-parallel groups): their batches
  /// differ by design, so fit() compares there the samples' indices only
  /// (DataSource::sample_indices), which the data source must then give.
  virtual std::vector<std::shared_ptr<Communicator>> sequence_split_groups() const { return {}; }
  /// Each dimension's communicators (per-dimension traffic); empty: not reported.
  virtual const TrafficDimensions& dimensions() const { return none_; }
  /// What the layout is, for messages ("a pipeline (each rank holds its stages)"); empty for
  /// replicas.
  virtual std::string describe() const { return ""; }
  /// Whether rank 0 of the Trainer's group writes the metrics and the progress lines: not on
  /// TP ranks other than 0 of a layout with one Trainer per TP rank, which all have a rank 0.
  virtual bool reports() const { return true; }
  /// Why the layout's checkpoints would be wrong, or empty: the Trainer then refuses a
  /// checkpoint_dir on every rank.
  virtual std::string cannot_checkpoint() const { return ""; }
  /// Brings the model to the form its checkpoint holds, before a save or a load.
  virtual void before_checkpoint() {}
  /// Determinism::WorldSizeInvariant: each micro-batch is one leaf, its
  /// backward unscaled and synchronized (the DDP or FSDP root averages over
  /// the leaves in the canonical tree). Only layouts that run the LossFn per
  /// micro-batch support it.
  virtual void set_per_leaf() {
    throw InvalidArgument("TrainerLayout: " + describe() + " has no per-leaf step");
  }
  /// TrainerOptions::check_for_nan_in_loss_and_grad: with `on`, step() seeds the backward of a
  /// micro-batch whose loss is NaN or Inf with NaN instead of 1, so that the gradients' own
  /// averaging carries a replica's bad loss to every rank's global norm, also where the
  /// gradients stay finite (a NaN added to the loss). This default ignores it.
  virtual void set_non_finite_loss_seeds_nan(bool on) { (void)on; }

 private:
  TrafficDimensions none_;
};

/// The whole model (or FSDP's shards) on every rank: the LossFn per micro-batch.
class ReplicaLayout : public TrainerLayout {
 public:
  /// `sync` keeps the non-final micro-batches local; it must outlive the layout. `norm`: the
  /// layout's (norm()), or null for the Trainer's default.
  explicit ReplicaLayout(GradientSync& sync, std::shared_ptr<GradNorm> norm = nullptr)
      : sync_(sync), norm_(std::move(norm)) {}
  void check(const LossFn& loss_fn, int64_t accumulation_steps, int rank) const override;
  double step(const std::vector<torch::data::Example<>>& micro_batches, const LossFn& loss_fn,
              Tracer* tracer, double weight) override;
  void set_per_leaf() override { per_leaf_ = true; }
  void set_non_finite_loss_seeds_nan(bool on) override { non_finite_seeds_nan_ = on; }
  std::shared_ptr<GradNorm> norm() const override { return norm_; }

  /// The model holds tensor-parallel layers over `tp_group`, and each TP rank has a Trainer
  /// of its own over its data-parallel group: `norm` (which counts each parameter once over
  /// TP) replaces the layout's, the TP group's ranks must draw the same samples and see the
  /// same inputs, only TP rank 0 reports, and checkpoints are refused (each TP rank would
  /// write its slices under the whole tensors' names).
  void set_tensor_parallel(std::shared_ptr<GradNorm> norm, std::shared_ptr<Communicator> tp_group);
  std::vector<std::shared_ptr<Communicator>> same_samples_groups() const override;
  std::vector<std::shared_ptr<Communicator>> same_inputs_groups() const override;
  bool reports() const override;
  std::string cannot_checkpoint() const override;
  /// "a tensor-parallel group" with tensor-parallel layers (its ranks' samples must agree).
  std::string describe() const override { return tp_group_ ? "a tensor-parallel group" : ""; }

 private:
  GradientSync& sync_;
  std::shared_ptr<GradNorm> norm_;
  std::shared_ptr<Communicator> tp_group_;  // null without tensor-parallel layers
  bool per_leaf_ = false;
  bool non_finite_seeds_nan_ = false;
};

}  // namespace cohort
