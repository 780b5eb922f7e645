// defines: FSDPParamGroup, the parameters of one fully sharded unit and
// their two states (as FSDP2's FSDPParamGroup):
//
//   sharded    each parameter's data is this rank's rows of it, a view into
//              the unit's flat shard (ShardLayout); an optimizer built over
//              module.parameters() holds 1/N of the state;
//   unsharded  each parameter's data is its full value, a view into one
//              storage for the whole unit, filled by one all-gather.
//
// The switch never changes the identity of the parameter tensors (the
// module's and the optimizer's references, the gradient accumulators) or of
// the full storage. A unit's parameters must share dtype and device. How the
// switch, the gradients' reduce-scatter and mixed precision work:
// cohort/fsdp/README.md.
#pragma once

#include <c10/core/Storage.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

#include "cohort/comm/communicator.h"
#include "cohort/core/torch_compat.h"
#include "cohort/fsdp/mixed_precision.h"
#include "cohort/fsdp/shard_layout.h"
#include "cohort/grad_sync/leaf_tree.h"

namespace cohort::fsdp {

/// The parameters of one unit, sharded on dim 0 (see the file comment).
class FSDPParamGroup {
 public:
  /// Takes `params` (full, the same on every rank: rank 0's values are
  /// broadcast) and shards them. Collective over `comm`. `unit` names the
  /// unit in errors. Leaves the parameters sharded. `policy`: the dtypes
  /// of the all-gather, the compute and the reduce-scatter. `replicate`
  /// (HSDP; collective over it too): the group of the ranks holding the same
  /// shard, across which reduced gradients are averaged. `post_forward`
  /// (hpZ): this rank's group of N consecutive ranks of `comm` that a
  /// backward's all-gather runs in after reshard_after_forward(N).
  FSDPParamGroup(std::vector<torch::Tensor> params, std::vector<std::string> names,
                 std::shared_ptr<Communicator> comm, std::string unit,
                 const MixedPrecisionPolicy& policy = {},
                 std::shared_ptr<Communicator> replicate = nullptr,
                 std::shared_ptr<Communicator> post_forward = nullptr);
  FSDPParamGroup(const FSDPParamGroup&) = delete;
  FSDPParamGroup& operator=(const FSDPParamGroup&) = delete;

  /// The unit's name in errors.
  const std::string& unit() const { return unit_; }
  /// The parameters (the module's own tensors).
  const std::vector<torch::Tensor>& params() const { return params_; }
  /// Their names, relative to the unit's module.
  const std::vector<std::string>& names() const { return names_; }
  /// Where each parameter's rows live.
  const ShardLayout& layout() const { return layout_; }
  /// The shard's dtype (the parameters' own).
  torch::Dtype sharded_dtype() const { return sharded_dtype_; }
  /// The dtype of the all-gather and of the full parameters.
  torch::Dtype param_dtype() const { return param_dtype_; }
  /// The dtype of the reduce-scatter.
  torch::Dtype reduce_dtype() const { return reduce_dtype_; }

  /// Whether the parameters hold their full values.
  bool is_unsharded() const { return unsharded_; }
  /// Whether start_unshard() would launch an all-gather.
  bool will_gather() const { return !unsharded_ && !gathering_; }
  /// Makes the gradient accumulator of each parameter that requires grad
  /// and has none (frozen when the unit was made, unfrozen since), for the
  /// full parameter backward hands gradients of, whether the parameters are
  /// sharded or not now.
  void make_accumulators();
  /// Launches the all-gather of the full values (nothing if unsharded or
  /// already launched).
  void start_unshard();
  /// Finishes unsharding (launching it if needed): the parameters hold
  /// their full values.
  void wait_unshard();
  /// Frees the full values: the parameters hold their shards. Waits for an
  /// all-gather still in flight first.
  void reshard();
  /// After the unit's forward: `code` 0 keeps the full parameters, 1
  /// reshards, N >= 2 (a post_forward group of N ranks was given) keeps this
  /// rank's 1/N of them (the shards of W/N ranks of the shard group, whose
  /// all-gather over that group rebuilds the rank-major full buffer) and
  /// frees the full storage.
  void reshard_after_forward(int code);
  /// Drops what reshard_after_forward(N) kept: only the backward of the
  /// forward that kept it may gather from it; a new forward of the root or
  /// an unshard() gathers from the shard, which an optimizer may have
  /// changed since.
  void drop_post_forward_shard();
  /// Bytes of the full storage now allocated (0 while sharded).
  int64_t unsharded_bytes() const;
  /// Empty while every parameter's data is the view this group gave it (of
  /// the shard, or of the full storage while unsharded); else why not,
  /// naming the first parameter whose storage was replaced since
  /// (torch::load's set_, Module::to, set_data): the group's next switch
  /// would discard the values it holds now.
  std::string replaced_storage() const;
  /// Whether parameter i's data is the view this group gave it (see
  /// replaced_storage()).
  bool holds_storage(size_t i) const;
  /// Throws InvalidArgument (this rank only) when replaced_storage() is not
  /// empty. Every switch between views, gather_full and load_full call it.
  void check_storage() const;

