#include "cohort/dcp/state_dict/detail/adapters.h"

#include <map>
#include <unordered_map>

#include "cohort/core/error.h"
#include "cohort/dcp/state_dict/detail/optimizer_slots.h"
#include "cohort/dcp/state_dict/detail/param_group_options.h"

namespace cohort::dcp::detail {
namespace {

TensorEntry replicated(const std::string& fqn, const torch::Tensor& t) {
  return {fqn, t.sizes().vec(), t.scalar_type(), true, {{whole(t.sizes().vec()), t}}};
}

void add_buffers(StateDict& state, torch::nn::Module& model) {
  for (const auto& b : model.named_buffers()) {
    state.tensors.push_back(replicated("model." + b.key(), b.value()));
  }
  for (const auto& m : model.named_modules("", /*include_self=*/false)) {
    state.modules.push_back("model." + m.key());
  }
}

// Whether `a` and `b` are the same entries, viewing the same tensors.
bool same_entries(const std::vector<TensorEntry>& a, const std::vector<TensorEntry>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto &x = a[i], &y = b[i];
    if (x.fqn != y.fqn || x.shape != y.shape || x.dtype != y.dtype ||
        x.replicated != y.replicated || x.write != y.write || x.shards.size() != y.shards.size()) {
      return false;
    }
    for (size_t k = 0; k < x.shards.size(); ++k) {
      const auto &s = x.shards[k], &t = y.shards[k];
      if (s.box.offsets != t.box.offsets || s.box.lengths != t.box.lengths ||
          !s.data.is_same(t.data)) {
        return false;
      }
    }
  }
  return true;
}

ParamSlot whole_slot(const std::string& fqn, const torch::Tensor& p) {
  return {fqn, p.sizes().vec(), p, {whole(p.sizes().vec())}, {0}, true, true};
}

// A parameter's fused state under the names LibTorch's AdamW gives it.
std::vector<std::pair<std::string, torch::Tensor>> named_fused_state(const FusedParamState& held) {
  return {{"exp_avg", held.exp_avg},
          {"exp_avg_sq", held.exp_avg_sq},
          {"max_exp_avg_sq", held.max_exp_avg_sq}};
}

// Parameter i of `fused` (named fqn): its AdamW state where LibTorch's
// AdamW would hold it, once the parameter stepped, or when loading a
// checkpoint that holds it (a view into the flat buffers: loaded in place).
void add_fused_state(StateDict& state, FusedDistributedOptimizer& fused, size_t i,
                     const std::string& fqn, const Metadata* for_load) {
  const std::string prefix = "optim." + fqn + ".";
  auto in_checkpoint = [&](const std::string& name) {
    return for_load && for_load->find(prefix + name);
  };
  // amsgrad state saved elsewhere needs the buffers this optimizer may lack.
  if (in_checkpoint("max_exp_avg_sq")) fused.allocate_amsgrad_state();
  const auto held = fused.param_state(i);
  const bool stepped = held.step > 0;
  std::vector<const void*> viewed;
  for (const auto& [name, t] : named_fused_state(held)) {
    if (!t.defined() || !(stepped || in_checkpoint(name))) continue;
    state.tensors.push_back(replicated(prefix + name, t));
    viewed.push_back(t.data_ptr());
  }
  // Stale once the parameter's first step makes state to save, or when
  // other buffers hold it (views of the old ones keep those alive, so an
  // address is never reused meanwhile).
  state.stale.push_back([&fused, i, fqn, viewed]() -> std::string {
    const auto now = fused.param_state(i);
    std::vector<const void*> saved;
    for (const auto& [name, t] : named_fused_state(now)) {
      if (t.defined() && now.step > 0) saved.push_back(t.data_ptr());
    }
    if (saved == viewed) return "";
    return "optim." + fqn +
           ": the fused optimizer holds other state for it than the state dict views";
  });
  if (viewed.empty()) return;
  auto step = torch::tensor(held.step, torch::kLong);
  state.tensors.push_back(replicated(prefix + "step", step));
  state.after_load.push_back([&fused, i, step] { fused.set_param_step(i, step.item<int64_t>()); });
  state.refresh.push_back([&fused, i, step] { step.fill_(fused.param_state(i).step); });
}

// The options of the fused optimizer's one group under every parameter's
// name, as add_optimizer_state writes a LibTorch optimizer's groups.
// Loading, each option must be the same for every parameter: a checkpoint
// of groups with different options (no weight decay on the biases) does
// not fit one group, and taking one parameter's would train the others
// with options they never had.
void add_fused_options(StateDict& state, FusedDistributedOptimizer& fused,
                       const std::vector<std::string>& fqns, const Metadata* for_load) {
  GroupTargets targets;
  for (const auto& fqn : fqns) {
    if (for_load) check_same_class(fused.options(), *for_load, fqn);
    const std::string prefix = "optim.param_groups." + fqn + ".";
    for (const auto& [name, value] : group_options(fused.options())) {
      if (for_load && !for_load->find(prefix + name)) continue;
      auto t = torch::tensor(value, torch::kDouble);
      state.tensors.push_back(replicated(prefix + name, t));
      targets[name].emplace_back(fqn, t);
    }
  }
  if (targets.empty()) return;
  state.check_before_load.push_back([targets](const auto& value) {
    check_one_value(targets, value, "the fused optimizer's one parameter group");
  });
  state.after_load.push_back([&fused, targets] {
    for (const auto& [name, values] : targets) {
      set_group_option(fused.options(), name, values.front().second.item<double>());
    }
  });
  state.refresh.push_back([&fused, targets] {
    for (const auto& [name, value] : group_options(fused.options())) {
      auto it = targets.find(name);
      if (it == targets.end()) continue;
      for (const auto& [fqn, t] : it->second) t.fill_(value);
    }
  });
}

}  // namespace

