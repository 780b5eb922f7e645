// defines: fully_shard and FullyShard, fully sharded data parallelism
// (ZeRO-3) for LibTorch modules, after PyTorch's FSDP2:
//
//   auto model = torch::nn::Sequential(Block(...), Block(...), Linear(...));
//   auto mesh = cohort::DeviceMesh::from_group(comm, "shard");  // or a Communicator
//   auto sharded = cohort::fully_shard(cohort::shard_blocks(model, mesh), mesh);
//   torch::optim::AdamW opt(sharded->parameters(), ...);  // holds 1/N of the state
//   auto loss = loss_fn(sharded->forward(x), y);  loss.backward();  opt.step();
//
// Each unit (a FullyShard) holds only this rank's rows of its parameters
// (dim 0, uneven sizes padded; param_group.h) and all-gathers the full
// values for its forward and again for its backward; its gradients are
// reduce-scattered (averaged) into the shard as soon as backward has them.
// The outermost FullyShard whose forward runs is the root: it owns the
// schedule (fsdp_state.h) of every FullyShard inside it, and the
// parameters of its own that no inner unit holds.
//
// C++ modules have no forward hooks, so a unit is a module wrapper (as
// checkpoint_wrapper): its forward unshards, calls the wrapped module's
// forward (whose code is unchanged) and reshards. The wrapper registers the
// wrapped module's children, parameters and buffers under their own names,
// so parameter and state-dict names are the bare model's.
//
// HSDP: on a 2-D mesh (replicate, shard), as FSDP2's, each unit is sharded
// within its shard group and replicated across the replicate group; the
// gradient shards are reduce-scattered within the shard group, then
// all-reduced (averaged) across the replicas (cohort/fsdp/README.md):
//
//   auto mesh = cohort::init_device_mesh(world, {2, 4}, {"replicate", "shard"});
//   auto sharded = cohort::fully_shard(cohort::shard_blocks(model, mesh), mesh);
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/fsdp/fsdp_state.h"
#include "cohort/fsdp/mixed_precision.h"
#include "cohort/fsdp/param_group.h"
#include "cohort/fsdp/reshard_after_forward.h"
#include "cohort/grad_sync/leaf_tree.h"
#include "cohort/mesh/device_mesh.h"

namespace cohort {
namespace fsdp {
struct UnitRecord;
}  // namespace fsdp

/// How a unit shards (FSDP2's fully_shard arguments).
struct FullyShardOptions {
  /// true: free the full parameters after the unit's forward and gather
  /// them again for its backward (ZeRO-3); false: keep them until the end
  /// of backward (one all-gather per step, more memory); an int N: keep
  /// 1/N of them and gather within groups of N ranks for backward (hpZ;
  /// reshard_after_forward.h). The root keeps its own parameters through
  /// the forward either way. A forward no backward follows (NoGradGuard)
  /// leaves every unit sharded, whatever this says (the optimizer steps
  /// the parameters, which must be the shards then); so does a training
  /// forward whose graph is freed without a backward, once it is freed.
  ReshardAfterForward reshard_after_forward = true;
  /// The dtypes of the all-gather, the compute and the reduce-scatter
  /// (mixed_precision.h; default: the parameters' own throughout).
  MixedPrecisionPolicy mp_policy;
  /// Determinism::WorldSizeInvariant (the root's setting; every unit inside
  /// it must have the same): the global batch is `leaves` leaves; each rank
  /// runs one forward and one backward per leaf, its local_leaves() leaves
  /// from first_leaf() on, in order, and the backward of its
  /// last leaf sets each sharded .grad to this rank's rows of the mean over
  /// all leaves, summed in grad_sync's canonical tree: the same bits as DDP
  /// with leaves computes for those elements, at every world size dividing
  /// `leaves` (1-D meshes only; conditions in cohort/fsdp/README.md).
  Determinism determinism = Determinism::Default;
  /// The leaf count L of the global batch (WorldSizeInvariant only; the
  /// same on every rank).
  int64_t leaves = 0;
};

/// A fully sharded unit around a module (one tensor in, one out); see the
/// file comment.
class FullyShardImpl : public torch::nn::Module {
 public:
  /// Shards the parameters of `module` that no FullyShard inside it holds
  /// over `mesh`: 1-D, sharded over it; 2-D (replicate, shard: by those
  /// names, else by position as FSDP2), sharded within the shard dimension
  /// and replicated across the other (HSDP). Collective over the whole mesh
  /// (every rank wraps the same module: a mismatch is an error on every
  /// rank; so is a mesh of another number of dimensions).
  FullyShardImpl(torch::nn::AnyModule module, const DeviceMesh& mesh,
                 FullyShardOptions options = {});
  /// Wraps a Sequential (whose templated forward an AnyModule cannot hold).
  FullyShardImpl(torch::nn::Sequential module, const DeviceMesh& mesh,
                 FullyShardOptions options = {});
  /// Sharded over `comm`: a 1-D mesh of it (DeviceMesh::from_group).
  FullyShardImpl(torch::nn::AnyModule module, std::shared_ptr<Communicator> comm,
                 FullyShardOptions options = {});
  /// Wraps a Sequential, sharded over `comm`.
  FullyShardImpl(torch::nn::Sequential module, std::shared_ptr<Communicator> comm,
                 FullyShardOptions options = {});
  ~FullyShardImpl() override;

