// defines: StageMemory, MemoryCosts, ScheduleMemory, schedule_memory (the
// activation memory each rank of a schedule holds at its peak, as the
// runtime keeps it), validate_memory (refuses a schedule over a cap), and
// measure_stage_memory (one stage's StageMemory, measured).
//
// What a rank holds depends only on the order of its own actions, not on
// timing: a micro-batch's activations from its F to its B (to its W after
// an I), a received input from its receive on, a received gradient until
// the backward that uses it, and the receives the runtime posts ahead
// (PipelineOptions::recv_window). Sent tensors are taken to leave when sent.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "cohort/pipeline/pipeline_stage.h"
#include "cohort/pipeline/schedule.h"

namespace cohort::pipeline {

/// One logical stage's memory per micro-batch, in bytes.
struct StageMemory {
  /// What an F leaves allocated until its B (or W): the tensors autograd
  /// saved and the stage's outputs, not counting a received input.
  int64_t activation_bytes = 0;
  /// The same under a split backward (I and W), where the runtime also
  /// keeps each layer's output for W.
  int64_t split_activation_bytes = 0;
  /// The most a full B allocates on top while it runs
  /// (temporaries, gradients on their way out), freed when it ends.
  int64_t workspace_bytes = 0;
  /// The same for an I (input gradients only; it keeps the graph for W).
  int64_t input_workspace_bytes = 0;
  /// The same for a W (weight gradients, one WeightUnit at a time).
  int64_t weight_workspace_bytes = 0;
  /// What an I leaves for its W besides the activations: each layer's
  /// output gradient.
  int64_t weight_pending_bytes = 0;
};

/// What the memory model knows about a run.
struct MemoryCosts {
  /// Per logical stage; a single entry applies to every stage.
  std::vector<StageMemory> stages{StageMemory{}};
  /// Bytes of one micro-batch crossing each boundary (activations forward,
  /// the same amount of gradient back); a single entry applies to all.
  std::vector<int64_t> boundary_bytes{0};
  /// The runtime's PipelineOptions::recv_window.
  int recv_window = 4;
};

/// Each rank's peak.
struct ScheduleMemory {
  /// The most (stage, micro-batch) pairs holding activations at once (what
  /// PipelineStepResult::peak_live_microbatches measures).
  std::vector<int> peak_live_microbatches;
  /// The most bytes held at once, workspace included.
  std::vector<int64_t> peak_bytes;
};

/// The peaks of a valid schedule (validated first: ScheduleError); a
/// compute-only schedule gets its communication from add_communication.
ScheduleMemory schedule_memory(const PipelineSchedule& schedule, const MemoryCosts& costs = {});

/// Refuses (ScheduleError) a schedule whose predicted peak on some rank
/// exceeds `cap_bytes`, naming the rank, its peak and live micro-batches.
void validate_memory(const PipelineSchedule& schedule, const MemoryCosts& costs, int64_t cap_bytes);

/// Measures `stage` on one micro-batch's `inputs` (the stage's boundary
/// tensors) with a MemoryScope: F, then a full backward from gradients of
/// ones (of `loss` of the outputs when given, as on the last stage), then
/// an F, an I and a W as the runtime runs them. The parameters' .grad are
/// left as they were.
StageMemory measure_stage_memory(const PipelineStage& stage, const Tensors& inputs,
                                 const std::function<torch::Tensor(const Tensors&)>& loss = {});

}  // namespace cohort::pipeline