StateDict ddp_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         const Metadata* for_load) {
  StateDict state;
  std::vector<ParamSlot> slots;
  for (const auto& p : model.named_parameters()) {
    state.tensors.push_back(replicated("model." + p.key(), p.value()));
    slots.push_back(whole_slot(p.key(), p.value()));
  }
  add_buffers(state, model);
  if (optimizer) add_optimizer_state(state, *optimizer, slots, for_load);
  set_rebuilds(state, for_load, [&model, optimizer](const Metadata* meta) {
    return ddp_state_dict(model, optimizer, meta);
  });
  return state;
}

StateDict zero_state_dict(torch::nn::Module& model, ZeroRedundancyOptimizer& zero,
                          const Metadata* for_load) {
  StateDict state;
  const auto named = model.named_parameters();
  const auto& part = zero.partition();
  // Paired by identity: ZeRO's flat order is group by group, and
  // flatten_into's set_data keeps each parameter's TensorImpl. ZeRO holds a
  // tied tensor once; each of its names gets its state, as with DDP and a
  // LibTorch optimizer.
  std::map<const void*, size_t> index_of;
  for (size_t i = 0; i < zero.params().size(); ++i) {
    index_of[zero.params()[i].unsafeGetTensorImpl()] = i;
  }
  std::vector<std::vector<size_t>> names_of(zero.params().size());
  for (size_t n = 0; n < named.size(); ++n) {
    auto it = index_of.find(named[n].value().unsafeGetTensorImpl());
    if (it == index_of.end()) {
      throw InvalidArgument("dcp::zero_state_dict: parameter " + named[n].key() +
                            " is not one the optimizer steps (build it over the model's "
                            "parameters)");
    }
    names_of[it->second].push_back(n);
  }
  for (size_t i = 0; i < names_of.size(); ++i) {
    if (names_of[i].empty()) {
      throw InvalidArgument("dcp::zero_state_dict: the optimizer's parameter " + std::to_string(i) +
                            " (group " + std::to_string(part.params()[i].group) + ", " +
                            shape_string(zero.params()[i].sizes().vec()) +
                            ") is not one of the model's");
    }
  }
  for (const auto& p : named) state.tensors.push_back(replicated("model." + p.key(), p.value()));
  add_buffers(state, model);
  // Each group's options are every rank's (the inner optimizer has every
  // group, holding this rank's pieces): every parameter's, on every rank,
  // so that each rank checks a load against the whole group.
  std::vector<GroupMember> members;
  for (size_t i = 0; i < names_of.size(); ++i) {
    for (const size_t n : names_of[i]) {
      members.push_back(
          {named[n].key(), &zero.param_groups().at(part.params()[i].group), true, true});
    }
  }
  std::vector<ParamSlot> slots;
  const auto& pieces = part.pieces();
  for (size_t k = 0; k < pieces.size(); ++k) {
    const auto& pc = pieces[k];
    for (const size_t n : names_of[pc.param]) {
      ParamSlot slot;
      slot.fqn = named[n].key();
      slot.shape = named[n].value().sizes().vec();
      slot.key = zero.shard_pieces()[k];
      // A parameter of no elements is one empty piece, rank 0's: its state
      // is its step (and empty tensors), which that rank saves.
      if (pc.numel > 0) {
        slot.boxes = boxes_of_range(slot.shape, pc.param_offset, pc.param_offset + pc.numel);
      }
      int64_t at = 0;
      for (const auto& b : slot.boxes) {
        slot.flat_offsets.push_back(at);
        at += b.numel();
      }
      slot.owns_step = pc.param_offset == 0;
      slots.push_back(std::move(slot));
    }
  }
  add_optimizer_state(state, zero.shard_optimizer(), slots, for_load, &members);
  set_rebuilds(state, for_load, [&model, &zero](const Metadata* meta) {
    return zero_state_dict(model, zero, meta);
  });
  return state;
}

