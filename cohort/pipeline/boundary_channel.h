// defines: BoundaryChannel: the messages between one rank's pipeline stages
// and its peers' (internal to PipelineRuntime).
//
// Wire: a message across boundary b (stage b -> b + 1) carries tag
// message_tag(b, dir, micro-batch), dir 0 forward (activations), 1 backward
// (input gradients). Each boundary's shapes and dtypes travel in a 64-int64
// shape message on the step's first forward send across it, once for each
// shape of stage 0's inputs (begin_step's key), so shapes may change between
// steps. An output of another shape than the boundary's (within a step, or
// for an input shape seen before) is refused: zeros of the boundary's shapes
// travel in its place, so every rank runs its schedule to the end and learns
// of the refusal there (refused_send). A rank whose stage's code failed
// (StageExecutor) sends zeros of the boundary's shapes the same way, or,
// when the boundary's shapes are not known yet in the step, a shape message
// that says so (count -1): then no tensor crosses the boundary in either
// direction for the rest of the step, and the receiver skips its stages'
// code too (upstream_failed). A step's shapes are remembered for later
// steps except such a boundary's. An output too large to describe in a
// shape message is refused that way too. Gradients travel for floating-point
// and complex tensors (carries_gradient); a complex tensor travels as its real view.
//
// Threading: one thread. Every call comes from the thread running
// PipelineRuntime::step; the channel takes no lock and none of its calls is
// safe to overlap (the Communicator's own calls are, but this state is not).
//
// Ordering: a rank calls begin_action/end_action around each action of its
// list, in list order (action 0 starts a step). Receives are posted in that order, at most
// `recv_window` ahead, each before anything waits on its tag; a send's
// tensor is kept until its Work is known complete (polled, or proven by a
// later message from the same peer, see release_sends); finish() waits for
// every send, abort() drops everything after a failed step.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/pipeline/pipeline_stage.h"
#include "cohort/pipeline/schedule.h"

namespace cohort::pipeline {

/// The most micro-batches a schedule may have: the tag of micro-batch
/// kMetaMicrobatch is the boundary's shape message.
constexpr int kMetaMicrobatch = 0xFFFF;

/// The tag of a message across `boundary` in direction `dir` (0 forward,
/// 1 backward) for `microbatch`: 1 + ((boundary * 2 + dir) << 16) + mb.
int message_tag(int boundary, int dir, int microbatch);

/// Shapes and dtypes that cross one boundary in a step, from its first
/// message of the step.
struct BoundaryMeta {
  bool known = false;
  /// The sender failed before it knew the shapes: nothing crosses.
  bool failed = false;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<c10::ScalarType> dtypes;
};

/// One rank's sends and receives across its stages' boundaries.
class BoundaryChannel {
 public:
  /// `devices`: the device of each of this rank's stages (by stage index),
  /// where the tensors it receives are put; a stage not in it receives on
  /// the CPU.
  BoundaryChannel(Communicator& group, const PipelineSchedule& schedule, Millis timeout,
                  int recv_window, std::map<int, c10::Device> devices = {});

