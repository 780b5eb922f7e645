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

namespace cohort {

torch::OrderedDict<std::string, torch::Tensor> FullyShardImpl::full_state_dict() {
  auto state = root_state();
  std::map<const void*, torch::Tensor> full;
  torch::NoGradGuard no_grad;
  // Gathered from the shards: their dtype (the master weights under mixed
  // precision), whether or not the units are unsharded now.
  for (const auto& unit : state->units()) {
    auto values = unit.group->gather_full();
    for (size_t i = 0; i < values.size(); ++i) {
      full[unit.group->params()[i].unsafeGetTensorImpl()] = std::move(values[i]);
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
  auto state = root_state();
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
  for (const auto& unit : state->units()) {
    std::vector<torch::Tensor> full;
    const auto& layout = unit.group->layout();
    for (size_t i = 0; i < unit.group->params().size(); ++i) {
      full.push_back(lookup(name_of.at(unit.group->params()[i].unsafeGetTensorImpl()),
                            layout.params[i].full_sizes));
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
  state->reshard_all();
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < per_unit.size(); ++u) state->units()[u].group->load_full(per_unit[u]);
  for (auto& [mine, theirs] : buffers) mine.copy_(theirs);
}

}  // namespace cohort