  /// Before a backward: a sharded .grad is put aside (and added back when
  /// this backward's gradients are reduced); a full .grad accumulated by
  /// backwards without gradient sync stays to accumulate into, and what was
  /// put aside before them stays only while .grad is the tensor they left,
  /// unwritten since (zero_grad drops both, as one process's).
  void stash_gradients();
  /// Copies the full .grad of every parameter (none: zeros) into the
  /// reduce-scatter input, drops the full .grad and launches the
  /// reduce-scatter into a new gradient shard.
  Work start_reduce_scatter();
  /// The reduce-scatter was waited for: frees its input (the unit's full
  /// gradients) and adds its output into the sharded gradients put aside
  /// for this backward, freeing it too when every parameter had one, and
  /// else keeping only the rows of the others when a parameter is frozen
  /// (has no accumulator); so backward holds a unit's buffers only while
  /// they are on the wire, not until its end. Does nothing the second time.
  void reduce_scatter_done();
  /// Whether parameter i had a gradient when its reduce-scatter started.
  bool had_gradient(size_t i) const { return had_grad_[i] != 0; }
  /// After the reduce-scatter completed: .grad is this rank's rows of the
  /// averaged gradient plus what was stashed. `any[i]`: whether any rank
  /// had parameter i's gradient (none did: .grad stays what was stashed).
  void finish_gradients(const std::vector<char>& any);
  /// After a backward without gradient sync: the full .grad stays; a
  /// parameter that has none gets back its shard put aside, if any.
  void keep_full_gradients();
  /// After a backward that threw (its reduce-scatter, if any, waited for):
  /// every parameter's .grad is none, what was stashed and the
  /// reduce-scatter's buffers go.
  void drop_gradients();

  /// Determinism::WorldSizeInvariant, after one leaf's backward: lays the
  /// full .grad of every parameter (none: zeros) out as the reduce-scatter
  /// input would be, drops the full .grad and pushes that vector as the
  /// leaf's gradient into `leaf` (no communication). `first`: the step's
  /// first leaf (had_gradient() starts over).
  void push_leaf_gradient(LeafReduction& leaf, bool first);
  /// WorldSizeInvariant, after the step's last leaf (collective): .grad is
  /// this rank's rows of the canonical mean over every leaf
  /// (LeafReduction::finish_chunk(); its chunks are exactly the ranks'
  /// flat shards). It replaces what was stashed: the leaves are the step's
  /// accumulation. `any[i]`: whether any rank had parameter i's gradient.
  void finish_leaf_gradients(LeafReduction& leaf, const std::vector<char>& any);

  /// The full values in the shard's dtype, one tensor per parameter
  /// (collective; the parameters stay as they are).
  std::vector<torch::Tensor> gather_full() const;
  /// Copies this rank's rows of `full[i]` into parameter i's shard (the
  /// parameters must be sharded).
  void load_full(const std::vector<torch::Tensor>& full);

 private:
  void allocate_full();
  void free_full();
  void set_sharded();
  // Refuses a policy that casts non-floating dtypes.
  void check_policy() const;
  // Links each parameter back to its kept accumulator (see the file comment).
  void relink_accumulators();
  // Whether parameter i's .grad is the full gradient keep_full_gradients()
  // left, not written since.
  bool holds_kept_gradient(size_t i) const;
  // rs_output_ done: with a parameter no rank has a gradient for, keeps
  // only the rows of the others not stashed (`free`: frees the whole
  // output's bytes now); sets rs_offsets_.
  void keep_gradient_rows(bool free);

  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Communicator> replicate_;     // HSDP: same shard, other replicas
  std::shared_ptr<Communicator> post_forward_;  // hpZ: N consecutive ranks of comm_
  std::string unit_;
  ShardLayout layout_;
  bool unsharded_ = false;
  torch::Dtype sharded_dtype_, param_dtype_, reduce_dtype_;

  torch::Tensor shard_flat_;                // this rank's flat shard (padded)
  std::vector<torch::Tensor> shard_views_;  // per parameter: its local rows
  c10::Storage full_storage_;               // all full values; bytes freed while sharded
  std::vector<torch::Tensor> full_views_;   // per parameter: its full value
  torch::Tensor post_forward_shard_;        // hpZ: 1/N of the full buffer (param_dtype)
  torch::Tensor gather_input_;              // the shard cast to param_dtype while in flight
  torch::Tensor gathered_;                  // the all-gather's output while in flight
  Work gather_;                             // valid while an all-gather is in flight
  bool gathering_ = false;

  std::vector<torch::Tensor> stash_;  // sharded gradients put aside for a backward
  std::vector<char> grad_sharded_;    // .grad is a shard (not a full accumulation)
  // Per parameter: the full .grad a backward without sync left, and its
  // version then (stash_gradients).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> kept_grad_;
  std::vector<int64_t> kept_version_;
  std::vector<char> had_grad_;
  torch::Tensor rs_input_, rs_output_;  // rs_output_: the shard's dtype once done
  std::vector<int64_t> rs_offsets_;     // per parameter: its rows in rs_output_ (none: -1)
  bool rs_pending_ = false;             // launched, reduce_scatter_done() not run
  // Made while the parameters were full: a gradient accumulator records its
  // parameter's shape when made, and backward hands it full gradients. The
  // variables hold them weakly; these keep them (and so that shape) alive.
  std::vector<NodePtr> accumulators_;  // per parameter (or null)
};

}  // namespace cohort::fsdp
