#include "cohort/pipeline/schedule_memory.h"

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "cohort/memory/memory_scope.h"
#include "cohort/pipeline/schedule_validator.h"

namespace cohort::pipeline {
namespace {

bool is_recv(ActionType t) { return t == ActionType::RecvForward || t == ActionType::RecvBackward; }

// One rank's actions in order, with what the runtime holds after each.
class RankWalk {
 public:
  RankWalk(const std::vector<Action>& actions, const MemoryCosts& costs)
      : actions_(actions), costs_(costs) {
    for (const Action& a : actions)
      if (a.type == ActionType::BackwardInput) split_.insert(a.stage);
  }

  void run() {
    for (size_t pc = 0; pc < actions_.size(); ++pc) {
      post_ahead(pc);
      step(actions_[pc]);
    }
  }
  int peak_live = 0;
  int64_t peak = 0;

 private:
  using Key = std::tuple<ActionType, int, int>;  // receive type, stage, micro-batch
  static Key key(const Action& a) { return {a.type, a.stage, a.microbatch}; }

  int64_t buffer_bytes(const Action& a) const {
    return per_stage(costs_.boundary_bytes,
                     a.type == ActionType::RecvForward ? a.stage - 1 : a.stage);
  }
  // The runtime's rule: the next recv_window receive actions are posted,
  // refilled in a burst once at most one posted receive remains.
  void post_ahead(size_t running) {
    cursor_ = std::max(cursor_, running);
    if (posted_.size() > 1) return;
    while (cursor_ < actions_.size() && posted_.size() < size_t(costs_.recv_window)) {
      const Action& a = actions_[cursor_++];
      if (!is_recv(a.type)) continue;
      posted_.insert(key(a));
      hold(buffer_bytes(a));
    }
  }
  void hold(int64_t bytes) {
    held_ += bytes;
    peak = std::max(peak, held_);
  }
  int64_t take_buffer(ActionType type, int stage, int mb) {
    auto it = buffers_.find({type, stage, mb});
    if (it == buffers_.end()) return 0;
    const int64_t bytes = it->second;
    buffers_.erase(it);
    return bytes;
  }
  void step(const Action& a) {
    const StageMemory& sm = per_stage(costs_.stages, a.stage);
    const int64_t activations =
        split_.count(a.stage) ? sm.split_activation_bytes : sm.activation_bytes;
    if (is_recv(a.type)) {
      if (posted_.erase(key(a)) == 0) hold(buffer_bytes(a));  // posted at its own action
      buffers_[key(a)] = buffer_bytes(a);
      return;
    }
    if (!is_compute(a.type)) return;
    // An F's temporaries are freed as it goes: what it leaves is its peak.
    const int64_t workspace = a.type == ActionType::Forward          ? activations
                              : a.type == ActionType::BackwardInput  ? sm.input_workspace_bytes
                              : a.type == ActionType::BackwardWeight ? sm.weight_workspace_bytes
                                                                     : sm.workspace_bytes;
    peak = std::max(peak, held_ + workspace);
    const std::pair<int, int> slot{a.stage, a.microbatch};
    switch (a.type) {
      case ActionType::Forward:
        hold(activations);
        slots_[slot] = activations + take_buffer(ActionType::RecvForward, a.stage, a.microbatch);
        peak_live = std::max(peak_live, ++live_);
        break;
      case ActionType::Backward:
        held_ -= take_buffer(ActionType::RecvBackward, a.stage, a.microbatch) + slots_[slot];
        slots_.erase(slot), --live_;
        break;
      case ActionType::BackwardInput:
        held_ -= take_buffer(ActionType::RecvBackward, a.stage, a.microbatch);
        hold(sm.weight_pending_bytes);
        slots_[slot] += sm.weight_pending_bytes;
        break;
      default:  // W
        held_ -= slots_[slot];
        slots_.erase(slot), --live_;
    }
  }