  /// Before a step's first action: `input_shapes`, the same on every rank,
  /// names the shapes of stage 0's inputs. A boundary's shapes seen in an
  /// earlier step under the same key are taken as known (no shape message,
  /// receives posted ahead); under a new key they travel again.
  void begin_step(int64_t input_shapes);
  /// Before action `pc` of this rank's list: refills the receive window.
  void begin_action(size_t pc);
  /// After action `pc`: drops the sends now known complete.
  void end_action(size_t pc);
  /// Sends stage `stage`'s outputs of micro-batch `mb` to the next stage
  /// (the shape message first, once per boundary and input shape). Outputs
  /// of another shape or dtype than the boundary's are refused: zeros of
  /// the boundary's shapes are sent instead and returned, for the slot to
  /// hold in their place, and the step's first refusal is kept
  /// (refused_send); so are outputs too large to describe, which send a
  /// failed shape message and return no tensor. `skipped`: the stage did
  /// not run (its outputs are ignored): zeros of the boundary's shapes
  /// where known, else the failed shape message; no refusal is kept.
  /// Returns nothing when `outputs` went.
  std::optional<Tensors> send_forward(int stage, int mb, const Tensors& outputs,
                                      bool skipped = false);
  /// The step's first refused send ("" for none), naming the stage, this
  /// rank, the micro-batch, the peer and both shapes.
  const std::string& refused_send() const { return refused_; }
  /// Whether a failed shape message arrived in this step: a previous
  /// stage's rank failed and sends nothing.
  bool upstream_failed() const { return upstream_failed_; }
  /// Stage `stage`'s inputs of micro-batch `mb` from the previous stage.
  Tensors recv_forward(int stage, int mb);
  /// Sends stage `stage`'s input gradients to the previous stage.
  void send_backward(int stage, int mb, const Tensors& grads);
  /// The gradients of stage `stage`'s `outputs` that carry one.
  Tensors recv_backward(int stage, int mb, const Tensors& outputs);
  /// Waits for every send of the step (their errors surface here).
  void finish();
  /// Forgets every posted receive and pending send (a failed step).
  void abort();
  /// Nanoseconds blocked in receives since the last call (traced runs).
  int64_t take_blocked_ns();

 private:
  // A send not known to be complete, and the position of its receive in the
  // peer's action list.
  struct PendingSend {
    Work work;
    torch::Tensor tensor;
    int peer;
    int peer_recv_pos;
  };
  // Posts a receive action's buffers; false when its boundary's shapes are
  // not known yet in this step (the window waits there).
  bool post_receive(const Action& action);
  bool take_posted(int boundary, int dir, int mb, Tensors& out);
  void wait_recv(const torch::Tensor& buffer, int src, int tag);
  void wait_timed(Work& work);
  void send(const torch::Tensor& tensor, int dst, int tag);
  void reap_sends();
  void release_sends(int peer, int peer_send_pos);
  std::string mismatch(int stage, int mb, int dst, const Tensors& out,
                       const BoundaryMeta& meta) const;
  std::string sender(int stage, int mb, int dst) const;
  // Sends the shape message saying that nothing crosses `stage`'s boundary.
  Tensors send_failed_meta(int stage, int dst, BoundaryMeta& meta);
  // A receive buffer for this rank's stage `stage`, on its device.
  torch::Tensor buffer(int stage, const std::vector<int64_t>& shape, c10::ScalarType dtype) const;

  Communicator& group_;
  const PipelineSchedule& schedule_;
  const Millis timeout_;
  const size_t recv_window_;
  const int rank_;
  const std::vector<Action>& actions_;
  // Per action of this rank: for a send, the position of its receive in the
  // peer's action list; for a receive, the position of its send there.
  const std::vector<int> peer_pos_;
  const std::map<int, c10::Device> devices_;
  std::map<int, BoundaryMeta> sent_meta_, recv_meta_;
  // The boundary shapes of earlier steps, by their input_shapes key: every
  // rank sees the same keys in the same order, so sender and receiver agree
  // on whether a shape message travels.
  struct KnownShapes {
    std::map<int, BoundaryMeta> sent, recv;
  };
  std::map<int64_t, KnownShapes> known_;
  int64_t step_key_ = 0;
  // The boundaries whose sent shapes came from an earlier step, and the
  // step's first refused send.
  std::set<int> sent_cached_;
  std::string refused_;
  bool upstream_failed_ = false;
  std::vector<PendingSend> sends_;
  // Receives posted ahead, by (boundary, direction, micro-batch).
  std::map<std::tuple<int, int, int>, std::vector<std::pair<Work, torch::Tensor>>> posted_;
  size_t post_cursor_ = 0;  // the next action begin_action looks at
  size_t running_ = 0;      // the action being run
  int64_t blocked_ns_ = 0;
};

}  // namespace cohort::pipeline
