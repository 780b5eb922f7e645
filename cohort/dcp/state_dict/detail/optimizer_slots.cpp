#include "cohort/dcp/state_dict/detail/optimizer_slots.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>
#include <memory>
#include <tuple>

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

// Box k of `slot` in `tensor` (shaped like the slot) as a view, so that a
// load writes into the optimizer's tensor and a save reads it as it is then.
void add_boxes(StateDict& state, TensorEntry& e, const ParamSlot& slot,
               const torch::Tensor& tensor) {
  auto flat_boxes = [&](const torch::Tensor& flat) {
    for (size_t k = 0; k < slot.boxes.size(); ++k) {
      e.shards.push_back({slot.boxes[k], flat.narrow(0, slot.flat_offsets[k], slot.boxes[k].numel())
                                             .view(slot.boxes[k].lengths)});
    }
  };
  if (tensor.is_contiguous()) return flat_boxes(tensor.view(-1));
  // A strided tensor (Adam's state of a transposed parameter keeps its
  // strides): reshape would copy, and a load would fill the copy.
  if (slot.boxes.size() == 1 && tensor.sizes().vec() == slot.boxes[0].lengths) {
    e.shards.push_back({slot.boxes[0], tensor});
    return;
  }
  // Flat ranges of a strided tensor are no views: the boxes view a
  // contiguous copy, taken again before a save and copied back after a load.
  auto copy = tensor.contiguous();
  flat_boxes(copy.view(-1));
  state.refresh.push_back([tensor, copy]() mutable {
    torch::NoGradGuard no_grad;
    copy.copy_(tensor);
  });
  state.after_load.push_back([tensor, copy]() mutable {
    torch::NoGradGuard no_grad;
    tensor.copy_(copy);
  });
}

// A 0-d value every slot of a parameter on this rank shares (its step):
// one shard per rank, which load fills and every slot then takes; written
// by the slot that saves the step.
torch::Tensor shared_value(StateDict& state, std::map<std::string, size_t>& index,
                           const std::string& fqn, torch::Dtype dtype, const ParamSlot& slot,
                           double value) {
  auto& e = entry(state, index, fqn, {}, dtype, slot.replicated,
                  slot.write && (slot.owns_step || slot.replicated));
  if (e.shards.empty()) e.shards.push_back({Box{}, torch::tensor(value, dtype)});
  return e.shards[0].data;
}

// Each slot's parameter as a member of its group, once per parameter.
std::vector<GroupMember> members_of(torch::optim::Optimizer& optimizer,
                                    const std::vector<ParamSlot>& slots) {
  const auto groups = groups_by_param(optimizer);
  std::vector<GroupMember> out;
  std::map<std::pair<std::string, const void*>, size_t> seen;
  for (const auto& slot : slots) {
    auto it = groups.find(slot.key.unsafeGetTensorImpl());
    if (it == groups.end()) continue;
    const bool write = slot.write && (slot.owns_step || slot.replicated);
    auto [at, fresh] = seen.try_emplace({slot.fqn, it->second}, out.size());
    if (fresh) {
      out.push_back({slot.fqn, it->second, slot.replicated, write});
    } else {
      out[at->second].write = out[at->second].write || write;
    }
  }
  return out;
}

