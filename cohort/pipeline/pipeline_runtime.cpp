// PipelineRuntime: the action loop. The wire (tags, shape messages, the
// receive window, send release) is BoundaryChannel's, the autograd and each
// slot's state StageExecutor's, the step's end share_step_outcome', the
// construction checks runtime_checks.cpp's.
#include "cohort/pipeline/pipeline_runtime.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/pipeline/boundary_channel.h"
#include "cohort/pipeline/stage_executor.h"
#include "cohort/pipeline/step_outcome.h"

namespace cohort::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

// One action as a complete event. Compute actions are the rank's busy time,
// sends and receives its communication (cohort-trace summary reads the
// categories); sends and receives name the peer rank, receives also the
// time blocked waiting for the message.
void trace_action(Tracer& tracer, const Action& a, Clock::time_point start, Clock::time_point end,
                  int64_t blocked_ns, int peer) {
  std::vector<TraceArg> args{TraceArg::num("stage", a.stage),
                             TraceArg::num("microbatch", a.microbatch)};
  if (peer >= 0) args.push_back(TraceArg::num("peer", peer));
  if (a.type == ActionType::RecvForward || a.type == ActionType::RecvBackward)
    args.push_back(TraceArg::num("blocked_us", static_cast<double>(blocked_ns) / 1e3));
  tracer.complete(action_type_name(a.type),
                  is_compute(a.type) ? "pipeline.compute" : "pipeline.comm", start, end,
                  std::move(args));
}

}  // namespace

struct PipelineRuntime::State {
  int rank = 0;
  std::unique_ptr<BoundaryChannel> channel;
  std::unique_ptr<StageExecutor> executor;
};

namespace {

// A 1-D mesh named "pp" over `group` (the deprecated group constructor);
// null keeps its own message.
DeviceMesh pp_mesh(std::shared_ptr<Communicator> group) {
  if (!group) throw InvalidArgument("PipelineRuntime: no pipeline communicator");
  return DeviceMesh::from_group(std::move(group), "pp");
}

}  // namespace

PipelineRuntime::PipelineRuntime(std::shared_ptr<Communicator> pp_group,
                                 std::vector<PipelineStage> stages, PipelineSchedule schedule,
                                 PipelineLossFn loss_fn, PipelineOptions options)
    : PipelineRuntime(pp_mesh(std::move(pp_group)), std::move(stages), std::move(schedule),
                      std::move(loss_fn), options) {}

PipelineRuntime::PipelineRuntime(const DeviceMesh& pp, std::vector<PipelineStage> stages,
                                 PipelineSchedule schedule, PipelineLossFn loss_fn,
                                 PipelineOptions options)
    : group_(one_dimension_group(pp, "PipelineRuntime", "pp")),
      stages_(std::move(stages)),
      schedule_(std::move(schedule)),
      loss_fn_(std::move(loss_fn)),
      options_(options),
      state_(std::make_unique<State>()) {
  if (!group_) throw InvalidArgument("PipelineRuntime: no pipeline communicator");
  const int rank = group_->rank();
  const std::string who =
      "PipelineRuntime on rank " + std::to_string(rank) + " of group " + group_->name() + ": ";
  std::string local_error;
  try {
    check_local(who);
    // Before the agreement, which compares the action lists as they run.
    if (!has_communication(schedule_)) schedule_ = add_communication(schedule_);
  } catch (const Error& e) {
    local_error = e.what();
  }
  check_agreement(who, local_error);
  tie_weights(who);
  // Both keep references to schedule_, stages_ and loss_fn_, which stay
  // put: the runtime is neither copied nor moved.
  state_->rank = rank;
  // A stage receives where its parameters are (a parameterless stage: on
  // the CPU), so a CUDA stage gets CUDA inputs.
  std::map<int, c10::Device> devices;
  for (const auto& stage : stages_) {
    if (!stage.parameters().empty()) devices.emplace(stage.index(), stage.parameters()[0].device());
  }
  state_->channel = std::make_unique<BoundaryChannel>(*group_, schedule_, options_.timeout,
                                                      options_.recv_window, std::move(devices));
  state_->executor = std::make_unique<StageExecutor>(stages_, schedule_, rank, loss_fn_);
}

PipelineRuntime::~PipelineRuntime() = default;

std::vector<torch::Tensor> PipelineRuntime::parameters() const {
  // Each once: a weight two of this rank's stages share (a tied embedding
  // when one rank holds the first and the last stage) would otherwise be
  // stepped twice by an optimizer built over the list.
  std::vector<torch::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& st : stages_) {
    for (const auto& p : st.parameters()) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
    }
  }
  return out;
}

