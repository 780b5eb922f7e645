// defines: GradientReducer, the non-template core of DistributedDataParallel:
// it owns the gradient buckets of one torch::nn::Module, the hooks on its
// parameters' gradient accumulators, and the per-iteration state machine.
//
// One iteration, as in PyTorch's reducer:
//   prepare_forward()  checks the previous iteration finished, rebuilds the
//                      buckets once (after the first iteration) and
//                      re-broadcasts buffers if the previous forward was a
//                      synchronizing training forward (PyTorch's rule);
//   after_forward()    records whether this forward synchronizes, and finds
//                      unused parameters from the outputs' graph;
//   backward           each accumulator's post hook copies the accumulated
//                      .grad into its bucket; a full bucket is handed to the
//                      comm hook at once, buckets strictly in index order;
//   final callback     waits for every bucket and writes the averages back.
// Buckets are flat buffers of one dtype holding parameters in reverse
// registration order (the order gradients usually become ready), later in
// the order rank 0 observed; every rank launches them in the same order, so
// the collectives match without negotiation. Launching, polling, waiting,
// timing and tracing are grad_sync's BucketQueue, shared with ZeRO-2 and
// the fused optimizer; what a bucket holds and the comm hook are DDP's.
// It lives in grad_sync, not ddp, so that ZeRO-2 (which takes its reduction
// over) and the mesh's GradientSynchronizer (which runs one over its dense
// group) reach it without including cohort/ddp.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/grad_sync/accumulator_hooks.h"
#include "cohort/grad_sync/bucket_queue.h"
#include "cohort/grad_sync/comm_hook.h"
#include "cohort/grad_sync/ddp_options.h"
#include "cohort/grad_sync/ddp_stats.h"
#include "cohort/grad_sync/leaf_tree.h"
#include "cohort/grad_sync/reduction_owner.h"

