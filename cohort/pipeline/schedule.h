// defines: ActionType, Action, PipelineSchedule (a pipeline schedule as data,
// one action list per rank), its text form (parse_schedule, format_schedule),
// the generators ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
// ScheduleZBH1, and add_communication.
//
// No LibTorch here: schedules are plain data that the validator, the
// simulator and the runtime all read.
//
// Communication is explicit in a schedule that runs, and derived by
// add_communication from a compute-only one (what the generators return):
// SEND_F right after the F whose output leaves the rank, RECV_F right before
// the F that needs it, and the same for gradients (SEND_B/RECV_B around B or
// I). Stages on the same rank hand over locally and have no such actions.
#pragma once

#include <string>
#include <vector>

namespace cohort::pipeline {

/// One kind of schedule action.
enum class ActionType {
  Forward,         ///< F: forward of one micro-batch through one stage
  Backward,        ///< B: full backward (input and weight gradients)
  BackwardInput,   ///< I: backward for the stage's inputs only
  BackwardWeight,  ///< W: backward for the stage's weights only (after I)
  SendForward,     ///< SEND_F: send the stage's output activations on
  RecvForward,     ///< RECV_F: receive the stage's input activations
  SendBackward,    ///< SEND_B: send the gradient of the stage's inputs back
  RecvBackward,    ///< RECV_B: receive the gradient of the stage's outputs
};

/// True for F, B, I and W (the actions that run the model).
bool is_compute(ActionType type);

/// The type's name in the text form: "F", "B", "I", "W", "SEND_F", "RECV_F",
/// "SEND_B" or "RECV_B".
const char* action_type_name(ActionType type);

/// One action: `type` for micro-batch `microbatch` of logical stage `stage`.
/// Text form: stage, type, micro-batch, e.g. `2F0`, `1W3`, `0SEND_F1`.
struct Action {
  /// The logical stage the action runs on.
  int stage = 0;
  /// What the action does (forward, backward, send, ...).
  ActionType type = ActionType::Forward;
  /// The micro-batch it works on.
  int microbatch = 0;

  /// Same stage, type and micro-batch.
  bool operator==(const Action& o) const {
    return stage == o.stage && type == o.type && microbatch == o.microbatch;
  }
  /// Not operator==.
  bool operator!=(const Action& o) const { return !(*this == o); }
};

/// `2F0`, `0SEND_F1`, ...
std::string to_string(const Action& action);
/// Parses one token; throws InvalidArgument naming the token.
Action parse_action(const std::string& token);

/// Entry `stage` of a per-stage list that may instead hold one entry for
/// every stage: the convention of the simulator's and the memory model's
/// costs.
template <typename T>
const T& per_stage(const std::vector<T>& v, int stage) {
  return v.size() == 1 ? v[0] : v.at(stage);
}

/// A schedule: for each rank, the actions it runs in order.
struct PipelineSchedule {
  std::string name;          ///< "GPipe", "1F1B", ... (for messages)
  int num_ranks = 0;         ///< pipeline ranks (pp)
  int num_stages = 0;        ///< logical stages (pp * v)
  int num_microbatches = 0;  ///< m
  /// stage_to_rank[s]: the one rank that holds logical stage s.
  std::vector<int> stage_to_rank;
  /// actions[r]: rank r's actions in the order it runs them.
  std::vector<std::vector<Action>> actions;

  /// The stages rank `rank` holds, ascending.
  std::vector<int> stages_of(int rank) const;
};

/// Text form: one line per rank, `rank N: tok tok ...`, preceded by a header
/// line `stages S microbatches M map r0 r1 ...` (stage -> rank).
std::string format_schedule(const PipelineSchedule& schedule);
/// Reads format_schedule's text back. Throws InvalidArgument on bad text.
PipelineSchedule parse_schedule(const std::string& text);

/// Logical stage s on rank s % pp (one stage per rank when v == 1; Megatron's
/// interleaving, stage = rank + k * pp, otherwise).
std::vector<int> loop_stage_to_rank(int pp, int v);

/// All forwards, then all backwards (compute only; see add_communication).
PipelineSchedule ScheduleGPipe(int pp, int m);
/// One forward, one backward after a warm-up of pp - rank - 1 forwards.
PipelineSchedule Schedule1F1B(int pp, int m);
/// Megatron's interleaved 1F1B over v virtual stages per rank; m must be a
/// multiple of pp.
PipelineSchedule ScheduleInterleaved1F1B(int pp, int v, int m);
/// Zero bubble H1 (Qi et al., 2023): B split into I and W, at most 1F1B's
/// peak of pp micro-batches holding activations on any rank, F as 1F1B's
/// warm-up and that bound allow, then I, and W where the rank would
/// otherwise wait. With equal costs and m >= pp its
/// bubble is the paper's (pp - 1)(F + I - W) against 1F1B's (pp - 1)(F + B).
PipelineSchedule ScheduleZBH1(int pp, int m);
/// Builds a generator by name: "gpipe", "1f1b", "interleaved", "zbh1".
PipelineSchedule make_schedule(const std::string& name, int pp, int v, int m);

/// True when any rank's list has a send or receive action.
bool has_communication(const PipelineSchedule& schedule);

/// Inserts the send and receive actions a compute-only schedule needs (see
/// the file comment). Throws InvalidArgument if it already has some.
PipelineSchedule add_communication(const PipelineSchedule& schedule);

}  // namespace cohort::pipeline
