// defines: FusedOptions, FusedDistributedOptimizer: data-parallel AdamW that
// reduces the gradients itself, bucket by bucket, and overlaps each bucket's
// all-reduce with the update of the bucket before it:
//
//   launch all-reduce(bucket 0)
//   launch all-reduce(bucket 1); wait(bucket 0); average + AdamW(bucket 0)
//   launch all-reduce(bucket 2); wait(bucket 1); average + AdamW(bucket 1)
//   ...                          wait(last);     average + AdamW(last)
//
// Use it on a plain module (no DDP): backward fills .grad, step() does the
// rest. The parameters become views into one flat buffer per bucket, their
// .grad views into a flat gradient buffer (autograd accumulates into it in
// place: no copy before the all-reduce, no new .grad each backward), and
// the AdamW state is flat too, so an update is a handful of kernels per
// bucket (fused_adamw.h) instead of a handful per parameter. Numbers equal
// DDP + torch::optim::AdamW with the same options (to rounding).
//
// zero_grad() follows the linked LibTorch's Optimizer::zero_grad()
// (kZeroGradSetsToNone); zero_grad(set_to_none) chooses. A parameter that
// got no gradient on any rank since zero_grad(true) (seen by a hook on each
// parameter) is skipped, as LibTorch's AdamW skips a .grad set to none (no
// decay, no state update); its .grad stays a zero view. One that had a
// gradient since then steps with zeros, as LibTorch's AdamW steps a .grad
// zeroed in place (zero_grad(false)). One with a gradient on some ranks
// only counts as zero on the others, as in DDP. A .grad the caller replaced
// (or autograd re-created after it was set to none) is copied into the
// bucket; one the caller set to none counts as none. At world size 1 there
// is no communication. A tensor listed more than once (a tied weight) is one
// parameter, held and stepped at its first place; each of its indices
// answers that place's state.
#pragma once

#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <memory>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/torch_compat.h"
#include "cohort/grad_sync/accumulator_hooks.h"
#include "cohort/grad_sync/bucket_queue.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/observability/sync_statistics.h"

namespace cohort {

/// One parameter's AdamW state in FusedDistributedOptimizer, under LibTorch's AdamW names.
struct FusedParamState {
  /// A view into the flat buffer, shaped as the parameter: writing it writes the state.
  torch::Tensor exp_avg;
  /// The same for the second moment.
  torch::Tensor exp_avg_sq;
  /// The same for amsgrad's maximum; undefined unless amsgrad is on or
  /// allocate_amsgrad_state() ran.
  torch::Tensor max_exp_avg_sq;
  /// Steps this parameter took: 0 when it has not stepped (LibTorch's AdamW then holds no
  /// state for it).
  int64_t step = 0;
};

/// How FusedDistributedOptimizer groups parameters into buckets.
struct FusedOptions {
  /// Largest bucket in MiB (a larger parameter gets a bucket of its own).
  double bucket_cap_mb = 25;
};

/// Data-parallel AdamW over flat buckets that averages the gradients itself, overlapping each
/// bucket's all-reduce with the previous bucket's update (see the file comment). Use on a module
/// without DDP.
class FusedDistributedOptimizer {
 public:
  /// Collective: every rank passes the same shapes in the same order, with
  /// equal values (broadcast them first, e.g. by building DDP once, or seed;
  /// both checked, the values by a digest: MismatchError on every rank).
  /// What it steps, the group it averages over, AdamW's options, its own (the order of
  /// ZeroRedundancyOptimizer::make).
  FusedDistributedOptimizer(std::vector<torch::Tensor> params, std::shared_ptr<Communicator> comm,
                            torch::optim::AdamWOptions options, FusedOptions fused = {});
  /// Over a 1-D mesh (mesh["dp"]): its group; InvalidArgument naming the mesh otherwise.
  FusedDistributedOptimizer(std::vector<torch::Tensor> params, const DeviceMesh& mesh,
                            torch::optim::AdamWOptions options, FusedOptions fused = {})
      : FusedDistributedOptimizer(std::move(params),
                                  one_dimension_group(mesh, "FusedDistributedOptimizer", "dp"),
                                  options, fused) {}
  /// The earlier order, kept for programs written against it.
  // clang-format off
  [[deprecated("use FusedDistributedOptimizer(params, comm, options, fused)")]]
  FusedDistributedOptimizer(std::vector<torch::Tensor> params, torch::optim::AdamWOptions options,
                            std::shared_ptr<Communicator> comm, FusedOptions fused = {})
      : FusedDistributedOptimizer(std::move(params), std::move(comm), options, fused) {}
  // clang-format on
  /// Removes the gradient hooks from the parameters.
  ~FusedDistributedOptimizer();
  /// The hooks hold this object's address.
  FusedDistributedOptimizer(const FusedDistributedOptimizer&) = delete;
  FusedDistributedOptimizer& operator=(const FusedDistributedOptimizer&) = delete;

