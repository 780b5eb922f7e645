// defines: TrainerLayout, what differs between the ways a Trainer's model is
// laid out over the ranks: how one optimizer step's micro-batches run
// forward and backward, which global norm clips them, how many ranks see
// the same samples, which communicators carry each dimension's traffic, and
// whether each rank holds its own part of the model. The
// Trainer calls it and never asks which layout it has. One implementation
// per layout (made by TrainerWiring's factories):
//
//   ReplicaLayout    the whole model on every rank (DDP, ZeRO, the fused
//                    optimizer, all-reduce): the Trainer's LossFn per
//                    micro-batch, all but the last under
//                    GradientSync::skip_sync()
//   FSDPLayout       FSDP's shards: a ReplicaLayout whose checkpoints hold
//                    the shards (TrainerWiring::fsdp)
//   PipelineLayout   a pipeline's stages on each rank (TrainerWiring::pipeline,
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
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/grad_norm.h"
#include "cohort/train/gradient_sync.h"

namespace cohort {

class Communicator;
class FullyShardImpl;
class Tracer;

/// Computes the scalar loss of one micro-batch (forward through the DDP
/// module, then the criterion). Must return a tensor that requires grad.
using LossFn = std::function<torch::Tensor(const torch::data::Example<>&)>;

/// Each dimension's name ("tp", "pp", "dp") and the communicators its traffic goes over.
using TrafficDimensions =
    std::vector<std::pair<std::string, std::vector<std::shared_ptr<Communicator>>>>;

/// How the model is laid out over the ranks (file comment).
class TrainerLayout {
 public:
  virtual ~TrainerLayout() = default;
  /// InvalidArgument naming `rank` when the Trainer's LossFn or accumulation steps do not fit.
  virtual void check(const LossFn& loss_fn, int64_t accumulation_steps, int rank) const = 0;
  /// Forward and backward over one step's micro-batches, the gradients those of their mean
  /// loss; returns this rank's mean loss.
  virtual double step(const std::vector<torch::data::Example<>>& micro_batches,
                      const LossFn& loss_fn, Tracer* tracer) = 0;
  /// Seconds step() communicated so far, beyond the sync's and the optimizer's.
  virtual double comm_seconds() const { return 0.0; }
  /// The global norm this layout needs, or null: the Trainer picks one from the optimizer.
  virtual std::shared_ptr<GradNorm> norm() const { return nullptr; }
  /// Ranks that see the same samples and report the same loss.
  virtual int ranks_per_sample() const { return 1; }
  /// Each dimension's communicators (per-dimension traffic); empty: not reported.
  virtual const TrafficDimensions& dimensions() const { return none_; }
  /// What the layout is, for messages ("a pipeline (each rank holds its stages)"); empty for
  /// replicas.
  virtual std::string describe() const { return ""; }
  /// Brings the model to the form its checkpoint holds, before a save or a load.
  virtual void before_checkpoint() {}
  /// Determinism::WorldSizeInvariant: each micro-batch is one leaf, its
  /// backward unscaled and synchronized (the DDP or FSDP root averages over
  /// the leaves in the canonical tree). Only layouts that run the LossFn per
  /// micro-batch support it.
  virtual void set_per_leaf() {
    throw InvalidArgument("TrainerLayout: " + describe() + " has no per-leaf step");
  }

 private:
  TrafficDimensions none_;
};

/// The whole model (or FSDP's shards) on every rank: the LossFn per micro-batch.
class ReplicaLayout : public TrainerLayout {
 public:
  /// `sync` keeps the non-final micro-batches local; it must outlive the layout.
  explicit ReplicaLayout(GradientSync& sync) : sync_(sync) {}
  void check(const LossFn& loss_fn, int64_t accumulation_steps, int rank) const override;
  double step(const std::vector<torch::data::Example<>>& micro_batches, const LossFn& loss_fn,
              Tracer* tracer) override;
  void set_per_leaf() override { per_leaf_ = true; }

 private:
  GradientSync& sync_;
  bool per_leaf_ = false;
};

/// FSDP's shards on every rank: a checkpoint saves and loads the shards, so
/// parameters an evaluation forward left gathered are resharded first.
class FSDPLayout : public ReplicaLayout {
 public:
  /// `sync` and `root` must outlive the layout.
  FSDPLayout(GradientSync& sync, FullyShardImpl& root);
  std::string describe() const override {
    return "FSDP (parameters and optimizer state sharded over the ranks)";
  }
  void before_checkpoint() override;
  /// The shards' squared norms summed over the shard group (under HSDP the
  /// replicas hold equal shards and must not count twice).
  std::shared_ptr<GradNorm> norm() const override { return norm_; }

 private:
  FullyShardImpl& root_;
  std::shared_ptr<GradNorm> norm_;
};

/// A pipeline's stages on each rank: one PipelineRuntime step per optimizer step.
class PipelineLayout : public TrainerLayout {
 public:
  /// `runtime` must outlive the layout.
  PipelineLayout(pipeline::PipelineRuntime& runtime, std::shared_ptr<GradNorm> norm,
                 int ranks_per_sample, TrafficDimensions dimensions)
      : runtime_(runtime),
        norm_(std::move(norm)),
        ranks_per_sample_(ranks_per_sample),
        dimensions_(std::move(dimensions)) {}
  void check(const LossFn& loss_fn, int64_t accumulation_steps, int rank) const override;
  double step(const std::vector<torch::data::Example<>>& micro_batches, const LossFn& loss_fn,
              Tracer* tracer) override;
  /// The pipeline's send and receive actions.
  double comm_seconds() const override { return comm_seconds_; }
  std::shared_ptr<GradNorm> norm() const override { return norm_; }
  int ranks_per_sample() const override { return ranks_per_sample_; }
  const TrafficDimensions& dimensions() const override { return dimensions_; }
  std::string describe() const override { return "a pipeline (each rank holds its stages)"; }

 private:
  pipeline::PipelineRuntime& runtime_;
  std::shared_ptr<GradNorm> norm_;
  int ranks_per_sample_;
  TrafficDimensions dimensions_;
  double comm_seconds_ = 0.0;
};

}  // namespace cohort