namespace cohort {

class LeafBuckets;
class SerialWorker;

/// The non-template engine of DistributedDataParallel: buckets the parameters' gradients and
/// reduces each bucket (through the comm hook) as soon as backward has filled it, in the same order
/// on every rank. Built by DistributedDataParallel; reach it through
/// DistributedDataParallel::reducer().
class GradientReducer {
 public:
  /// Collective: checks that every rank holds the same parameter shapes and
  /// dtypes in the same order, those with and those without requires_grad
  /// (MismatchError naming the first difference), then broadcasts every
  /// parameter (frozen ones too) and buffer from rank 0. It reduces the
  /// parameters that require grad; when that set changes (a parameter
  /// unfrozen or frozen since), the next forward with grad mode on takes the
  /// new set up (gradient_reducer_parameter_set.cpp).
  GradientReducer(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<Communicator> comm,
                  DDPOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// Before each forward. Throws Error naming the parameters that got no
  /// gradient if the previous backward could not finish its reduction. With
  /// grad mode on, outside a backward, it follows requires_grad: when the
  /// parameters that require grad are not those reduced, the ranks agree on
  /// the change (InvalidArgument on every rank when they changed different
  /// parameters; a MismatchError on every rank when some did not change
  /// any) and the buckets are rebuilt for the new set.
  void prepare_forward();
  /// Instead of after_forward() when the module's forward threw: with
  /// leaves, a training forward's step is abandoned (its leaves dropped,
  /// the buffers as the step found them), as the user skips it.
  void forward_failed() noexcept;
  /// After each forward that returned (always, even without
  /// find_unused_parameters), with the tensors the forward returned.
  void after_forward(const std::vector<torch::Tensor>& outputs);

  /// All-reduces every parameter's current .grad now and waits (collective).
  /// For SyncStrategy::NoSync, or to finish a no_sync() accumulation without
  /// another backward (a pipeline's gradients, which come without the
  /// hooks). Follows requires_grad first, as prepare_forward(). Which
  /// parameters have a gradient is agreed then (one small all-reduce): one
  /// without a .grad on some ranks takes part as zeros there and gets the
  /// average; one without on every rank keeps an undefined .grad (as in one
  /// process, so that the optimizer skips it), whatever
  /// find_unused_parameters says. That all-reduce comes before the buckets
  /// and carries `failed` (any_rank_has_unless_failed): the exception that
  /// ended this rank's share of the step, null where it ran. When some rank
  /// failed, no bucket is sent (a hook's state stays as it was), and every
  /// rank drops its gradients and throws.
  void synchronize(const std::exception_ptr& failed = nullptr);

  /// While the depth is positive, backward accumulates locally (no_sync()).
  void push_no_sync() { ++no_sync_depth_; }
  /// Leaves one no_sync() scope; the backward after the last one reduces the accumulated gradients.
  void pop_no_sync() { --no_sync_depth_; }

  /// Reduces the buckets with `hook` from the next backward on (null throws InvalidArgument). Every
  /// rank must register an equivalent hook.
  void register_comm_hook(std::shared_ptr<CommHook> hook);

  /// Hands the reduction of every synchronizing backward to `owner` (see
  /// reduction_owner.h; ZeroRedundancyOptimizer at stage 2 calls it): the
  /// bucket buffers are freed and the comm hook is no longer used. nullptr
  /// gives the reduction back to DDP (the buckets are allocated again). Not
  /// during a backward pass, nor after one DDP reduced itself that threw
  /// until the next forward ends it (InvalidArgument); an owner replaced
  /// after a backward that threw drops its part first
  /// (ReductionOwner::backward_failed). The owner must outlive its
  /// registration.
  void set_reduction_owner(ReductionOwner* owner);
  /// The owner set by set_reduction_owner(), or nullptr while DDP reduces.
  ReductionOwner* reduction_owner() const { return owner_; }
  /// What DDP measured about its reductions so far.
  const DDPStats& stats() const { return stats_; }
  /// The options it was built with.
  const DDPOptions& options() const { return options_; }
  /// The communicator the gradients are reduced over.
  const std::shared_ptr<Communicator>& process_group() const { return comm_; }
  /// The same communicator, by reference.
  [[deprecated("use *process_group()")]] Communicator& communicator() { return *comm_; }
  /// The same communicator, shared.
  [[deprecated("use process_group()")]] const std::shared_ptr<Communicator>& shared_communicator()
      const {
    return comm_;
  }

  /// The parameters that are reduced, in registration order, each tensor
  /// once (a tied one under its first name): those that required grad at
  /// the last forward with grad mode on (at construction before it); with
  /// Determinism::WorldSizeInvariant also those that did at an earlier one
  /// (a leaf gives a parameter without gradient zeros, and the step leaves
  /// it without .grad).
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  /// The qualified names of parameters(), in the same order.
  const std::vector<std::string>& parameter_names() const { return names_; }
  /// Parameter indices of each bucket, in launch order (for tests and tools).
  std::vector<std::vector<size_t>> bucket_layout() const;
  /// The bucket layout and how far its one rebuild has come (this rank's
  /// recorded gradient order while the rebuild is pending), as named int64
  /// tensors whose names start with "ddp_layout": what a resumed run needs
  /// to reduce in the same buckets, at the same steps, as the run that
  /// saved it (a comm hook's state is keyed by bucket index).
  std::map<std::string, torch::Tensor> layout_state() const;
  /// Throws ConfigError, naming this rank and the reason, when `state`
  /// (layout_state() of an earlier run) does not fit these parameters.
  void check_layout_state(const std::map<std::string, torch::Tensor>& state) const;
  /// Adopts `state` at once: the buckets become the saved ones, and the
  /// rebuild is done, pending on the saved order, or still to record, as it
  /// was. The comm hook is told of every bucket that changed. Call it on
  /// every rank with that rank's state, between iterations; throws as
  /// check_layout_state.
  void load_layout_state(const std::map<std::string, torch::Tensor>& state);
  /// The flat buffer of bucket i (undefined while a reduction owner is set,
  /// and with Determinism::WorldSizeInvariant, whose sums live elsewhere).
  const torch::Tensor& bucket_buffer(size_t i) const { return buckets_.at(i).buffer; }

  /// Determinism::WorldSizeInvariant: this rank's first leaf of the global
  /// batch and how many it computes per step (one forward and backward
  /// each, in leaf order). Without it: leaf 0 and 1.
  int64_t first_leaf() const { return leaf_ ? leaf_->first_leaf() : 0; }
  /// See first_leaf().
  int64_t local_leaves() const { return leaf_ ? leaf_->local_leaves() : 1; }

  /// Called by the accumulator hook of parameter `index`; has_gradient as
  /// AccumulatorHooks gives it (internal).
  void on_gradient_ready(size_t index, bool has_gradient);
  /// Depth of no_sync() scopes (NoSyncGuard counts it).
  int no_sync_depth() const { return no_sync_depth_; }
  /// Whether the backward of the last forward reduces: that forward ran
  /// outside no_sync() and the strategy is not NoSync (a reduction owner
  /// that hooks parameters DDP does not reduce follows it).
  bool synchronizing() const { return sync_this_iteration_; }

 private:
  // What a bucket holds; its launch, wait and timing are queue_'s.
  struct Bucket {
    std::vector<size_t> params;        // indices into params_
    torch::Tensor buffer;              // flat, one dtype
    std::vector<torch::Tensor> views;  // per parameter, shaped like it
  };
  struct Slot {
    size_t bucket = 0;
    size_t position = 0;  // index into Bucket::params
  };

  // params_, names_, frozen_ and frozen_names_ from all_params_ and reduced_.
  void split_parameters();
  // The parameter set follows requires_grad (gradient_reducer_parameter_set.cpp):
  // one pass over the flags, and only when they changed, the agreement and
  // the rebuild.
  void follow_requires_grad();
  // Why this rank cannot reduce the set `next` (per all_params_), in words
  // that are the same on every rank that has the same reason; "" if it can.
  std::string parameter_set_refusal(const std::vector<char>& next) const;
  void adopt_parameter_set(std::vector<char> next);
  void broadcast_state();
  void broadcast_buffers();
  void build_buckets(const std::vector<size_t>& order);
  // Buckets of exactly these parameter indices, in this launch order.
  void install_buckets(std::vector<std::vector<size_t>> closed);
  // Tells the comm hook which buckets differ from `before`.
  void tell_hook_changed(const std::vector<std::vector<size_t>>& before);
  // gradient_as_bucket_view: each existing .grad becomes its bucket view.
  void move_grads_into_buckets();
  void rebuild_buckets();
  void reset_iteration();
  // After a synchronizing backward (or a failed one): the next no_sync()
  // accumulation starts with no parameter locally used.
  void clear_local_use();
  void mark_ready(size_t index, bool used);
  [[noreturn]] void refuse_create_graph(size_t index);
  void launch_ready_buckets();
  Work launch(size_t b);
  void finish_backward();
  // A backward that threw (found at the next forward): waits for what it
  // launched and drops its gradients, so the next step starts clean; a
  // MismatchError on every rank when it did not throw on every rank.
  void backward_failed();
  // A training forward with no backward through DDP since (found at the
  // next forward): with leaves the step is abandoned; then agree_skipped().
  void backward_skipped();
  // The barrier the ranks that dropped a step meet in: no bucket pairs with
  // it, so a rank that did not drop it makes it a MismatchError everywhere.
  void agree_skipped(const std::string& what);
  // Retires the buckets and writes the averages into .grad. `agree`: which
  // parameters have a gradient on any rank is agreed from locally_used_
  // (any_rank_has), and one that has none anywhere keeps an undefined .grad.
  // `agreed`: which parameters some rank used, agreed already (then not here).
  void wait_and_write_back(double backward_end_s, bool agree,
                           const std::vector<char>* agreed = nullptr);
  /// Leaves the parameters no rank used (used[i] == 0) as they were before
  /// the step: .grad as it was, and the hook's state of their elements.
  void leave_unused_alone(const std::vector<char>& used);
  void start_iteration_clock();
  // Determinism::WorldSizeInvariant (gradient_reducer_leaves.cpp).
  void setup_leaves();
  void refuse_with_leaves(const std::string& what) const;
  void prepare_leaf_forward();
  void on_leaf_gradient(size_t index);
  void fold_leaf_gradient(size_t index, bool last_leaf);
  Work launch_leaf_bucket(size_t b);
  void finish_leaf_backward();
  void finish_owner_leaf();
  void finish_leaf_exchange(double backward_end);
  void finish_leaf_step(double backward_end, int64_t bytes);
  // A leaf's backward threw: the step is abandoned, its leaves and
  // exchanges dropped and the buffers put back as the step found them.
  void abandon_leaf_step() noexcept;
  void keep_buffers(std::vector<torch::Tensor>& into);
  void restore_buffers(const std::vector<torch::Tensor>& from);

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<Communicator> comm_;
  DDPOptions options_;
  std::shared_ptr<CommHook> hook_;
  uint64_t sent_at_start_ = 0;  // comm_->stats() bytes sent when the iteration began
  ReductionOwner* owner_ = nullptr;

  // Every parameter once, in registration order, and whether each is
  // reduced (in params_; all_index_ maps params_'s indices to these).
  std::vector<torch::Tensor> all_params_;
  std::vector<std::string> all_names_;
  std::vector<char> reduced_;
  std::vector<size_t> all_index_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  // Not reduced (without requires_grad); all are broadcast at construction.
  std::vector<torch::Tensor> frozen_;
  std::vector<std::string> frozen_names_;
  std::vector<torch::Tensor> buffers_;
  std::unique_ptr<AccumulatorHooks> hooks_;

  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;
  BucketQueue queue_;  // buckets_ in index order

  /// Per-iteration state.
  bool sync_this_iteration_ = false;
  // Whether the next forward broadcasts the buffers: the last forward was a
  // synchronizing training forward (true before the first one).
  bool require_forward_param_sync_ = true;
  bool backward_started_ = false;
  bool backward_finished_ = true;
  std::vector<char> ready_;
  // Got a gradient on this rank since the last synchronizing backward: in
  // any micro-batch of a no_sync() accumulation, or in any leaf of a
  // WorldSizeInvariant step.
  std::vector<char> locally_used_;
  std::vector<size_t> unused_;  // found at forward (find_unused_parameters)
  // The .grad of a parameter this rank did not use, when it is a bucket
  // view (gradient_as_bucket_view) the hook overwrites: what it was before
  // the step, kept should no rank use it.
  std::map<size_t, torch::Tensor> unused_grads_;
  std::string pending_error_;
  int no_sync_depth_ = 0;

  /// Bucket rebuild: the order of the first reduced iteration.
  std::vector<size_t> ready_order_;
  bool order_recorded_ = false;
  bool rebuilt_ = false;

  DDPStats stats_;

  /// Determinism::WorldSizeInvariant: the leaf sums, and the buffers at the
  /// step's start and after this rank's first leaf (BatchNorm statistics).
  std::unique_ptr<LeafReduction> leaf_;
  std::unique_ptr<LeafBuckets> leaf_buckets_;  // without an owner
  std::vector<torch::Tensor> step_buffers_;
  std::vector<torch::Tensor> first_leaf_buffers_;
  // A training forward whose backward has not begun: at the next forward
  // that backward was skipped, threw before any parameter's gradient, or
  // the forward itself threw.
  bool forward_awaits_backward_ = false;
  // Without an owner, at world > 1: per bucket, the all-gather of its mean
  // that its job started.
  std::vector<Work> leaf_gathers_;
  // Last: destroyed first, it runs its submitted jobs, which use the above.
  std::unique_ptr<SerialWorker> leaf_worker_;
};

}  // namespace cohort