// The options of each member's group (lr, betas, ...), as 0-d float64
// tensors "optim.param_groups.<param fqn>.<option>", whether or not the
// parameter has state yet. Loading sets each group's options from its
// members' values, which must agree (a checkpoint of other groups whose
// parameters share a group here is refused on every rank before anything
// changes); a checkpoint without them (`for_load` lacks them) leaves the
// options as they are. A save writes the options the groups hold then.
void add_group_options(StateDict& state, std::map<std::string, size_t>& index,
                       const std::vector<GroupMember>& members, const Metadata* for_load) {
  // Groups in first-member order, the same on every rank that holds them.
  std::vector<std::pair<torch::optim::OptimizerParamGroup*, GroupTargets>> groups;
  std::map<const void*, size_t> group_index;
  for (const auto& m : members) {
    auto [gi, fresh] = group_index.try_emplace(m.group, groups.size());
    if (fresh) groups.emplace_back(m.group, GroupTargets{});
    auto& targets = groups[gi->second].second;
    if (for_load) check_same_class(m.group->options(), *for_load, m.fqn);
    const std::string prefix = "optim.param_groups." + m.fqn + ".";
    for (const auto& [name, value] : group_options(m.group->options())) {
      if (for_load && !for_load->find(prefix + name)) continue;
      auto& e = entry(state, index, prefix + name, {}, torch::kDouble, m.replicated, m.write);
      if (e.shards.empty()) e.shards.push_back({Box{}, torch::tensor(value, torch::kDouble)});
      targets[name].emplace_back(m.fqn, e.shards[0].data);
    }
  }
  if (groups.empty()) return;
  state.check_before_load.push_back([groups](const auto& value) {
    for (const auto& [group, targets] : groups) {
      check_one_value(targets, value, "one parameter group of the optimizer");
    }
  });
  state.after_load.push_back([groups] {
    for (const auto& [group, targets] : groups) {
      for (const auto& [name, values] : targets) {
        set_group_option(group->options(), name, values.front().second.item<double>());
      }
    }
  });
  state.refresh.push_back([groups] {
    for (const auto& [group, targets] : groups) {
      for (const auto& [name, value] : group_options(group->options())) {
        auto it = targets.find(name);
        if (it == targets.end()) continue;
        for (const auto& [fqn, target] : it->second) target.fill_(value);
      }
    }
  });
}

}  // namespace

void add_optimizer_state(StateDict& state, torch::optim::Optimizer& optimizer,
                         const std::vector<ParamSlot>& slots, const Metadata* for_load,
                         const std::vector<GroupMember>* members) {
  std::map<std::string, size_t> index;
  const bool stepped = has_step(optimizer);
  add_group_options(state, index, members ? *members : members_of(optimizer, slots), for_load);
  // Per slot, the state tensors this state dict views (none: no state yet).
  std::vector<std::tuple<std::string, OptimizerStateKey, Named>> viewed;
  for (const auto& slot : slots) {
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
    viewed.emplace_back(slot.fqn, key, tensors);
    if (tensors.empty()) continue;
    for (const auto& [name, t] : tensors) {
      add_boxes(state,
                entry(state, index, prefix + name, slot.shape, t.scalar_type(), slot.replicated,
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
    // The step goes on after the state dict is made: a save writes the count then.
    state.refresh.push_back([&optimizer, key, step]() mutable {
      auto held = optimizer.state().find(key);
      if (held == optimizer.state().end()) return;
      if (auto n = state_step(*held->second)) step.fill_(*n);
    });
  }
  // Stale once the optimizer holds other state for a slot than the state
  // dict views: state made at a parameter's first step, or state objects
  // replaced (the optimizer's own load), whose old tensors it would save.
  // The groups are viewed by address: another group moves them.
  state.stale.push_back([&optimizer, viewed = std::move(viewed),
                         groups = optimizer.param_groups().size()]() -> std::string {
    if (optimizer.param_groups().size() != groups) {
      return "the optimizer has " + std::to_string(optimizer.param_groups().size()) +
             " parameter groups, it had " + std::to_string(groups);
    }
    for (const auto& [fqn, key, tensors] : viewed) {
      Named now;
      auto held = optimizer.state().find(key);
      if (held != optimizer.state().end()) {
        for (auto& [name, t] : state_tensors(*held->second)) now[name] = t;
      }
      bool same = now.size() == tensors.size();
      for (auto a = now.cbegin(), b = tensors.cbegin(); same && a != now.cend(); ++a, ++b) {
        same = a->first == b->first && a->second.is_same(b->second);
      }
      if (same) continue;
      return "optim." + fqn + ": the optimizer " +
             (tensors.empty() ? std::string("made its state after the state dict was made")
                              : std::string("holds other state tensors than the state dict views"));
    }
    return "";
  });
}

}  // namespace cohort::dcp::detail