  /// Collective: average the gradients over the ranks and apply AdamW.
  /// InvalidArgument on every rank, before anything is reduced, when a
  /// rank's parameter no longer lives in its bucket (torch::load, Module::to,
  /// set_data or set_ replaced its storage after construction): the update
  /// would go to the bucket, which the model no longer reads. Load values in
  /// place (copy_, dcp::set_state_dict).
  void step();
  /// Collective: averages the gradients now (all buckets, then waits), so
  /// that the .grad hold the averages before step(), e.g. to clip them by
  /// their global norm; step() then only updates. This gives up the overlap
  /// of each bucket's all-reduce with the previous bucket's update.
  void finish_gradients();
  /// Clears the gradients as the linked LibTorch's Optimizer::zero_grad()
  /// does by default (kZeroGradSetsToNone: in place in 1.13, to none in 2.x).
  void zero_grad() { zero_grad(kZeroGradSetsToNone); }
  /// Zeros the gradient buckets (the .grad views with them; they stay
  /// defined). set_to_none: every parameter counts as without gradient
  /// until a backward gives it one, as a .grad set to none. false: one
  /// that had a gradient on some rank since the last zero_grad(true) steps
  /// with zeros where it gets none, as LibTorch's AdamW steps a zeroed .grad.
  void zero_grad(bool set_to_none);
  /// Sets the learning rate used from the next step() on (every rank sets the same).
  void set_lr(double lr) { options_.lr(lr); }
  /// The AdamW options (lr, betas, eps, weight_decay, amsgrad); changes apply from the next step().
  torch::optim::AdamWOptions& options() { return options_; }
  /// Steps taken so far.
  int64_t timestep() const { return timestep_; }
  /// The number of buckets (each with one all-reduce per step).
  size_t bucket_count() const { return buckets_.size(); }
  /// Parameter indices of each bucket (a tensor listed more than once: its first index only).
  std::vector<std::vector<size_t>> bucket_layout() const;
  /// Bytes of AdamW state (exp_avg, exp_avg_sq, max_exp_avg_sq) held between steps.
  int64_t state_bytes() const;
  /// The gradient all-reduces measured so far (in step() they overlap the
  /// update of the previous bucket).
  const SyncStatistics& sync_statistics() const { return sync_.statistics(); }
  /// The communicator the gradients are all-reduced over.
  const std::shared_ptr<Communicator>& process_group() const { return comm_; }
  /// The same communicator.
  [[deprecated("use process_group()")]] const std::shared_ptr<Communicator>& shared_communicator()
      const {
    return comm_;
  }
  /// Bytes of the flat gradient buffers (the .grad views live in them).
  int64_t grad_bytes() const;
  /// The flat gradient buffer of each bucket, in bucket order (shares memory with the .grad views).
  std::vector<torch::Tensor> grad_buffers() const;

  /// The parameters, in the order the constructor got them.
  const std::vector<torch::Tensor>& params() const { return params_; }
  /// Parameter i's state (dcp's state dict reads and loads it there:
  /// cohort/dcp/state_dict/state_dict.h); of a tensor listed more than once, the same state at
  /// each of its indices.
  FusedParamState param_state(size_t i) const;
  /// Sets parameter i's step count, as a checkpoint that was copied into param_state(i) holds
  /// it; timestep() becomes the largest step count.
  void set_param_step(size_t i, int64_t step);
  /// Allocates the max_exp_avg_sq buffers (zeros) unless they exist, so that state saved with
  /// amsgrad has somewhere to load; step() allocates them when amsgrad was turned on later.
  void allocate_amsgrad_state();

  /// Replicated state (every rank holds all of it): rank 0's save suffices.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores state written by save() for the same parameters; throws MismatchError when the
  /// archive holds a different parameter count or bucket sizes. Every rank loads the same archive.
  void load(torch::serialize::InputArchive& archive);

 private:
  // What a bucket holds; its all-reduce's launch and wait are queue_'s.
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;  // of each parameter in the flat buffers
    torch::Tensor param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq;
  };
  void fill(Bucket& b);
  void apply(Bucket& b, const std::vector<char>& has);
  std::vector<char> globally_has_grad(const std::string& op);
  // The first parameter that no longer lives in its bucket, described; "" if none.
  std::string replaced_storage() const;
  std::string where(const std::string& op) const;
  // Launches bucket b's all-reduce of its gradients with `op`.
  Work all_reduce(size_t b, ReduceOp op);
  // Waits for the oldest all-reduce in flight (time counted as exposed).
  size_t wait_oldest();
  void bump_versions();

  std::shared_ptr<Communicator> comm_;
  torch::optim::AdamWOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<int64_t> steps_;             // per first place (skipped ones lag behind); others 0
  std::vector<torch::Tensor> grad_views_;  // per parameter, into its bucket
  std::vector<char> seen_;                 // got a gradient since zero_grad(true)
  // Per parameter: the index of its tensor's first place in params_, the
  // one in a bucket (a later place of a tied tensor shares its views).
  std::vector<size_t> first_place_;
  std::unique_ptr<AccumulatorHooks> hooks_;  // set seen_
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> place_;  // per parameter: its bucket, its index there
  BucketQueue queue_;                             // buckets_ in order; none waits for parts
  int64_t timestep_ = 0;
  /// finish_gradients() ran: the buckets hold averages; has_ its mask.
  bool averaged_ = false;
  SyncRecorder sync_;
  std::vector<char> has_;
};

}  // namespace cohort
