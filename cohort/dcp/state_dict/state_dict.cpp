#include "cohort/dcp/state_dict/state_dict.h"

#include <torch/utils.h>

#include <algorithm>
#include <map>

#include "cohort/core/error.h"
#include "cohort/core/rank_local.h"
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/state_dict/detail/adapters.h"
#include "cohort/dcp/state_dict/detail/tp_adapters.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/tensor_parallel/layers.h"

namespace cohort::dcp::detail {
namespace {

// What `state` says of each tensor, as a checkpoint's metadata says it
// (no chunks): the adapters' targets for loading it.
Metadata metadata_of(const StateDict& state) {
  Metadata meta;
  for (const auto& e : state.tensors) meta.tensors.push_back({e.fqn, e.shape, e.dtype, {}});
  std::sort(meta.tensors.begin(), meta.tensors.end(),
            [](const TensorMeta& a, const TensorMeta& b) { return a.fqn < b.fqn; });
  meta.modules = state.modules;
  return meta;
}

// The part of `t` (the box `at`) that lies in `box`.
torch::Tensor narrowed(torch::Tensor t, const Box& at, const Box& box) {
  for (size_t d = 0; d < box.offsets.size(); ++d) {
    t = t.narrow(static_cast<int64_t>(d), box.offsets[d] - at.offsets[d], box.lengths[d]);
  }
  return t;
}

using ByName = std::map<std::string, const TensorEntry*>;

// Throws CheckpointError naming the tensor unless `from` holds every box of
// `to` with its shape and dtype (a rank's shards of a tensor never overlap).
void check_covers(const ByName& from, const StateDict& to) {
  for (const auto& e : to.tensors) {
    const std::string where = "dcp::set_state_dict: tensor " + e.fqn;
    auto it = from.find(e.fqn);
    if (it == from.end()) throw CheckpointError(where + " is not in the state dict");
    const auto& src = *it->second;
    if (src.shape != e.shape || src.dtype != e.dtype) {
      throw CheckpointError(where + ": the state dict's " + shape_string(src.shape) + " " +
                            dtype_name(src.dtype) + " differs from the model's " +
                            shape_string(e.shape) + " " + dtype_name(e.dtype));
    }
    for (const auto& s : e.shards) {
      int64_t held = 0;
      for (const auto& h : src.shards) held += intersect(h.box, s.box).numel();
      if (held != s.box.numel()) {
        throw CheckpointError(where + ": this rank's state dict does not hold all of " +
                              to_string(s.box));
      }
    }
  }
}

// The replicated layouts (DDP's, ZeRO's, the fused optimizer's) write each
// tensor once and load it into every rank: one rank's experts would be
// saved as everyone's.
void refuse_rank_local(const torch::nn::Module& model) {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (const auto& p : model.named_parameters()) {
    params.push_back(p.value());
    names.push_back(p.key());
  }
  const auto refusal = rank_local_refusal(params, names);
  if (refusal.empty()) return;
  throw InvalidArgument("dcp::get_state_dict: " + refusal +
                        ": pass StateDictOptions::mesh, the mesh the model was built on");
}

}  // namespace

StateDict state_dict_of(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                        ZeroRedundancyOptimizer* zero, const StateDictOptions& options) {
  if (zero) {
    refuse_rank_local(model);
    return zero_state_dict(model, *zero);
  }
  if (auto* sharded = dynamic_cast<FullyShardImpl*>(&model)) {
    // Its boxes are the shard group's rows of each tensor as this rank
    // holds it: a TP rank's slices would be saved as the whole tensors.
    if (!tensor_parallel::split_dims(model).empty()) {
      throw InvalidArgument(
          "dcp::get_state_dict: the fully sharded model holds tensor-parallel layers, whose "
          "slices an FSDP state dict would save as the whole tensors; save "
          "full_state_dict() per TP rank, or train with TrainerWiring::mesh");
    }
    return fsdp_state_dict(*sharded, optimizer);
  }
  if (options.mesh) {
    // Agreed once, here, where the caller asks: not in the rebuild of a
    // kept state dict at every save (the verdict holds as long as the model).
    agree_moe_groups(model, *options.mesh);
    return tensor_parallel_state_dict(model, *options.mesh, optimizer, options.tied);
  }
  if (!tensor_parallel::split_dims(model).empty()) {
    throw InvalidArgument(
        "dcp::get_state_dict: the model holds tensor-parallel layers: pass "
        "StateDictOptions::mesh, the mesh they were built on");
  }
  refuse_rank_local(model);
  return ddp_state_dict(model, optimizer);
}

StateDict fused_state_dict_of(torch::nn::Module& model, FusedDistributedOptimizer& fused,
                              const StateDictOptions& options) {
  // The fused optimizer steps whole replicated parameters: a sharded or
  // split model is not what it was built over.
  if (dynamic_cast<FullyShardImpl*>(&model) || options.mesh ||
      !tensor_parallel::split_dims(model).empty()) {
    throw InvalidArgument(
        "dcp::get_state_dict: the fused optimizer's model must be a plain module (no FSDP, "
        "tensor-parallel layers or mesh)");
  }
  refuse_rank_local(model);
  return fused_state_dict(model, fused);
}

void set_state_dict_of(const StateDict& mine, const StateDict& source) {
  // A source kept across training: what its optimizer holds now.
  StateDict rebuilt;
  const std::string op = "dcp::set_state_dict (of its source)";  // named, as above
  const auto& state = current(source, rebuilt, op, -1);
  for (const auto& f : mine.check_model) f("dcp::set_state_dict");
  for (const auto& f : state.check_model) f(op);
  // The source's step counts and options as its optimizer holds them now.
  for (const auto& f : state.refresh) f();
  auto targets = mine.load_targets(metadata_of(state));
  check_shards(state, "dcp::set_state_dict (its state dict)", -1);
  check_shards(targets, "dcp::set_state_dict (the model's)", -1);
  ByName from;
  for (const auto& e : state.tensors) from[e.fqn] = &e;
  check_covers(from, targets);
  // What target shard `s` of `e` takes from the source.
  auto copy_into = [&](const TensorEntry& e, const LocalShard& s, const torch::Tensor& out) {
    for (const auto& h : from.at(e.fqn)->shards) {
      const Box in = intersect(h.box, s.box);
      if (in.numel() > 0) narrowed(out, s.box, in).copy_(narrowed(h.data, h.box, in));
    }
  };
  torch::NoGradGuard no_grad;
  if (!targets.check_before_load.empty()) {
    std::map<const void*, std::pair<const TensorEntry*, const LocalShard*>> shard_of;
    for (const auto& e : targets.tensors) {
      for (const auto& s : e.shards) shard_of[s.data.unsafeGetTensorImpl()] = {&e, &s};
    }
    auto value = [&](const torch::Tensor& data) {
      auto it = shard_of.find(data.unsafeGetTensorImpl());
      COHORT_CHECK(it != shard_of.end(), "dcp::set_state_dict: a check asked for no shard");
      auto out = torch::empty_like(data);
      copy_into(*it->second.first, *it->second.second, out);
      return out;
    };
    for (const auto& check : targets.check_before_load) check(value);
  }
  for (auto& e : targets.tensors) {
    for (auto& s : e.shards) copy_into(e, s, s.data);
  }
  for (auto& f : targets.after_load) f();
}

}  // namespace cohort::dcp::detail

namespace cohort::dcp {

int load_weights(torch::nn::Module& module, const std::string& path,
                 const LoadWeightsOptions& options) {
  auto state = get_state_dict(module);  // an FSDP root's: its shards
  return load_weights(state, path, options);
}

}  // namespace cohort::dcp