StateDict fsdp_state_dict(FullyShardImpl& model, torch::optim::Optimizer* optimizer,
                          const Metadata* for_load) {
  // Each sharded parameter's place: its unit's layout entry; its unit and
  // index there.
  std::map<const void*, const fsdp::ParamShard*> shard_of;
  std::map<const void*, std::pair<const fsdp::FSDPParamGroup*, size_t>> group_of;
  int rank = 0;
  // HSDP: every replica holds the same shards; the first one writes them
  // (every rank loads its own).
  bool writes = true;
  for (const auto& m : model.modules()) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.get());
    if (!unit || !unit->has_param_group()) continue;
    const auto& group = unit->param_group();
    if (group.is_unsharded()) {
      throw InvalidArgument("dcp::fsdp_state_dict: unit " + group.unit() +
                            " holds its full parameters; call it between steps (sharded)");
    }
    rank = group.layout().rank;
    if (unit->replicate_group()) writes = unit->replicate_group()->rank() == 0;
    for (size_t j = 0; j < group.params().size(); ++j) {
      shard_of[group.params()[j].unsafeGetTensorImpl()] = &group.layout().params[j];
      group_of[group.params()[j].unsafeGetTensorImpl()] = {&group, j};
    }
  }
  StateDict state;
  // A parameter whose storage was replaced after fully_shard (torch::load,
  // Module::to, set_data) shows other values than its unit holds, which
  // its next all-gather would discard: saving them would write what the
  // model does not hold, loading would fill a tensor it no longer uses. So
  // every operation on this state dict checks (then, not now: the
  // replacement may come after get_state_dict), on every rank where it is
  // collective, and such a parameter's shard here is a stand-in.
  std::vector<std::pair<std::string, std::pair<const fsdp::FSDPParamGroup*, size_t>>> sharded;
  for (const auto& p : model.named_parameters()) {
    auto g = group_of.find(p.value().unsafeGetTensorImpl());
    if (g != group_of.end()) sharded.emplace_back(p.key(), g->second);
  }
  const int world_rank = model.mesh().process_group()->rank();
  state.check_model.push_back([sharded, world_rank](const std::string& op) {
    for (const auto& [fqn, at] : sharded) {
      if (at.first->holds_storage(at.second)) continue;
      throw InvalidArgument(op + " on rank " + std::to_string(world_rank) +
                            ": the fully sharded model's parameter '" + fqn +
                            "' would be saved or loaded through a tensor its unit no longer "
                            "uses: " +
                            at.first->replaced_storage());
    }
  });
  std::vector<ParamSlot> slots;
  for (const auto& p : model.named_parameters()) {
    auto it = shard_of.find(p.value().unsafeGetTensorImpl());
    if (it == shard_of.end()) {  // held whole by every rank
      state.tensors.push_back(replicated("model." + p.key(), p.value()));
      slots.push_back(whole_slot(p.key(), p.value()));
      continue;
    }
    const auto& ps = *it->second;
    const auto& [group, index] = group_of.at(p.value().unsafeGetTensorImpl());
    const bool held = group->holds_storage(index);
    const auto dtype = held ? p.value().scalar_type() : group->sharded_dtype();
    TensorEntry e{"model." + p.key(), ps.full_sizes, dtype, false, {}, writes};
    if (ps.local_rows > 0) {
      Box box = whole(ps.full_sizes);
      if (!box.offsets.empty()) {
        box.offsets[0] = rank * ps.chunk_rows;
        box.lengths[0] = ps.local_rows;
      }
      e.shards.push_back({box, held ? p.value().view(box.lengths)
                                    : torch::zeros(box.lengths, torch::dtype(dtype))});
      slots.push_back({p.key(),
                       ps.full_sizes,
                       p.value(),
                       {box},
                       {0},
                       false,
                       box.offsets.empty() || box.offsets[0] == 0,
                       writes});
    } else {
      // An empty shard still has optimizer state (its step): loaded, and
      // saved by rank 0 where no rank holds row 0 (a parameter of no rows),
      // or nobody would save it and no load would find it.
      const bool no_rows = !ps.full_sizes.empty() && ps.full_sizes[0] == 0;
      slots.push_back(
          {p.key(), ps.full_sizes, p.value(), {}, {}, false, no_rows && rank == 0, writes});
    }
    state.tensors.push_back(std::move(e));
  }
  add_buffers(state, model);
  if (optimizer) add_optimizer_state(state, *optimizer, slots, for_load);
  set_rebuilds(state, for_load, [&model, optimizer](const Metadata* meta) {
    return fsdp_state_dict(model, optimizer, meta);
  });
  return state;
}

