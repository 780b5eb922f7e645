// defines: ddp_state_dict, zero_state_dict, fsdp_state_dict (internal:
// get_state_dict, state_dict.h, picks one by the model's type): each mode's
// model and optimizer state as a dcp::StateDict (dcp.h), under the bare
// model's names: "model.<fqn>" for parameters and buffers,
// "optim.<param fqn>.<state>" for optimizer state ("exp_avg", ...,
// "step"). So a checkpoint saved in one mode at one world size loads into
// any mode at any world size:
//
//   DDP       parameters, buffers and optimizer state replicated;
//   ZeRO-1/2  parameters and buffers replicated; each rank's pieces of the
//             flat partition as boxes of the parameters (a flat range of a
//             parameter is at most 2 * dims - 1 boxes);
//   FSDP      each rank's dim-0 rows of every parameter and of its state
//             (the padding left out); buffers replicated;
//   fused     as DDP with LibTorch's AdamW: each parameter's slice of the
//             flat AdamW buffers under the names AdamW gives its state.
//
// for_load = nullptr: what the model and optimizer hold, with load_targets
// set. for_load = a checkpoint's metadata: the targets for loading it, so
// that an optimizer that has not stepped yet gets the state the checkpoint
// holds (installed only once the load succeeded). Either form can rebuild
// itself as the first (StateDict::rebuild) once it is stale.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>

#include "cohort/dcp/dcp.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"

namespace cohort::dcp::detail {

/// A module whose parameters every rank holds whole (DDP's module, or one
/// process), and its optimizer (may be null).
StateDict ddp_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         const Metadata* for_load = nullptr);

/// A module whose parameters `zero` was built over, in any order and
/// groups (paired by identity; InvalidArgument naming a parameter that
/// cannot be paired).
StateDict zero_state_dict(torch::nn::Module& model, ZeroRedundancyOptimizer& zero,
                          const Metadata* for_load = nullptr);

/// A fully sharded model (its root unit; sharded: between steps) and the
/// optimizer over its parameters (may be null).
StateDict fsdp_state_dict(FullyShardImpl& model, torch::optim::Optimizer* optimizer,
                          const Metadata* for_load = nullptr);

/// A module whose parameters `fused` was built over, in
/// model.parameters() order: the keys and layout of ddp_state_dict with
/// LibTorch's AdamW (state only for parameters that stepped), so that a
/// checkpoint moves between the fused optimizer and the other modes.
StateDict fused_state_dict(torch::nn::Module& model, FusedDistributedOptimizer& fused,
                           const Metadata* for_load = nullptr);

/// Sets what `state`, which `build(for_load)` made, is rebuilt with: its
/// load_targets (build with a checkpoint's metadata; the saving form only)
/// and its rebuild (build(nullptr)), which refuses a state dict whose
/// entries were changed since (InvalidArgument: the new one would lack the
/// change). Call it last: the entries are taken as they are then.
void set_rebuilds(StateDict& state, const Metadata* for_load,
                  std::function<StateDict(const Metadata*)> build);

}  // namespace cohort::dcp::detail
