// defines: ParamSlot and add_optimizer_state, which express a LibTorch
// optimizer's per-parameter state as boxes of logical tensors
// "optim.<param fqn>.<state name>" (and "optim.<param fqn>.step", 0-d),
// and the options of each parameter's group (lr, betas, weight decay, ...)
// as 0-d float64 tensors "optim.param_groups.<param fqn>.<option>"
// (param_group_options.h).
//
// A slot is one tensor the optimizer steps (a parameter, an FSDP shard, a
// ZeRO piece) and the boxes of the parameter it holds: box k is elements
// [flat_offsets[k], + its numel) of the slot, flattened. Its state tensors
// have the slot's shape, so each state tensor is cut the same way.
#pragma once

#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

#include "cohort/dcp/dcp.h"

namespace cohort::dcp::detail {

struct ParamSlot {
  std::string fqn;             ///< the parameter's name
  std::vector<int64_t> shape;  ///< the parameter's global shape
  torch::Tensor key;           ///< the tensor the optimizer holds
  std::vector<Box> boxes;
  std::vector<int64_t> flat_offsets;
  bool replicated = false;  ///< every rank holds the same state (DDP)
  bool owns_step = false;   ///< this slot saves the parameter's step count
  bool write = true;        ///< false: another rank writes the same state (TP)
};

/// A parameter whose group's options a state dict holds
/// ("optim.param_groups.<fqn>.<option>"), and that group.
struct GroupMember {
  std::string fqn;
  torch::optim::OptimizerParamGroup* group = nullptr;
  bool replicated = false;  ///< every rank holds the same options: saved once
  bool write = true;        ///< this rank writes them (not replicated)
};

/// Adds the optimizer state of `slots` to `state`: the state that exists,
/// its step counts and the options of its groups, which state.after_load
/// sets from the loaded values and state.refresh reads again before a save.
/// The groups' options are those of `members`, or, without, of each slot's
/// parameter, written with its step. A load whose parameters of one group
/// carry different values of an option is refused (check_before_load:
/// ConfigError). With `for_load` (a checkpoint's metadata): also, for every
/// slot whose parameter has state in that checkpoint but not in the
/// optimizer, new tensors that after_load installs; and only the group
/// options the checkpoint holds.
void add_optimizer_state(StateDict& state, torch::optim::Optimizer& optimizer,
                         const std::vector<ParamSlot>& slots, const Metadata* for_load,
                         const std::vector<GroupMember>* members = nullptr);

}  // namespace cohort::dcp::detail