// The batch's problem on this rank (kind 0: none), for check_batches.
PipelineRuntime::BatchProblem PipelineRuntime::split_batch(const Tensors& inputs,
                                                           const Tensors& targets) {
  const int m = schedule_.num_microbatches;
  BatchProblem problem;
  auto split = [&](const Tensors& batch, int64_t of_targets, std::vector<Tensors>& out) {
    out.assign(m, {});
    if (batch.empty()) problem = {BatchProblem::kEmpty, of_targets, 0};
    for (const auto& t : batch) {
      if (t.dim() == 0 || t.size(0) % m != 0) {
        problem = {BatchProblem::kUneven, of_targets, t.dim() ? t.size(0) : 0};
        return;
      }
      auto chunks = t.chunk(m, 0);
      for (int i = 0; i < m; ++i) out[i].push_back(chunks[i]);
    }
  };
  std::vector<Tensors> micro_inputs, micro_targets;
  const auto& mine = schedule_.stages_of(state_->rank);
  if (std::count(mine.begin(), mine.end(), 0)) {
    split(inputs, 0, micro_inputs);
    std::vector<int64_t> shapes;
    for (const auto& t : inputs) {
      shapes.insert(shapes.end(), {static_cast<int64_t>(t.scalar_type()), t.dim()});
      shapes.insert(shapes.end(), t.sizes().begin(), t.sizes().end());
    }
    problem.input_shapes = static_cast<int64_t>(fnv1a_words(shapes));
  }
  if (!problem.kind && std::count(mine.begin(), mine.end(), schedule_.num_stages - 1))
    split(targets, 1, micro_targets);
  if (!problem.kind)
    state_->executor->begin_step(std::move(micro_inputs), std::move(micro_targets));
  return problem;
}

PipelineStepResult PipelineRuntime::step(const Tensors& inputs, const Tensors& targets,
                                         double loss_scale) {
  const auto t0 = Clock::now();
  state_->executor->set_loss_scale(loss_scale);
  state_->executor->set_non_finite_loss_seeds_nan(non_finite_seeds_nan_);
  state_->channel->begin_step(check_batches(split_batch(inputs, targets)));
  PipelineStepResult result;
  Tracer* const tracer = active(group_->tracer());
  TraceSpan span(tracer, "pipeline step", "pipeline.step");
  if (tracer) {
    span.arg(TraceArg::str("schedule", schedule_.name));
    span.arg(TraceArg::num("microbatches", schedule_.num_microbatches));
  }
  BoundaryChannel& channel = *state_->channel;
  set_tied_grads_aside();
  try {
    const std::vector<Action>& actions = schedule_.actions[state_->rank];
    for (size_t pc = 0; pc < actions.size(); ++pc) {
      channel.begin_action(pc);
      run_action(actions[pc], result);
      channel.end_action(pc);
    }
    result.peak_live_microbatches = state_->executor->peak_live();
    TraceSpan finish(tracer, "finish step", "pipeline.step");
    finish_step(result);
  } catch (...) {
    state_->executor->abort();
    channel.abort();
    if (!tied_aside_.empty()) restore_tied_grads(false);
    drop_gradients();
    throw;
  }
  result.step_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  return result;
}

void PipelineRuntime::run_action(const Action& a, PipelineStepResult& result) {
  Tracer* const tracer = active(group_->tracer());
  state_->channel->take_blocked_ns();
  const auto t0 = Clock::now();
  dispatch(a);
  if (tracer) {
    const bool to_next = a.type == ActionType::SendForward || a.type == ActionType::RecvBackward;
    const int peer =
        is_compute(a.type) ? -1 : schedule_.stage_to_rank[a.stage + (to_next ? 1 : -1)];
    trace_action(*tracer, a, t0, Clock::now(), state_->channel->take_blocked_ns(), peer);
  }
  if (!options_.measure) return;
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (is_compute(a.type)) result.compute_ms += ms;
  result.action_ms[a.type] += ms;
  result.action_count[a.type] += 1;
  result.durations_ms.push_back(ms);
}

// Compute actions go to the executor, transfers between it and the channel.
void PipelineRuntime::dispatch(const Action& a) {
  StageExecutor& exec = *state_->executor;
  BoundaryChannel& channel = *state_->channel;
  const int s = a.stage, mb = a.microbatch;
  switch (a.type) {
    case ActionType::Forward:
      exec.forward(s, mb);
      break;
    case ActionType::Backward:
    case ActionType::BackwardInput:
      exec.backward(s, mb, a.type == ActionType::Backward);
      break;
    case ActionType::BackwardWeight:
      exec.backward_weight(s, mb);
      break;
    case ActionType::SendForward:
      if (auto stand_in = channel.send_forward(s, mb, exec.outputs(s, mb), exec.skipped(s, mb)))
        exec.replace_outputs(s, mb, std::move(*stand_in));
      break;
    case ActionType::RecvForward:
      exec.put_inputs(s, mb, channel.recv_forward(s, mb));
      if (channel.upstream_failed()) exec.skip_rest();
      break;
    case ActionType::SendBackward:
      channel.send_backward(s, mb, exec.take_input_grads(s, mb));
      break;
    case ActionType::RecvBackward:
      exec.put_grads(s, mb, channel.recv_backward(s, mb, exec.outputs(s, mb)));
      break;
  }
}

// A failed step's gradients are partial, and on the ranks after a failed
// stage partly from the zeros sent in its outputs' place: none is kept, so
// an optimizer step that follows changes nothing. Earlier steps'
// accumulated gradients go too: their sum lacks this step's batch.
void PipelineRuntime::drop_gradients() {
  for (auto& p : parameters()) p.mutable_grad().reset();
}

void PipelineRuntime::finish_step(PipelineStepResult& result) {
  state_->channel->finish();
  // Before the outcome's exchange, which throws on every rank for a loss
  // that could not train or a refused send: the gradients that were added
  // stay one weight's.
  restore_tied_grads(true);
  const StageExecutor& exec = *state_->executor;
  result.losses = share_step_outcome(
      *group_, schedule_, exec.losses(),
      {state_->channel->refused_send(), exec.failure(), exec.failure_exception()});
  double sum = 0;
  for (double l : result.losses) sum += l;
  result.loss = sum / result.losses.size();
  state_->executor->end_step();
}

}  // namespace cohort::pipeline
