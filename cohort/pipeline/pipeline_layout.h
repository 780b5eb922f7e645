// defines: PipelineLayout, the Trainer's layout (cohort/plan/trainer_layout.h)
// of a pipeline's stages: one PipelineRuntime::step per optimizer step over
// the step's micro-batches; the norm, the ranks per sample and the traffic
// dimensions come from the wiring that makes it (TrainerWiring::pipeline
// and ::mesh, cohort/wiring).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/plan/grad_norm.h"
#include "cohort/plan/trainer_layout.h"

namespace cohort {

/// A pipeline's stages on each rank: one PipelineRuntime step per optimizer step.
class PipelineLayout : public TrainerLayout {
 public:
  /// `runtime` must outlive the layout. `sequence_groups`: a mesh's
  /// context-parallel group (sequence_split_groups), none without one.
  PipelineLayout(pipeline::PipelineRuntime& runtime, std::shared_ptr<GradNorm> norm,
                 int ranks_per_sample, TrafficDimensions dimensions,
                 std::vector<std::shared_ptr<Communicator>> sequence_groups = {})
      : runtime_(runtime),
        norm_(std::move(norm)),
        ranks_per_sample_(ranks_per_sample),
        dimensions_(std::move(dimensions)),
        sequence_groups_(std::move(sequence_groups)) {}
  void check(const LossFn& loss_fn, int64_t accumulation_steps, int rank) const override;
  double step(const std::vector<torch::data::Example<>>& micro_batches, const LossFn& loss_fn,
              Tracer* tracer, double weight) override;
  /// The pipeline's messages stay within its group (and a mesh's TP, CP and
  /// EP groups, inside the stages' code): a replica's failed step, which
  /// every rank of its pipeline throws, reaches the other replicas through
  /// the data-parallel sync.
  bool sync_hears_failures() const override { return true; }
  /// The runtime's (PipelineRuntime::set_non_finite_loss_seeds_nan).
  void set_non_finite_loss_seeds_nan(bool on) override {
    runtime_.set_non_finite_loss_seeds_nan(on);
  }
  /// The pipeline's send and receive actions.
  double comm_seconds() const override { return comm_seconds_; }
  std::shared_ptr<GradNorm> norm() const override { return norm_; }
  int ranks_per_sample() const override { return ranks_per_sample_; }
  /// The pipeline's group, and a mesh's TP and CP groups.
  std::vector<std::shared_ptr<Communicator>> same_samples_groups() const override;
  /// A mesh's TP groups.
  std::vector<std::shared_ptr<Communicator>> same_inputs_groups() const override;
  /// A mesh's CP group.
  std::vector<std::shared_ptr<Communicator>> sequence_split_groups() const override {
    return sequence_groups_;
  }
  const TrafficDimensions& dimensions() const override { return dimensions_; }
  std::string describe() const override { return "a pipeline (each rank holds its stages)"; }

 private:
  pipeline::PipelineRuntime& runtime_;
  std::shared_ptr<GradNorm> norm_;
  int ranks_per_sample_;
  TrafficDimensions dimensions_;
  std::vector<std::shared_ptr<Communicator>> sequence_groups_;
  double comm_seconds_ = 0.0;
};

}  // namespace cohort
