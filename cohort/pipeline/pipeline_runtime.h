// defines: PipelineOptions, PipelineStepResult, PipelineRuntime: runs one
// rank's part of a PipelineSchedule over a communicator's tagged
// point-to-point.
//
// Gradient convention: the loss function returns the mean loss of its
// micro-batch; the runtime backpropagates loss / m. With m equal micro-batches
// one step therefore adds to each parameter's .grad exactly what
// loss.backward() on the whole batch (mean loss) adds: no further scaling
// anywhere, gradients accumulate across steps until the caller zeros them.
//
// Transport: every send is posted without waiting (its Work and tensor are
// kept until it completes) and a receive blocks only for its own message, so
// the transport cannot deadlock a schedule that the validator's dry run
// accepts (Megatron alternates even and odd ranks because NCCL's sends
// block).
// Messages are tagged by (stage, direction, micro-batch). Shapes and dtypes
// cross each boundary once, on its first message; later outputs that differ
// are refused naming the stage, micro-batch, expected and actual shape.
//
// Memory: a rank holds what its schedule needs and no more. A micro-batch's
// activations live from its F to its B (to its W under a split backward),
// receives are posted at most PipelineOptions::recv_window actions ahead,
// and a sent tensor is dropped when its send completes; nothing is sized by
// the whole batch. So 1F1B, interleaved and ZB-H1 hold a number of
// micro-batches that does not grow with m (schedule_memory predicts it).
//
// PP x DP: average_gradients (cohort/grad_sync/average_gradients.h) over the
// data-parallel group (the ranks holding the same stages for other shards of
// the batch), once per step, after step() and before the optimizer: the
// micro-batches accumulate locally, so gradients cross the DP group once per
// step. (ZeroRedundancyOptimizer with reduce_gradients over the DP group does
// the same reduction in its step().)
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/grad_sync/tied_copies.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/pipeline/pipeline_stage.h"
#include "cohort/pipeline/schedule.h"

namespace cohort {
class Communicator;
}

namespace cohort::pipeline {

/// (last stage's outputs, micro-batch targets) -> mean loss of the micro-batch.
using PipelineLossFn = std::function<torch::Tensor(const Tensors& outputs, const Tensors& targets)>;

/// How a PipelineRuntime runs.
struct PipelineOptions {
  /// Every receive's timeout (default: the communicator's): a dead peer is
  /// reported within it.
  Millis timeout = kDefaultTimeout;
  /// Record each compute action's time (PipelineStepResult::compute_ms).
  bool measure = true;
  /// Receive actions posted ahead of the running action, each with its
  /// buffers: a message then lands while this rank computes instead of
  /// waiting for the receiver to ask, and the buffers stay bounded whatever
  /// m is. 0 posts each receive at its own action.
  int recv_window = 4;
};

/// What one step returns on every rank.
struct PipelineStepResult {
  std::vector<double> losses;  ///< per micro-batch (from the last stage)
  double loss = 0;             ///< their mean: the whole batch's mean loss
  double step_ms = 0;          ///< this rank's wall time for the step
  /// This rank's time in compute actions, and per action type (F, B, I, W).
  double compute_ms = 0;
  /// Milliseconds in each action type on this rank, the communication
  /// actions included (a receive's time is mostly waiting for its peer).
  std::map<ActionType, double> action_ms;
  /// Actions of each type this rank ran in the step.
  std::map<ActionType, int> action_count;
  /// Milliseconds of each of this rank's actions, in schedule order (the
  /// distribution behind action_ms: a pipeline's idle time depends on how
  /// much single actions vary, not only on their mean).
  std::vector<double> durations_ms;
  /// The most (stage, micro-batch) pairs whose activations this rank held
  /// at once: from an F to its B, or to its W after an I.
  int peak_live_microbatches = 0;
};

/// A weight that several stages hold (PipelineStage::tie), as this rank sees it.
struct TiedWeight {
  /// The key the stages declared it under.
  std::string key;
  /// Every stage holding a copy, over all ranks, ascending: the first one's
  /// copy is the original (the one a norm counts and a checkpoint writes).
  std::vector<int> stages;
  /// This rank's copies (none where it holds no such stage) and the group
  /// of the ranks holding one.
  std::shared_ptr<TiedCopies> copies;
};

/// One rank's pipeline: its stages, the schedule, the pipeline group.
class PipelineRuntime {
 public:
  /// The most stages a schedule may have: message tags are ints, and each
  /// boundary's two directions own 2^16 of them.
  static constexpr int kMaxStages = 16384;

  /// Collective over `pp`, a 1-D mesh (`mesh["pp"]`; each rank passes its own stages, ascending
  /// by index, exactly the ones the schedule maps to it). Validates the
  /// schedule (ScheduleError), refuses more than kMaxStages stages or 65535
  /// micro-batches, and checks that ranks agree on the number of stages and
  /// micro-batches and on the stage-to-rank map (each an error on every
  /// rank). A schedule without communication actions gets them from
  /// add_communication. InvalidArgument when `pp` is not 1-D.
  /// Weights tied across stages (PipelineStage::tie) are made equal, the
  /// lowest stage's copy broadcast to the others; copies of one key that
  /// differ in shape or dtype, a key only one stage declares, two tensors of
  /// one stage under one key or one tensor under two keys are an
  /// InvalidArgument on every rank.
  PipelineRuntime(const DeviceMesh& pp, std::vector<PipelineStage> stages,
                  PipelineSchedule schedule, PipelineLossFn loss_fn, PipelineOptions options = {});
  /// The same over a bare group.
  [[deprecated(
      "use PipelineRuntime(DeviceMesh::from_group(pp_group, \"pp\"), ...)")]] PipelineRuntime(std::
                                                                                                  shared_ptr<
                                                                                                      Communicator>
                                                                                                      pp_group,
                                                                                              std::vector<
                                                                                                  PipelineStage>
                                                                                                  stages,
                                                                                              PipelineSchedule
                                                                                                  schedule,
                                                                                              PipelineLossFn
                                                                                                  loss_fn,
                                                                                              PipelineOptions
                                                                                                  options =
                                                                                                      {});
  ~PipelineRuntime();