StateDict fused_state_dict(torch::nn::Module& model, FusedDistributedOptimizer& fused,
                           const Metadata* for_load) {
  const auto named = model.named_parameters();
  const auto& params = fused.params();
  if (named.size() != params.size()) {
    throw InvalidArgument("dcp::fused_state_dict: the model has " + std::to_string(named.size()) +
                          " parameters, the optimizer " + std::to_string(params.size()));
  }
  StateDict state;
  std::vector<std::string> fqns;
  for (size_t i = 0; i < named.size(); ++i) {
    if (!named[i].value().is_same(params[i])) {
      throw InvalidArgument("dcp::fused_state_dict: parameter " + named[i].key() +
                            " is not the optimizer's parameter " + std::to_string(i) +
                            " (build the optimizer over model.parameters())");
    }
    state.tensors.push_back(replicated("model." + named[i].key(), named[i].value()));
    fqns.push_back(named[i].key());
  }
  add_buffers(state, model);
  add_fused_options(state, fused, fqns, for_load);
  for (size_t i = 0; i < fqns.size(); ++i) add_fused_state(state, fused, i, fqns[i], for_load);
  set_rebuilds(state, for_load, [&model, &fused](const Metadata* meta) {
    return fused_state_dict(model, fused, meta);
  });
  return state;
}

void set_rebuilds(StateDict& state, const Metadata* for_load,
                  std::function<StateDict(const Metadata*)> build) {
  if (!for_load) state.load_targets = [build](const Metadata& meta) { return build(&meta); };
  // The entries as made: a change the caller made to them since (an entry
  // left out, another added) would not be in the rebuilt state dict.
  state.rebuild = [build, made = state.tensors](const StateDict& self) {
    if (!same_entries(self.tensors, made)) {
      throw InvalidArgument("its entries were changed after get_state_dict made it");
    }
    return build(nullptr);
  };
}

}  // namespace cohort::dcp::detail