  /// The wrapped module's forward between unshard and reshard (its
  /// floating input cast to the policy's param_dtype, its output to its
  /// output_dtype).
  torch::Tensor forward(const torch::Tensor& input);
  /// Also sets the wrapped module's own mode.
  void train(bool on = true) override;

  /// Gathers the full parameters of this unit and of every unit inside it
  /// (collective; on the root: every unit of the model); they stay until
  /// reshard() or the next backward's end. Gathers from the shards as they
  /// are now (after an optimizer step too).
  void unshard();
  /// Frees the full parameters of this unit and of every unit inside it.
  void reshard();
  /// false: backwards accumulate this unit's full gradients locally
  /// without communication until a backward with sync (FSDP2's
  /// set_requires_gradient_sync); `recurse`: and every unit's inside it (on
  /// the root: every unit of the model). On any unit, before the model's
  /// first forward or after; each backward takes up the settings as they
  /// are then, which must be the same on every rank (MismatchError at the
  /// next collective otherwise).
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  /// This unit's own flag (set_requires_gradient_sync; true at first).
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  /// What this unit frees after its forward, from the next forward on
  /// (true and false always; an int N only one that resolves as the one it
  /// was made with, whose group exists: InvalidArgument otherwise).
  void set_reshard_after_forward(ReshardAfterForward reshard);

  /// WorldSizeInvariant: this rank's first leaf of the global batch.
  int64_t first_leaf() const { return local_leaves() * comm_->rank(); }
  /// How many leaves this rank computes per step (leaves / world; 1 without
  /// the option).
  int64_t local_leaves() const;
  /// Collective, on the root (InvalidArgument on a unit inside another
  /// FullyShard), WorldSizeInvariant only (Unsupported
  /// otherwise), after the step's last backward: measures the global norm
  /// of the sharded gradients in an order fixed by each parameter's flat
  /// index alone (the same bits at every world size), scales every .grad
  /// by max_norm / (norm + 1e-6) when that is below 1, and returns the norm.
  double clip_grad_norm(double max_norm);

  /// The full parameters and buffers of this unit's module (on the root:
  /// the model) by their names (collective: the shards of this unit and of
  /// every unit inside it are gathered in turn). Loads into the bare module.
  torch::OrderedDict<std::string, torch::Tensor> full_state_dict();
  /// Loads a full state dict (the bare module's names and shapes) into this
  /// unit and every unit inside it: each rank keeps its rows. As PyTorch's
  /// load_state_dict(strict=True): every key must be present with its
  /// shape, and no other key may be (InvalidArgument naming them, before
  /// anything is loaded).
  void load_full_state_dict(const torch::OrderedDict<std::string, torch::Tensor>& state);

  /// This unit's own parameters (those no inner unit holds).
  const fsdp::FSDPParamGroup& param_group() const { return *group_; }
  /// Whether this unit has parameters of its own.
  bool has_param_group() const { return group_ != nullptr; }
  /// The communicator the unit is sharded over (the shard group).
  const std::shared_ptr<Communicator>& process_group() const { return comm_; }
  /// The shard group.
  [[deprecated("use process_group()")]] const std::shared_ptr<Communicator>& communicator() const {
    return comm_;
  }
  /// HSDP: the group of the ranks holding the same shards (null for FSDP).
  const std::shared_ptr<Communicator>& replicate_group() const { return replicate_; }
  /// The mesh the unit was made over.
  const DeviceMesh& mesh() const { return *mesh_; }
  /// The options the unit was made with.
  const FullyShardOptions& options() const { return options_; }