  /// Runs one step. `inputs` (the whole batch, split along dim 0 into m
  /// micro-batches) matter on the rank holding stage 0, `targets` on the
  /// rank holding the last stage; other ranks may pass {}. Adds gradients
  /// to the stages' parameters (see the file comment). Collective before
  /// the first action (one all-gather of 4 words per rank, none at one
  /// rank): missing inputs or targets, or a batch that does not split into
  /// m micro-batches, is an InvalidArgument on every rank naming the rank
  /// that got it. Shapes may differ from step to step (a short last batch,
  /// a sequence length that varies); within a step every micro-batch's
  /// boundary tensors have one shape. A loss that is not a
  /// scalar or does not require grad is an InvalidArgument on every rank at
  /// the step's end, naming the last stage, its rank and the first such
  /// micro-batch. A stage's code that throws (its forward, the loss
  /// function, its backward) is a StageError on every rank at the step's
  /// end, naming the stage, its rank, the micro-batch and the message (the
  /// original nested on its rank); the other ranks finish their schedules
  /// on zeros instead of waiting for the timeout. A step that throws after
  /// its batch check leaves every parameter of this rank's stages without
  /// a gradient (.grad undefined, earlier steps' too), so an optimizer step
  /// after it changes nothing. After the last backward the
  /// gradients of each tied weight's copies are summed over the ranks
  /// holding one (only what this step added: earlier steps' accumulated
  /// gradients are not summed again), so that every copy steps as the one
  /// weight of an unsplit model. `loss_scale` multiplies each backpropagated
  /// loss / m (the Trainer weights a data-parallel replica whose batch is
  /// larger or smaller than the others' by it); the losses reported are
  /// unscaled.
  PipelineStepResult step(const Tensors& inputs, const Tensors& targets, double loss_scale = 1.0);
  /// With `on`, the last stage seeds the backward of a micro-batch whose loss is NaN or Inf
  /// with NaN instead of 1, so that every stage's gradients, and the global norm over them, are
  /// non-finite too (the Trainer's check_for_nan_in_loss_and_grad); off by default.
  void set_non_finite_loss_seeds_nan(bool on) { non_finite_seeds_nan_ = on; }

  /// The stages this rank holds.
  const std::vector<PipelineStage>& stages() const { return stages_; }
  /// Every parameter of this rank's stages, each once (in stage order),
  /// frozen ones too: an optimizer built over the list steps a parameter
  /// unfrozen later (each step differentiates what requires grad at that step).
  std::vector<torch::Tensor> parameters() const;
  /// The weights tied across stages, by key (the same list on every rank).
  const std::vector<TiedWeight>& tied_weights() const { return tied_; }
  /// The schedule the runtime executes.
  const PipelineSchedule& schedule() const { return schedule_; }
  /// The pipeline-parallel group the stages exchange activations over.
  const std::shared_ptr<Communicator>& process_group() const { return group_; }
  /// The pipeline-parallel group, by reference.
  [[deprecated("use *process_group()")]] Communicator& group() const { return *group_; }
  /// The pipeline-parallel group, shared.
  [[deprecated("use process_group()")]] const std::shared_ptr<Communicator>& shared_group() const {
    return group_;
  }

 private:
  struct State;  // the channel and the executor (internal headers)
  void check_local(const std::string& who) const;
  void check_agreement(const std::string& who, const std::string& local_error);
  std::string describe_maps() const;
  // What is wrong with this rank's batch: kind kNone, kEmpty (no tensors)
  // or kUneven (a tensor of `rows` rows that does not split into m).
  struct BatchProblem {
    enum : int64_t { kNone, kEmpty, kUneven };
    int64_t kind = kNone;
    int64_t of_targets = 0;  // 1: the targets, 0: the inputs
    int64_t rows = 0;
    int64_t input_shapes = 0;  // stage 0's rank: a digest of the inputs' shapes
  };
  BatchProblem split_batch(const Tensors& inputs, const Tensors& targets);
  int64_t check_batches(const BatchProblem& mine);
  void run_action(const Action& action, PipelineStepResult& result);
  void dispatch(const Action& action);
  void finish_step(PipelineStepResult& result);
  void drop_gradients();
  void tie_weights(const std::string& who);
  // Each tied copy's .grad is set aside for the step, then the step's part,
  // summed over the copies' ranks, added back (`sum`: false on an abort).
  void set_tied_grads_aside();
  void restore_tied_grads(bool sum);
  std::shared_ptr<Communicator> group_;
  std::vector<PipelineStage> stages_;
  PipelineSchedule schedule_;
  PipelineLossFn loss_fn_;
  PipelineOptions options_;
  bool non_finite_seeds_nan_ = false;
  std::unique_ptr<State> state_;
  std::vector<TiedWeight> tied_;
  std::vector<torch::Tensor> tied_aside_;  // per copy, in tied_ order
};

}  // namespace cohort::pipeline
