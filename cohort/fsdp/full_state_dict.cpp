// FullyShardImpl's full (unsharded) state dict: gathered from the shards,
// and loaded into them after every key was checked.
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/fsdp/fsdp_state.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/fsdp/unit_agreement.h"

namespace cohort {

// Both work on this unit and the units inside it, in pre-order, with no
// schedule: the root's or an inner unit's (whose names are its module's),
// before or after the model's first forward.

torch::OrderedDict<std::string, torch::Tensor> FullyShardImpl::full_state_dict() {
  const auto units = subtree_units();
  // A replaced parameter (torch::load, Module::to) is refused on every rank
  // before its stale shard would be gathered.
  fsdp::agree_refusal(*world_, replaced_storage(), "full_state_dict(" + inner_->name() + ")");
  std::map<const void*, torch::Tensor> full;
  torch::NoGradGuard no_grad;
  // Gathered from the shards: their dtype (the master weights under mixed
  // precision), whether or not the units are unsharded now.
  for (auto* unit : units) {
    const auto& group = *unit->group_;
    auto values = group.gather_full();
    for (size_t i = 0; i < values.size(); ++i) {
      full[group.params()[i].unsafeGetTensorImpl()] = std::move(values[i]);
    }
  }
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto& p : named_parameters()) {
    out.insert(p.key(), full.at(p.value().unsafeGetTensorImpl()));
  }
  for (const auto& b : named_buffers()) out.insert(b.key(), b.value().clone());
  return out;
}

void FullyShardImpl::load_full_state_dict(
    const torch::OrderedDict<std::string, torch::Tensor>& state_dict) {
  const auto units = subtree_units();
  const std::string where = "load_full_state_dict on rank " + std::to_string(world_->rank());
  std::map<const void*, std::string> name_of;
  for (const auto& p : named_parameters())
    name_of.emplace(p.value().unsafeGetTensorImpl(), p.key());
  auto lookup = [&](const std::string& name, c10::IntArrayRef sizes) {
    const auto* t = state_dict.find(name);
    if (!t) {
      throw InvalidArgument(where + ": '" + name + "' is missing from the state dict");
    }
    if (t->sizes() != sizes) {
      throw InvalidArgument(where + ": '" + name + "' is " + c10::str(t->sizes()) +
                            " in the state dict, " + c10::str(sizes) + " in the model");
    }
    return *t;
  };
  // Every key is checked before anything is copied.
  std::vector<std::vector<torch::Tensor>> per_unit;
  for (auto* unit : units) {
    std::vector<torch::Tensor> full;
    const auto& group = *unit->group_;
    const auto& layout = group.layout();
    for (size_t i = 0; i < group.params().size(); ++i) {
      full.push_back(
          lookup(name_of.at(group.params()[i].unsafeGetTensorImpl()), layout.params[i].full_sizes));
    }
    per_unit.push_back(std::move(full));
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
  for (const auto& b : named_buffers())
    buffers.emplace_back(b.value(), lookup(b.key(), b.value().sizes()));
  // As PyTorch's load_state_dict (strict): a key the model lacks is a
  // misnamed tensor, whose model counterpart would otherwise keep its value.
  std::set<std::string> known;
  for (const auto& p : named_parameters()) known.insert(p.key());
  for (const auto& b : named_buffers()) known.insert(b.key());
  std::string unexpected;
  for (const auto& e : state_dict) {
    if (!known.count(e.key())) unexpected += (unexpected.empty() ? "'" : ", '") + e.key() + "'";
  }
  if (!unexpected.empty()) {
    throw InvalidArgument(where + ": unexpected keys, not the model's: " + unexpected);
  }
  // The loaded rows would go into shards the parameters no longer show.
  if (auto why = replaced_storage(); !why.empty()) throw InvalidArgument(where + ": " + why);
  for (auto* unit : units) unit->group_->reshard();
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < per_unit.size(); ++u) units[u]->group_->load_full(per_unit[u]);
  for (auto& [mine, theirs] : buffers) mine.copy_(theirs);
}

}  // namespace cohort
