// defines: SlotState, StageExecutor: the F/B/I/W autograd of one rank's
// stages, one slot per (stage, micro-batch) (internal to PipelineRuntime).
//
// A slot's life, one state at a time (a slot not held is Free):
//
//   Free --F--> Forwarded --B--> Grads --handed over--> Free
//                         --I--> WeightsAndGrads --W--> Grads
//                                     |--handed over--> Weights --W--> Free
//
// Forwarded holds the inputs, outputs and graph; Weights(AndGrads) the graph
// the W action still needs; Grads(AndWeights) the input gradients until the
// SEND_B action or the previous local stage's backward takes them. Stage 0
// hands over nothing (no stage takes the batch's gradients), so its B and W
// free the slot and its I goes to Weights. Any other transition is an
// internal error naming the slot and both states: it means a schedule the
// validator accepted reached an action out of order.
//
// A stage's own code that throws (its forward, the loss function, the
// autograd of its backward, hooks included) does not end the rank's
// schedule: the exception is kept (failure()) and from then on the step
// skips every stage's code on this rank. A skipped F holds stand-in
// outputs (none, or the channel's zeros; the last stage a zero loss) with no
// graph, and a B, I or W after it hands over zeros, so the other ranks'
// messages are all matched and every rank learns of the failure at the
// step's end (share_step_outcome).
//
// Threading: one thread (the one running PipelineRuntime::step), no lock.
#pragma once

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/pipeline_stage.h"
#include "cohort/pipeline/schedule.h"

namespace cohort::pipeline {

/// Where one (stage, micro-batch) slot is in its life (file comment).
enum class SlotState { Free, Forwarded, WeightsAndGrads, Weights, Grads };

/// The state's name, for errors.
const char* slot_state_name(SlotState state);

/// The losses of one step as the last stage computed them.
struct StepLosses {
  std::vector<double> losses;  ///< per micro-batch
  int bad_mb = -1;             ///< the first micro-batch whose loss cannot train
  int64_t bad_numel = 1;       ///< and its loss's element count
};

/// Runs one rank's compute actions and keeps each slot's tensors.
class StageExecutor {
 public:
  /// `stages` and `loss_fn` must outlive the executor.
  StageExecutor(const std::vector<PipelineStage>& stages, const PipelineSchedule& schedule,
                int rank, const PipelineLossFn& loss_fn);

  /// Starts a step on these micro-batches (inputs on stage 0's rank,
  /// targets on the last stage's).
  void begin_step(std::vector<Tensors> micro_inputs, std::vector<Tensors> micro_targets);
  /// The step's loss scale (PipelineRuntime::step), which multiplies each loss / m.
  void set_loss_scale(double scale) { loss_scale_ = scale; }
  /// PipelineRuntime::set_non_finite_loss_seeds_nan.
  void set_non_finite_loss_seeds_nan(bool on) { non_finite_seeds_nan_ = on; }
  /// Inputs received for (stage, mb), consumed by its F.
  void put_inputs(int stage, int mb, Tensors inputs);
  /// Output gradients received for (stage, mb), consumed by its B or I.
  void put_grads(int stage, int mb, Tensors grads);

  void forward(int stage, int mb);
  /// B when `full`, else I (input gradients only, the graph kept for W).
  void backward(int stage, int mb, bool full);
  void backward_weight(int stage, int mb);

  /// A Forwarded slot's outputs (for SEND_F and RECV_B).
  const Tensors& outputs(int stage, int mb) const;
  /// Whether a Forwarded slot's F was skipped: its outputs are a stand-in
  /// (empty until the channel gives the boundary's zeros).
  bool skipped(int stage, int mb) const;
  /// Skips every stage's code for the rest of the step (a previous stage's
  /// rank failed and sent nothing).
  void skip_rest() { skipping_ = true; }
  /// The step's first exception from a stage's code on this rank ("" and
  /// null for none), naming the stage, this rank and the micro-batch.
  const std::string& failure() const { return failure_; }
  const std::exception_ptr& failure_exception() const { return failure_ptr_; }
  /// Puts `stand_in` (no graph) in place of a Forwarded slot's outputs
  /// whose send was refused: their gradients then fit what was sent, and
  /// the slot's backward hands over zeros.
  void replace_outputs(int stage, int mb, Tensors stand_in);
  /// Hands over a slot's input gradients (SEND_B).
  Tensors take_input_grads(int stage, int mb);

  /// Ends a step: every slot must be Free again (else an internal error
  /// naming the first slot held and its state).
  void end_step();
  /// Drops every slot and received tensor (a failed step).
  void abort();
  const StepLosses& losses() const { return losses_; }
  /// The most slots holding activations at once in this step.
  int peak_live() const { return peak_live_; }
  /// A slot's state (Free when not held).
  SlotState state(int stage, int mb) const;

 private:
  using Key = std::pair<int, int>;
  struct Slot {
    SlotState state = SlotState::Free;
    Tensors inputs, outputs, input_grads;
    std::vector<WeightUnit> units;
    Tensors unit_grads;
    Tensors roots, root_grads;  // function stages keep these for W
    bool skipped = false;       // F did not run the stage: outputs are a stand-in
  };
  Slot& slot_in(const Key& key, std::initializer_list<SlotState> from, const char* action);
  void move_to(std::map<Key, Slot>::iterator it, SlotState to);
  Tensors stage_inputs(int stage, int mb);
  void apply_loss(int mb, Slot& slot, const Tensors& out);
  Tensors output_grads(int stage, int mb, const Slot& slot);
  void keep_input_grads(int stage, Slot& slot, const Tensors& got,
                        const std::vector<size_t>& input_pos);
  void release_activations(std::map<Key, Slot>::iterator it);
  void fail(const std::string& where, std::exception_ptr error);
  std::string where(int stage, int mb, const char* action) const;
  void weight_gradients(int stage, const Slot& slot);

  const PipelineSchedule& schedule_;
  const int rank_;
  const PipelineLossFn& loss_fn_;
  std::map<int, const PipelineStage*> local_;
  std::vector<bool> split_backward_;  // per stage: the schedule uses I/W
  std::map<Key, Slot> slots_;
  std::map<Key, Tensors> received_inputs_, received_grads_;
  std::vector<Tensors> micro_inputs_, micro_targets_;
  StepLosses losses_;
  bool skipping_ = false;  // this step runs no stage's code any more
  std::string failure_;
  std::exception_ptr failure_ptr_;
  double loss_scale_ = 1.0;
  bool non_finite_seeds_nan_ = false;
  int live_ = 0, peak_live_ = 0;  // slots holding activations
};

}  // namespace cohort::pipeline
