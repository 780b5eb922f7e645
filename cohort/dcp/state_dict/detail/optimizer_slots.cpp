#include "cohort/dcp/state_dict/detail/optimizer_slots.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>
#include <memory>

#include "cohort/core/error.h"
#include "cohort/core/torch_compat.h"
#include "cohort/dcp/state_dict/detail/param_group_options.h"
#include "cohort/optim/optimizer_state.h"

namespace cohort::dcp::detail {
namespace {

using Named = std::map<std::string, torch::Tensor>;
using torch::optim::OptimizerParamState;

torch::Tensor get(const Named& t, const char* name) {
  auto it = t.find(name);
  return it == t.end() ? torch::Tensor() : it->second;
}

bool has_step(const torch::optim::Optimizer& opt) {
  using namespace torch::optim;
  return dynamic_cast<const AdamW*>(&opt) || dynamic_cast<const Adam*>(&opt) ||
         dynamic_cast<const RMSprop*>(&opt) || dynamic_cast<const Adagrad*>(&opt);
}

// A state object of `opt`'s class holding `t` (the inverse of state_tensors).
std::unique_ptr<OptimizerParamState> make_state(const torch::optim::Optimizer& opt,
                                                const Named& t) {
  using namespace torch::optim;
  if (dynamic_cast<const AdamW*>(&opt)) {
    auto s = std::make_unique<AdamWParamState>();
    s->exp_avg(get(t, "exp_avg")).exp_avg_sq(get(t, "exp_avg_sq"));
    s->max_exp_avg_sq(get(t, "max_exp_avg_sq"));
    return s;
  }
  if (dynamic_cast<const Adam*>(&opt)) {
    auto s = std::make_unique<AdamParamState>();
    s->exp_avg(get(t, "exp_avg")).exp_avg_sq(get(t, "exp_avg_sq"));
    s->max_exp_avg_sq(get(t, "max_exp_avg_sq"));
    return s;
  }
  if (dynamic_cast<const SGD*>(&opt)) {
    auto s = std::make_unique<SGDParamState>();
    s->momentum_buffer(get(t, "momentum_buffer"));
    return s;
  }
  if (dynamic_cast<const RMSprop*>(&opt)) {
    auto s = std::make_unique<RMSpropParamState>();
    s->square_avg(get(t, "square_avg")).momentum_buffer(get(t, "momentum_buffer"));
    s->grad_avg(get(t, "grad_avg"));
    return s;
  }
  if (dynamic_cast<const Adagrad*>(&opt)) {
    auto s = std::make_unique<AdagradParamState>();
    s->sum(get(t, "sum"));
    return s;
  }
  throw Unsupported("dcp: cannot restore the state of this optimizer class");
}

void set_step(OptimizerParamState& state, int64_t step) {
  using namespace torch::optim;
  if (auto* s = dynamic_cast<AdamWParamState*>(&state)) s->step(step);
  if (auto* s = dynamic_cast<AdamParamState*>(&state)) s->step(step);
  if (auto* s = dynamic_cast<RMSpropParamState*>(&state)) s->step(step);
  if (auto* s = dynamic_cast<AdagradParamState*>(&state)) s->step(step);
}

// The entry named `fqn` in `state` (added on first use: a parameter may
// have several slots on one rank); written when any of them writes it.
TensorEntry& entry(StateDict& state, std::map<std::string, size_t>& index, const std::string& fqn,
                   const std::vector<int64_t>& shape, torch::Dtype dtype, bool replicated,
                   bool write) {
  auto [it, fresh] = index.try_emplace(fqn, state.tensors.size());
  if (fresh) state.tensors.push_back({fqn, shape, dtype, replicated, {}, false});
  auto& e = state.tensors[it->second];
  e.write = e.write || write;
  return e;
}

void add_boxes(TensorEntry& e, const ParamSlot& slot, const torch::Tensor& tensor) {
  auto flat = tensor.reshape(-1);
  for (size_t k = 0; k < slot.boxes.size(); ++k) {
    e.shards.push_back(
        {slot.boxes[k],
         flat.narrow(0, slot.flat_offsets[k], slot.boxes[k].numel()).view(slot.boxes[k].lengths)});
  }
}

// A 0-d value every slot of a parameter on this rank shares (its step, an
// option of its group): one shard per rank, which load fills and every
// slot then takes; written by the slot that saves the step.
torch::Tensor shared_value(StateDict& state, std::map<std::string, size_t>& index,
                           const std::string& fqn, torch::Dtype dtype, const ParamSlot& slot,
                           double value) {
  auto& e = entry(state, index, fqn, {}, dtype, slot.replicated,
                  slot.write && (slot.owns_step || slot.replicated));
  if (e.shards.empty()) e.shards.push_back({Box{}, torch::tensor(value, dtype)});
  return e.shards[0].data;
}

// The options of the group that holds `slot` (lr, betas, ...), as 0-d
// float64 tensors "optim.param_groups.<param fqn>.<option>", whether or
// not the slot has state yet. Loading into the group of every slot; a
// checkpoint without them (`for_load` lacks them) leaves the options as
// they are.
void add_group_options(StateDict& state, std::map<std::string, size_t>& index,
                       const std::map<const void*, torch::optim::OptimizerParamGroup*>& groups,
                       const ParamSlot& slot, const Metadata* for_load) {
  auto it = groups.find(slot.key.unsafeGetTensorImpl());
  if (it == groups.end()) return;
  auto* group = it->second;
  const std::string prefix = "optim.param_groups." + slot.fqn + ".";
  for (const auto& [name, value] : group_options(group->options())) {
    if (for_load && !for_load->find(prefix + name)) continue;
    auto target = shared_value(state, index, prefix + name, torch::kDouble, slot, value);
    state.after_load.push_back([group, option = name, target] {
      set_group_option(group->options(), option, target.item<double>());
    });
  }
}

}  // namespace

void add_optimizer_state(StateDict& state, torch::optim::Optimizer& optimizer,
                         const std::vector<ParamSlot>& slots, const Metadata* for_load) {
  std::map<std::string, size_t> index;
  const bool stepped = has_step(optimizer);
  const auto groups = groups_by_param(optimizer);
  for (const auto& slot : slots) {
    add_group_options(state, index, groups, slot, for_load);
    const auto key = optimizer_state_key(slot.key);
    auto it = optimizer.state().find(key);
    const bool exists = it != optimizer.state().end();
    const std::string prefix = "optim." + slot.fqn + ".";
    Named tensors;
    if (exists) {
      for (auto& [name, t] : state_tensors(*it->second)) tensors[name] = t;
    } else if (for_load) {
      for (const auto& name : state_names(optimizer)) {
        if (for_load->find(prefix + name)) tensors[name] = torch::zeros_like(slot.key).contiguous();
      }
    }
    if (tensors.empty()) continue;
    for (const auto& [name, t] : tensors) {
      add_boxes(entry(state, index, prefix + name, slot.shape, t.scalar_type(), slot.replicated,
                      slot.write),
                slot, t);
    }
    if (!exists) {
      state.after_load.push_back(
          [&optimizer, key, tensors] { optimizer.state()[key] = make_state(optimizer, tensors); });
    }
    if (!stepped) continue;
    const auto value = exists ? static_cast<double>(*state_step(*it->second)) : 0.0;
    auto step = shared_value(state, index, prefix + "step", torch::kLong, slot, value);
    state.after_load.push_back(
        [&optimizer, key, step] { set_step(*optimizer.state().at(key), step.item<int64_t>()); });
  }
}

}  // namespace cohort::dcp::detail
