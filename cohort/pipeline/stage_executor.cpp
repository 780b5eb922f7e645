#include "cohort/pipeline/stage_executor.h"

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "cohort/core/error.h"

namespace cohort::pipeline {
namespace {

bool needs_grad(const torch::Tensor& t) { return t.defined() && t.requires_grad(); }

// A first gradient is copied, as AccumulateGrad copies one it cannot
// prove unshared: autograd returns the gradient an op passes through
// unchanged as one tensor for each of its inputs (out = h + P: h's and P's),
// so P's .grad would be h's gradient, still held for the previous stage or
// SEND_B when the next micro-batch's backward adds into .grad in place.
void add_gradients(const std::vector<torch::Tensor>& params,
                   const std::vector<torch::Tensor>& grads, size_t offset) {
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& g = grads[offset + i];
    if (!g.defined()) continue;
    torch::Tensor p = params[i];
    if (p.grad().defined())
      p.mutable_grad().add_(g);
    else
      p.mutable_grad() = g.detach().clone();
  }
}

// The message of `error` (a c10::Error's without its backtrace).
std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

const char* slot_state_name(SlotState state) {
  switch (state) {
    case SlotState::Free:
      return "Free";
    case SlotState::Forwarded:
      return "Forwarded";
    case SlotState::WeightsAndGrads:
      return "WeightsAndGrads";
    case SlotState::Weights:
      return "Weights";
    case SlotState::Grads:
      return "Grads";
  }
  return "?";
}

StageExecutor::StageExecutor(const std::vector<PipelineStage>& stages,
                             const PipelineSchedule& schedule, int rank,
                             const PipelineLossFn& loss_fn)
    : schedule_(schedule), rank_(rank), loss_fn_(loss_fn) {
  split_backward_.assign(schedule_.num_stages, false);
  for (const auto& act : schedule_.actions[rank])
    if (act.type == ActionType::BackwardInput) split_backward_[act.stage] = true;
  for (const auto& st : stages) local_[st.index()] = &st;
}

void StageExecutor::begin_step(std::vector<Tensors> micro_inputs,
                               std::vector<Tensors> micro_targets) {
  micro_inputs_ = std::move(micro_inputs);
  micro_targets_ = std::move(micro_targets);
  losses_ = StepLosses{};
  losses_.losses.assign(schedule_.num_microbatches, 0.0);
  live_ = peak_live_ = 0;
  skipping_ = false;
  failure_.clear();
  failure_ptr_ = nullptr;
}

// The first failure is the one reported; any failure ends the stages'
// code for the step (a later one may only follow from the first).
void StageExecutor::fail(const std::string& where, std::exception_ptr error) {
  skipping_ = true;
  if (!failure_.empty()) return;
  failure_ = where + ": " + message_of(error);
  failure_ptr_ = std::move(error);
}

void StageExecutor::put_inputs(int stage, int mb, Tensors inputs) {
  received_inputs_[{stage, mb}] = std::move(inputs);
}

void StageExecutor::put_grads(int stage, int mb, Tensors grads) {
  received_grads_[{stage, mb}] = std::move(grads);
}

SlotState StageExecutor::state(int stage, int mb) const {
  auto it = slots_.find({stage, mb});
  return it == slots_.end() ? SlotState::Free : it->second.state;
}

// The slot of `key`, which must be in one of the states `from`.
StageExecutor::Slot& StageExecutor::slot_in(const Key& key, std::initializer_list<SlotState> from,
                                            const char* action) {
  auto it = slots_.find(key);
  const SlotState now = it == slots_.end() ? SlotState::Free : it->second.state;
  if (std::find(from.begin(), from.end(), now) == from.end()) {
    std::ostringstream os;
    for (SlotState s : from) os << (s == *from.begin() ? "" : " or ") << slot_state_name(s);
    COHORT_CHECK(false, "PipelineRuntime on rank " << rank_ << ": " << action << " of stage "
                                                   << key.first << " micro-batch " << key.second
                                                   << " found its slot " << slot_state_name(now)
                                                   << ", expected " << os.str());
  }
  return it->second;
}

void StageExecutor::move_to(std::map<Key, Slot>::iterator it, SlotState to) {
  if (to == SlotState::Free)
    slots_.erase(it);
  else
    it->second.state = to;
}

const Tensors& StageExecutor::outputs(int stage, int mb) const {
  auto it = slots_.find({stage, mb});
  const SlotState now = it == slots_.end() ? SlotState::Free : it->second.state;
  COHORT_CHECK(now == SlotState::Forwarded, "PipelineRuntime on rank "
                                                << rank_ << ": the outputs of stage " << stage
                                                << " micro-batch " << mb << " are wanted in state "
                                                << slot_state_name(now) << ", expected Forwarded");
  return it->second.outputs;
}

bool StageExecutor::skipped(int stage, int mb) const {
  auto it = slots_.find({stage, mb});
  return it != slots_.end() && it->second.skipped;
}

void StageExecutor::replace_outputs(int stage, int mb, Tensors stand_in) {
  slot_in({stage, mb}, {SlotState::Forwarded}, "replacing the outputs").outputs =
      std::move(stand_in);
}

Tensors StageExecutor::take_input_grads(int stage, int mb) {
  Slot& slot = slot_in({stage, mb}, {SlotState::Grads, SlotState::WeightsAndGrads},
                       "handing over the input gradients");
  Tensors grads = std::move(slot.input_grads);
  slot.input_grads.clear();
  // W still needs the slot after an I.
  const bool weights = slot.state == SlotState::WeightsAndGrads;
  move_to(slots_.find({stage, mb}), weights ? SlotState::Weights : SlotState::Free);
  return grads;
}

// F's inputs: the micro-batch (stage 0), the received tensors, or the
// previous local stage's outputs.
Tensors StageExecutor::stage_inputs(int stage, int mb) {
  if (stage == 0) return micro_inputs_[mb];
  Tensors in;
  auto it = received_inputs_.find({stage, mb});
  if (it != received_inputs_.end()) {
    in = std::move(it->second);
    received_inputs_.erase(it);
  } else {
    in = outputs(stage - 1, mb);  // the same rank: no copy
  }
  // A graph per stage, so that each stage's backward stops at its inputs.
  for (auto& t : in)
    if (carries_gradient(t.scalar_type())) t = t.detach().requires_grad_(true);
  return in;
}

std::string StageExecutor::where(int stage, int mb, const char* action) const {
  return "stage " + std::to_string(stage) + " (on rank " + std::to_string(rank_) +
         ") threw in its " + action + " of micro-batch " + std::to_string(mb);
}

void StageExecutor::forward(int stage, int mb) {
  const Key key{stage, mb};
  slot_in(key, {SlotState::Free}, "F");
  Tensors in = stage_inputs(stage, mb);
  Slot slot;
  Tensors out;
  if (!skipping_) {
    try {
      out = local_.at(stage)->forward(in, split_backward_[stage] ? &slot.units : nullptr);
    } catch (...) {
      slot.units.clear();
      fail(where(stage, mb, "forward"), std::current_exception());
    }
  }
  slot.skipped = skipping_;
  peak_live_ = std::max(peak_live_, ++live_);
  slot.inputs = std::move(in);
  slot.state = SlotState::Forwarded;
  Slot& held = slots_[key] = std::move(slot);
  if (stage != schedule_.num_stages - 1)
    held.outputs = std::move(out);  // none when skipped: SEND_F puts the stand-in
  else if (held.skipped)
    held.outputs = {torch::zeros({})};
  else
    apply_loss(mb, held, out);
}

void StageExecutor::apply_loss(int mb, Slot& slot, const Tensors& out) {
  torch::Tensor loss;
  int64_t numel = 0;
  double value = 0;
  try {
    loss = loss_fn_(out, micro_targets_[mb]);
    numel = loss.numel();  // an undefined loss throws here
    value = numel == 1 ? loss.item<double>() : std::nan("");
  } catch (...) {
    fail("the loss function of stage " + std::to_string(schedule_.num_stages - 1) + " (on rank " +
             std::to_string(rank_) + ") threw for micro-batch " + std::to_string(mb),
         std::current_exception());
    slot.skipped = true;
    slot.outputs = {torch::zeros({})};
    return;
  }
  losses_.losses[mb] = value;
  if (numel != 1 || !loss.requires_grad()) {
    // Refused on every rank at the step's end, not here, where the other
    // ranks wait for this micro-batch's gradients. Until then a zero
    // without a graph stands in, so every stage's backward sends zeros and
    // the schedule runs to its end.
    if (losses_.bad_mb < 0) losses_.bad_mb = mb, losses_.bad_numel = numel;
    slot.outputs = {torch::zeros({}, loss.options())};
    return;
  }
  // The gradient convention (pipeline_runtime.h): d(loss / m), times the
  // step's loss scale (left out at 1, which would change no bit).
  torch::Tensor scaled = loss.reshape({}) / schedule_.num_microbatches;
  if (loss_scale_ != 1.0) scaled = scaled * loss_scale_;
  slot.outputs = {scaled};
}

// The gradients of a Forwarded slot's outputs: ones for the loss, else
// received or handed over by the next local stage.
Tensors StageExecutor::output_grads(int stage, int mb, const Slot& slot) {
  if (stage == schedule_.num_stages - 1) {
    // A NaN or Inf loss seeds NaN (1 + 0·x), the same bits as 1 otherwise: every stage's
    // gradients carry it to the global norm, which the Trainer checks.
    if (!non_finite_seeds_nan_) return {torch::ones_like(slot.outputs[0])};
    return {torch::ones_like(slot.outputs[0]) + slot.outputs[0].detach() * 0};
  }
  auto it = received_grads_.find({stage, mb});
  if (it == received_grads_.end()) return take_input_grads(stage + 1, mb);
  Tensors grads = std::move(it->second);
  received_grads_.erase(it);
  return grads;
}

void StageExecutor::backward(int stage, int mb, bool full) {
  Slot& slot = slot_in({stage, mb}, {SlotState::Forwarded}, full ? "B" : "I");
  const Tensors grads = output_grads(stage, mb, slot);
  // Outputs that carry a gradient pair with the gradients, in order.
  Tensors roots, root_grads;
  size_t gi = 0;
  for (const auto& o : slot.outputs) {
    if (!carries_gradient(o.scalar_type())) continue;
    COHORT_CHECK(gi < grads.size(), "stage " << stage << " has more outputs than gradients");
    if (needs_grad(o)) roots.push_back(o), root_grads.push_back(grads[gi]);
    ++gi;
  }
  // Stage 0's inputs are the batch: no stage takes their gradients.
  const bool send_back = stage > 0;
  Tensors want;
  std::vector<size_t> input_pos;
  for (size_t i = 0; send_back && i < slot.inputs.size(); ++i)
    if (needs_grad(slot.inputs[i])) want.push_back(slot.inputs[i]), input_pos.push_back(i);
  const size_t n_inputs = want.size();
  // What requires grad now: a parameter frozen or unfrozen since the
  // stage was built counts from its next step.
  const Tensors params = full ? local_.at(stage)->trainable_parameters() : Tensors{};
  const bool by_unit = !full && !slot.units.empty();
  want.insert(want.end(), params.begin(), params.end());
  if (by_unit)
    for (const auto& u : slot.units) want.push_back(u.output);
  // After a failure no stage's code runs: no roots, so zeros go back.
  if (skipping_) roots.clear(), root_grads.clear();
  Tensors got;
  if (!roots.empty() && !want.empty()) {
    try {
      got = torch::autograd::grad(roots, want, root_grads, /*retain_graph=*/!full,
                                  /*create_graph=*/false, /*allow_unused=*/true);
    } catch (...) {
      fail(where(stage, mb, "backward"), std::current_exception());
      roots.clear(), root_grads.clear();
    }
  }
  keep_input_grads(stage, slot, got, input_pos);
  auto it = slots_.find({stage, mb});
  if (full) {
    if (!got.empty()) add_gradients(params, got, n_inputs);
    release_activations(it);
    return;
  }
  if (by_unit) {
    slot.unit_grads.assign(got.begin() + (got.empty() ? 0 : n_inputs), got.end());
    if (got.empty()) slot.units.clear();
    slot.roots.clear();
  } else {
    slot.roots = std::move(roots), slot.root_grads = std::move(root_grads);
  }
  move_to(it, send_back ? SlotState::WeightsAndGrads : SlotState::Weights);
}

// Every input that carries a gradient gets one (zeros where unused): the
// receiver expects one message per such boundary tensor.
void StageExecutor::keep_input_grads(int stage, Slot& slot, const Tensors& got,
                                     const std::vector<size_t>& input_pos) {
  slot.input_grads.clear();
  for (size_t i = 0, k = 0; stage > 0 && i < slot.inputs.size(); ++i) {
    if (!carries_gradient(slot.inputs[i].scalar_type())) continue;
    torch::Tensor g;
    if (k < input_pos.size() && input_pos[k] == i) {
      if (!got.empty()) g = got[k];
      ++k;
    }
    slot.input_grads.push_back(g.defined() ? g : torch::zeros_like(slot.inputs[i]));
  }
}

void StageExecutor::backward_weight(int stage, int mb) {
  Slot& slot = slot_in({stage, mb}, {SlotState::WeightsAndGrads, SlotState::Weights}, "W");
  try {
    if (!skipping_) weight_gradients(stage, slot);
  } catch (...) {
    fail(where(stage, mb, "weight backward (W)"), std::current_exception());
  }
  release_activations(slots_.find({stage, mb}));
}

void StageExecutor::weight_gradients(int stage, const Slot& slot) {
  if (!slot.units.empty()) {
    // Each layer from its own output gradient: the engine runs only the
    // nodes between that output and the layer's parameters.
    for (size_t u = 0; u < slot.units.size(); ++u) {
      const auto& unit = slot.units[u];
      if (!needs_grad(unit.output) || !slot.unit_grads[u].defined()) continue;
      auto g = torch::autograd::grad({unit.output}, unit.parameters, {slot.unit_grads[u]},
                                     /*retain_graph=*/true, false, /*allow_unused=*/true);
      add_gradients(unit.parameters, g, 0);
    }
  } else if (!slot.roots.empty()) {
    const Tensors params = local_.at(stage)->trainable_parameters();
    if (!params.empty())
      add_gradients(params,
                    torch::autograd::grad(slot.roots, params, slot.root_grads, false, false, true),
                    0);
  }
}

// After the micro-batch's last backward action on the stage (B, or W after
// an I). Input gradients still waiting for their SEND_B or the previous
// local stage keep the slot, in Grads.
void StageExecutor::release_activations(std::map<Key, Slot>::iterator it) {
  Slot& slot = it->second;
  const bool hand_over = slot.state == SlotState::WeightsAndGrads ||
                         (slot.state == SlotState::Forwarded && it->first.first > 0);
  slot.inputs.clear(), slot.outputs.clear(), slot.units.clear(), slot.unit_grads.clear();
  slot.roots.clear(), slot.root_grads.clear();
  --live_;
  move_to(it, hand_over ? SlotState::Grads : SlotState::Free);
}

void StageExecutor::end_step() {
  auto it = slots_.begin();
  if (it == slots_.end()) return;
  const Key key = it->first;
  const SlotState now = it->second.state;
  abort();
  COHORT_CHECK(false, "PipelineRuntime on rank " << rank_ << ": the step ended with stage "
                                                 << key.first << " micro-batch " << key.second
                                                 << " in state " << slot_state_name(now)
                                                 << ", expected Free");
}

void StageExecutor::abort() {
  slots_.clear();
  received_inputs_.clear();
  received_grads_.clear();
}

}  // namespace cohort::pipeline
