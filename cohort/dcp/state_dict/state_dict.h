// defines: get_state_dict and set_state_dict (after PyTorch's
// torch.distributed.checkpoint.state_dict), StateDictOptions, TiedNames:
// one call for every mode, which it picks from what the model and
// optimizer are:
//
//   model                          optimizer           the state dict
//   a module, DDP(module)          a LibTorch one      every tensor replicated
//   a module, DDP(module)          ZeroRedundancy...   the optimizer's pieces
//   a module                       FusedDistributed... every tensor replicated,
//                                                      as with LibTorch's AdamW
//   fully_shard(...) (FSDP, HSDP)  a LibTorch one      each rank's dim-0 rows
//   a stage of TP layers or a      a LibTorch one      each rank's TP boxes of
//   pipeline stage (options.mesh)                      its stage's tensors (and
//                                                      its ep box of each expert)
//
// under the bare model's names ("model.<fqn>", "optim.<fqn>.<state>",
// "optim.<fqn>.step", "optim.param_groups.<fqn>.<option>"), so that a
// checkpoint saved in one mode at one world size loads into any mode at any
// world size where the model agrees:
//
//   dcp::save(dcp::get_state_dict(ddp, opt), dir, comm);
//   ...
//   auto sd = dcp::get_state_dict(sharded, opt);   // fresh objects
//   dcp::load(sd, dir, comm);                      // everything, steps and lr too
//   dcp::set_state_dict(sharded, opt, sd);
//
// The state dict views the model and optimizer (they must outlive it);
// dcp::load finds what to load from the checkpoint's metadata (state an
// optimizer that has not stepped lacks included) and installs it.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>

#include "cohort/dcp/dcp.h"
#include "cohort/dcp/weights_file.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"

namespace cohort {
class DeviceMesh;
}

namespace cohort::dcp {

/// A parameter's name in a stage -> the name of the parameter it copies
/// (a tied output embedding held by the last pipeline stage): the copy is
/// never written and loads from the original's tensors and state.
using TiedNames = std::map<std::string, std::string>;

/// What get_state_dict cannot see from the model's type.
struct StateDictOptions {
  /// A stage of tensor-parallel layers or a pipeline stage: the mesh it was
  /// built on (it must outlive the state dict). Its "ep" dimension splits
  /// the experts of every expert_parallel::MoE inside (boxes along dimension
  /// 0 of the global [E, ...] tensors); "dp" and "cp" hold replicas. Required for a module that
  /// holds tensor-parallel layers. With it get_state_dict and set_state_dict
  /// are collective over mesh.process_group(): an MoE whose groups are not
  /// the mesh's "ep" and "tp" (size, or this rank's position) is an
  /// InvalidArgument on every rank.
  const DeviceMesh* mesh = nullptr;
  /// With `mesh`: the stage's parameters that copy another.
  TiedNames tied;
};

namespace detail {

inline torch::nn::Module& module_of(torch::nn::Module& model) { return model; }
template <typename Impl>
torch::nn::Module& module_of(torch::nn::ModuleHolder<Impl>& model) {
  return *model;
}
template <typename T>
torch::nn::Module& module_of(std::shared_ptr<T>& model) {
  return *model;
}
template <typename ModuleHolder>
torch::nn::Module& module_of(DistributedDataParallel<ModuleHolder>& ddp) {
  return module_of(ddp.module());
}

/// The state dict of `model` with `optimizer` or `zero` (at most one).
StateDict state_dict_of(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                        ZeroRedundancyOptimizer* zero, const StateDictOptions& options);

/// The state dict of `model` (a plain module: InvalidArgument for a fully
/// sharded one, or with `options.mesh`) with the fused optimizer.
StateDict fused_state_dict_of(torch::nn::Module& model, FusedDistributedOptimizer& fused,
                              const StateDictOptions& options);

/// Copies `state` into what `mine` (a state dict get_state_dict made) views
/// (see set_state_dict).
void set_state_dict_of(const StateDict& mine, const StateDict& state);

}  // namespace detail

/// The model's state dict (parameters and buffers). `model`: a module, its
/// holder, DDP, or fully_shard's root.
template <typename Model>
StateDict get_state_dict(Model& model, const StateDictOptions& options = {}) {
  return detail::state_dict_of(detail::module_of(model), nullptr, nullptr, options);
}

/// The model's and optimizer's state dict: the optimizer's state, step
/// counts and the options of each parameter's group (lr, betas, ...).
template <typename Model>
StateDict get_state_dict(Model& model, torch::optim::Optimizer& optimizer,
                         const StateDictOptions& options = {}) {
  return detail::state_dict_of(detail::module_of(model), &optimizer, nullptr, options);
}

/// The same with ZeRO (built over model.parameters(), in any order and
/// groups: each parameter is paired with the optimizer's by identity).
template <typename Model>
StateDict get_state_dict(Model& model, ZeroRedundancyOptimizer& zero,
                         const StateDictOptions& options = {}) {
  return detail::state_dict_of(detail::module_of(model), nullptr, &zero, options);
}

/// The same with the fused optimizer (built over model.parameters(), in
/// that order; the model a plain module): the keys and layout a LibTorch
/// AdamW over the same module gives, so the checkpoint moves between the
/// fused optimizer and DDP, ZeRO or FSDP with AdamW, at any world size.
template <typename Model>
StateDict get_state_dict(Model& model, FusedDistributedOptimizer& fused,
                         const StateDictOptions& options = {}) {
  return detail::fused_state_dict_of(detail::module_of(model), fused, options);
}

/// Copies the values of `state` into the model (and optimizer): every tensor
/// the model and optimizer hold, and every one `state` holds for them that
/// the optimizer has no state for yet, with step counts and group options.
/// `state` must hold on this rank every box this rank's model needs (a state
/// dict dcp::load filled, or one of the same layout). Throws CheckpointError
/// naming the tensor, with nothing changed, when it does not.
template <typename Model>
void set_state_dict(Model& model, const StateDict& state, const StateDictOptions& options = {}) {
  detail::set_state_dict_of(
      detail::state_dict_of(detail::module_of(model), nullptr, nullptr, options), state);
}
/// The same into the model and its optimizer.
template <typename Model>
void set_state_dict(Model& model, torch::optim::Optimizer& optimizer, const StateDict& state,
                    const StateDictOptions& options = {}) {
  detail::set_state_dict_of(
      detail::state_dict_of(detail::module_of(model), &optimizer, nullptr, options), state);
}
/// The same into the model and ZeRO.
template <typename Model>
void set_state_dict(Model& model, ZeroRedundancyOptimizer& zero, const StateDict& state,
                    const StateDictOptions& options = {}) {
  detail::set_state_dict_of(
      detail::state_dict_of(detail::module_of(model), nullptr, &zero, options), state);
}
/// The same into the model and the fused optimizer (in place: the
/// parameters and state stay views into its flat buffers).
template <typename Model>
void set_state_dict(Model& model, FusedDistributedOptimizer& fused, const StateDict& state,
                    const StateDictOptions& options = {}) {
  detail::set_state_dict_of(detail::fused_state_dict_of(detail::module_of(model), fused, options),
                            state);
}

/// load_weights (weights_file.h) for a module whose parameters this process
/// holds whole (one process, or a model before DDP, ZeRO or fully_shard
/// wraps it), or a fully sharded root (its shards).
int load_weights(torch::nn::Module& module, const std::string& path,
                 const LoadWeightsOptions& options = {});

}  // namespace cohort::dcp