  const std::vector<Action>& actions_;
  const MemoryCosts& costs_;
  size_t cursor_ = 0;
  std::set<int> split_;                           // stages run with I and W
  std::set<Key> posted_;                          // posted ahead, their action not run yet
  std::map<Key, int64_t> buffers_;                // received, not used yet
  std::map<std::pair<int, int>, int64_t> slots_;  // (stage, micro-batch) -> bytes held
  int64_t held_ = 0;
  int live_ = 0;
};

}  // namespace

ScheduleMemory schedule_memory(const PipelineSchedule& input, const MemoryCosts& costs) {
  validate_schedule(input);
  if (costs.stages.empty() || costs.boundary_bytes.empty() || costs.recv_window < 0)
    throw InvalidArgument(
        "schedule_memory: costs need a stage and a boundary entry and a recv_window >= 0");
  const PipelineSchedule s = has_communication(input) ? input : add_communication(input);
  ScheduleMemory out;
  for (int r = 0; r < s.num_ranks; ++r) {
    RankWalk walk(s.actions[r], costs);
    walk.run();
    out.peak_live_microbatches.push_back(walk.peak_live);
    out.peak_bytes.push_back(walk.peak);
  }
  return out;
}

void validate_memory(const PipelineSchedule& schedule, const MemoryCosts& costs,
                     int64_t cap_bytes) {
  const ScheduleMemory m = schedule_memory(schedule, costs);
  for (int r = 0; r < schedule.num_ranks; ++r)
    if (m.peak_bytes[r] > cap_bytes)
      throw ScheduleError("validate_memory: schedule " + schedule.name + " (" +
                          std::to_string(schedule.num_microbatches) + " micro-batches): rank " +
                          std::to_string(r) + " would hold " + std::to_string(m.peak_bytes[r]) +
                          " bytes at its peak (" + std::to_string(m.peak_live_microbatches[r]) +
                          " micro-batches' activations), over the cap of " +
                          std::to_string(cap_bytes) + " bytes");
}

namespace {

// One forward of `stage` inside its own scope: what it leaves, and the
// roots and their stand-in gradients (allocated outside the measured part).
struct Probe {
  Tensors in, roots, grads;
  std::vector<WeightUnit> units;
  int64_t held = 0;
};

Probe forward_probe(const PipelineStage& stage, const Tensors& inputs,
                    const std::function<torch::Tensor(const Tensors&)>& loss,
                    memory::MemoryScope& scope, bool split) {
  Probe p;
  for (const auto& t : inputs)  // as the runtime: a graph per stage, from its inputs
    p.in.push_back(stage.index() > 0 && carries_gradient(t.scalar_type())
                       ? t.detach().requires_grad_(true)
                       : t);
  const int64_t before = scope.current_bytes();
  Tensors outputs = stage.forward(p.in, split ? &p.units : nullptr);
  if (loss)
    p.roots.push_back(loss(outputs));
  else
    for (const auto& o : outputs)
      if (carries_gradient(o.scalar_type()) && o.requires_grad()) p.roots.push_back(o);
  p.held = scope.current_bytes() - before;
  for (const auto& r : p.roots) p.grads.push_back(torch::ones_like(r));
  return p;
}

Tensors stage_inputs(const PipelineStage& stage, const Tensors& in) {
  Tensors want;
  for (const auto& t : in)
    if (stage.index() > 0 && t.requires_grad()) want.push_back(t);
  return want;
}

// The peak a piece of backward allocates above what was held before it.
template <typename F>
int64_t workspace_of(memory::MemoryScope& scope, F&& run) {
  const int64_t before = scope.current_bytes();
  scope.reset_peak();
  run();
  return scope.peak_bytes() - before;
}

}  // namespace

StageMemory measure_stage_memory(const PipelineStage& stage, const Tensors& inputs,
                                 const std::function<torch::Tensor(const Tensors&)>& loss) {
  memory::MemoryScope scope;
  StageMemory out;
  {
    Probe p = forward_probe(stage, inputs, loss, scope, false);
    out.activation_bytes = p.held;
    Tensors want = stage_inputs(stage, p.in);
    const Tensors params = stage.trainable_parameters();
    want.insert(want.end(), params.begin(), params.end());
    out.workspace_bytes = workspace_of(scope, [&] {
      if (!p.roots.empty() && !want.empty())
        torch::autograd::grad(p.roots, want, p.grads, false, false, /*allow_unused=*/true);
    });
  }
  Probe p = forward_probe(stage, inputs, loss, scope, true);
  out.split_activation_bytes = p.held;
  Tensors want = stage_inputs(stage, p.in);
  for (const auto& u : p.units) want.push_back(u.output);
  Tensors unit_grads;
  const int64_t before_i = scope.current_bytes();
  out.input_workspace_bytes = workspace_of(scope, [&] {
    if (p.roots.empty() || want.empty()) return;
    Tensors got = torch::autograd::grad(p.roots, want, p.grads, true, false, true);
    unit_grads.assign(got.end() - static_cast<int64_t>(p.units.size()), got.end());
  });
  out.weight_pending_bytes = scope.current_bytes() - before_i;
  out.weight_workspace_bytes = workspace_of(scope, [&] {
    for (size_t u = 0; u < unit_grads.size(); ++u)
      if (unit_grads[u].defined() && p.units[u].output.requires_grad())
        torch::autograd::grad({p.units[u].output}, p.units[u].parameters, {unit_grads[u]}, true,
                              false, true);
  });
  return out;
}

}  // namespace cohort::pipeline