 private:
  void adopt(const std::shared_ptr<torch::nn::Module>& inner, const DeviceMesh& mesh);
  // The parameters this unit holds itself (an inner unit's are not; a tied
  // one once), described in `record` with the inner units' digests.
  struct OwnParameters {
    std::vector<torch::Tensor> params;
    std::vector<std::string> names;
  };
  static OwnParameters describe_unit(const torch::nn::Module& inner, fsdp::UnitRecord& record);
  // Records the group's parameters as held by this unit (`unit` describes it).
  void hold(const std::string& unit);
  // Builds the root's schedule over every unit inside it (first forward).
  std::shared_ptr<fsdp::FSDPState> root_state();
  // Whether this unit is inside another FullyShard (wrapped by one, or run
  // by a root's schedule): then it is no root, and root_state() must not be
  // built on it.
  bool enclosed() const { return enclosing_ != nullptr || !outer_.expired(); }
  // Refuses a root-only method (`method`) on an enclosed unit.
  void require_root(const std::string& method) const;
  // This unit (if it has parameters) and every unit inside it that has, in
  // pre-order, each once.
  std::vector<FullyShardImpl*> subtree_units();
  // The first of those units whose parameters' storage was replaced, or "".
  std::string replaced_storage();

  std::shared_ptr<torch::nn::Module> inner_;
  std::function<torch::Tensor(const torch::Tensor&)> call_;
  std::optional<DeviceMesh> mesh_;
  std::shared_ptr<Communicator> comm_;       // the shard group
  std::shared_ptr<Communicator> replicate_;  // HSDP's replicas (or null)
  std::shared_ptr<Communicator> world_;      // every rank of the mesh
  FullyShardOptions options_;
  int reshard_code_ = 1;                // options_.reshard_after_forward resolved (fsdp_state.h)
  int post_forward_size_ = 0;           // the hpZ group's size, if one was made
  bool requires_gradient_sync_ = true;  // read by the root's schedule
  std::unique_ptr<fsdp::FSDPParamGroup> group_;
  std::shared_ptr<fsdp::FSDPState> state_;     // as the root
  std::weak_ptr<fsdp::FSDPState> outer_;       // as a unit of another root
  const FullyShardImpl* enclosing_ = nullptr;  // the innermost unit wrapping this one
  size_t index_ = 0;                           // in outer_'s units
  uint64_t digest_ = 0;                        // what every rank agreed on at construction
  std::vector<const void*> holding_;           // its parameters' TensorImpls
};
TORCH_MODULE(FullyShard);

/// `module` as a fully sharded unit over `mesh` (FSDP2's fully_shard:
/// 1-D FSDP, 2-D HSDP; see FullyShardImpl).
FullyShard fully_shard(torch::nn::AnyModule module, const DeviceMesh& mesh,
                       FullyShardOptions options = {});
/// A Sequential as a fully sharded unit; wrap its blocks first
/// (shard_blocks) so that each is a unit of its own.
FullyShard fully_shard(torch::nn::Sequential module, const DeviceMesh& mesh,
                       FullyShardOptions options = {});
/// A Sequential of the same layers where each layer with parameters is a
/// FullyShard unit over `mesh` (names unchanged). Collective.
torch::nn::Sequential shard_blocks(const torch::nn::Sequential& model, const DeviceMesh& mesh,
                                   FullyShardOptions options = {});
/// fully_shard over a 1-D mesh of `comm`.
FullyShard fully_shard(torch::nn::AnyModule module, std::shared_ptr<Communicator> comm,
                       FullyShardOptions options = {});
/// fully_shard of a Sequential over a 1-D mesh of `comm`.
FullyShard fully_shard(torch::nn::Sequential module, std::shared_ptr<Communicator> comm,
                       FullyShardOptions options = {});
/// shard_blocks over a 1-D mesh of `comm`.
torch::nn::Sequential shard_blocks(const torch::nn::Sequential& model,
                                   std::shared_ptr<Communicator> comm,
                                   FullyShardOptions options = {});

}  // namespace cohort
