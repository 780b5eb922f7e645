// defines: FSDPState, what the root of a fully sharded model runs around its
// units' forwards and backwards: unsharding each unit before it computes
// (prefetching the next one's all-gather), resharding after, and the
// reduce-scatter of each unit's gradients as soon as backward has produced
// all of them, through grad_sync's BucketQueue (one bucket per unit).
//
// Order. Every rank issues the same collectives in the same order without
// negotiation: units are numbered in pre-order of the module tree (the root
// is 0 when it has parameters of its own; kRoot names it otherwise), and
// the order they are called in is recorded (fsdp_state_order.cpp), as
// FSDP2 records its forward order: while unit u computes, the forward
// prefetches the unit called after it in the root's previous forward (u + 1
// in the first; never one this forward called already); a backward runs the
// root first, then the units in the reverse of their first calls in the
// forwards since the last backward (units not called last), and prefetches
// the next one when the root's hook runs, or when a unit's backward is over
// (its parameters freed first, so a backward holds two units, not three);
// gradients are reduce-scattered in that order (the root last), each as soon
// as its backward and those of the units before it are over. The ranks' call
// orders are the same wherever the schedule check passes (each first call
// gathers, each reduce-scatter is checked). A unit's backward is
// over once its gradients have all landed; with a frozen parameter, also
// once the units inside it are over and each call's autograd nodes have run
// (a frozen layer reads its weight in backward but lands no gradient;
// fsdp_state_calls.cpp).
// Ranks must run the same units in the same order (as in FSDP2): before
// each of these collectives the ranks check that they are about to issue
// the same one (ScheduleCheck, unit_agreement.h: one all-gather of a few
// words), so a rank whose forward skipped a unit is named with the unit, on
// every rank, instead of exchanging buffers of another size.
//
// Changes between steps. Each forward of the root takes up each unit's
// reshard_after_forward and each parameter's requires_grad: a parameter
// unfrozen since the last forward gets its gradient accumulator (made for
// its full shape) and its unit waits for its gradient; one frozen is no
// longer waited for. The next collective's check covers both.
//
// Backward. A hook on each unit's output fires before the unit's backward:
// it unshards the unit. The root's hook fires first and starts the
// iteration; a callback at the end of backward launches what is left
// (units whose parameters got no gradient send zeros), waits, tells each
// parameter whether any rank had a gradient (none: it keeps none, as in one
// process) and reshards every unit.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/fsdp/param_group.h"
#include "cohort/fsdp/unit_agreement.h"
#include "cohort/grad_sync/accumulator_hooks.h"
#include "cohort/grad_sync/bucket_queue.h"
#include "cohort/grad_sync/leaf_tree.h"

namespace cohort::fsdp {

/// One unit as the root sees it.
struct UnitEntry {
  /// The unit's parameters.
  FSDPParamGroup* group = nullptr;
  /// What the unit does after its forward (ReshardAfterForward::resolve's
  /// code: 0 keep, 1 reshard, N >= 2 reshard to groups of N ranks).
  const int* reshard_after_forward = nullptr;
  /// Whether its backward reduce-scatters its gradients (false: its full
  /// gradients accumulate locally; FSDP2's set_requires_gradient_sync).
  /// Read at each forward and backward of the root.
  const bool* requires_gradient_sync = nullptr;
  /// Its path in the root (errors).
  std::string name;
};

/// The root's schedule of its units (see the file comment).
class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  /// The root's index when it has no parameters of its own.
  static constexpr size_t kRoot = static_cast<size_t>(-1);
  /// No unit (a unit with none around it).
  static constexpr size_t kNone = static_cast<size_t>(-1);

  /// `units` in pre-order, the root first if `root_has_params`; `buffers`
  /// are broadcast from rank 0 before each training forward (DDP's rule).
  /// `comm`: the shard group; `world`: every rank of the mesh (the shard
  /// group itself for FSDP, every replica's for HSDP), over which the
  /// schedule is checked, buffers broadcast and gradient presence agreed.
  /// `leaves` > 0: Determinism::WorldSizeInvariant over that many leaves
  /// (one forward and backward per leaf; fsdp_state_leaves.cpp; collective:
  /// every rank must pass the same count).
  FSDPState(std::vector<UnitEntry> units, bool root_has_params, std::vector<torch::Tensor> buffers,
            std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> world,
            int64_t leaves = 0);
  FSDPState(const FSDPState&) = delete;
  FSDPState& operator=(const FSDPState&) = delete;

  /// Before unit u's forward (`training`: the module is in training mode);
  /// u is 0 or kRoot for the root. Returns what the unit's module computes
  /// on: an alias of `input` (`input` itself when it needs no gradient or
  /// under NoGradGuard), so that the input's gradient is part of the call's
  /// backward (watch_call).
  torch::Tensor pre_forward(size_t u, bool training, const torch::Tensor& input);
  /// After unit u's forward: reshards it (not the root) if it should, and
  /// hooks `output` (if it requires grad) to unshard it before its backward.
  /// `outermost`: no unit's forward encloses this one; if no backward will
  /// follow it either (no grad mode, or an output that needs no gradient),
  /// every unit is resharded, and so is every unit when its graph is freed
  /// before a backward ran through it (a dropped loss, an exception).
  void post_forward(size_t u, const torch::Tensor& output, bool outermost);
  /// The outermost forward threw (its pre_forward, a module inside it, or
  /// its post_forward): reshards every unit, as a freed graph would, unless
  /// a backward runs (a checkpointed unit recomputing: the backward's to
  /// settle). Waits for an all-gather in flight, which every rank issued.
  /// Never throws: a unit that refuses (a parameter replaced) stays gathered.
  void forward_failed() noexcept;
  /// One forward call of a unit, whose backward is over once the call's
  /// autograd nodes that lead out of it have run (watch_call, hook_call).
  struct CallWatch {
    size_t unit = 0;      ///< the unit called
    uint64_t first = 0;   ///< the sequence number of the call's first autograd node
    uint64_t thread = 0;  ///< the forward's thread (the nodes' thread_id())
    size_t ends = 0;      ///< nodes hooked
    size_t left = 0;      ///< of them, not run yet in the backward that opened it
    uint64_t opened = 0;  ///< the backward in which its output's gradient came
  };
  /// Unit u's output got its gradient: its backward is next. `call`: that
  /// call's CallWatch, if any.
  void pre_backward(size_t u, CallWatch* call = nullptr);

  /// Unshards every unit (collective).
  void unshard_all();
  /// Unshards units `units` (indices into units(); collective), from their
  /// shards: what hpZ kept after a forward is dropped first.
  void unshard_units(const std::vector<size_t>& units);
  /// Reshards every unit.
  void reshard_all();
  /// The units, root first.
  const std::vector<UnitEntry>& units() const { return units_; }
  /// WorldSizeInvariant: the leaves this rank computes per step (0 without).
  int64_t local_leaves() const { return leaf_.empty() ? 0 : leaf_.front()->local_leaves(); }
  /// Collective, WorldSizeInvariant only: the squared norm of every unit's
  /// sharded .grad, the same bits at every world size: per parameter (whose
  /// rows the ranks hold in rank order) grad_sync's canonical_squared_norm,
  /// added in unit and parameter order.
  double squared_grad_norm();

 private:
  // The root's forward begins: takes up changed settings (requires_grad,
  // reshard_after_forward) and broadcasts the buffers if it trains.
  void begin_forward(bool training);
  // Counts, per unit, the parameters that require grad, makes their
  // accumulators and hooks them (at construction, and when requires_grad
  // changed between steps).
  void layout_gradients();
  // Per unit its reshard_after_forward, then per parameter its requires_grad.
  std::vector<int64_t> settings() const;
  // Per unit whether it reduce-scatters its gradients (its requires_gradient_sync).
  std::vector<int64_t> sync_flags() const;
  // Launches unit u's all-gather if it is needed (after the ranks agreed on
  // it); wait_unshard: and waits for it.
  void start_unshard(size_t u, ScheduleStep step);
  void wait_unshard(size_t u, ScheduleStep step);
  void begin_backward();
  // The unit whose backward comes after unit u's (u may be kRoot); none: size.
  size_t next_in_backward(size_t u) const;
  // fsdp_state_order.cpp: the order units are called in. A root forward
  // begins: the previous one's order is what the forward prefetches by.
  void begin_call_order();
  // Unit u's forward begins (not a recomputation inside backward).
  void record_call(size_t u);
  // The unit to prefetch while unit u computes in forward (none: size).
  size_t forward_prefetch(size_t u) const;
  // A backward begins: its order, and the reduce-scatters' launch order,
  // from the first calls of the forwards since the last backward.
  void order_backward();
  void gradient_ready(size_t k);
  // fsdp_state_calls.cpp: when the backward of a unit with frozen
  // parameters is over. Before unit u's forward: what it computes on (an
  // alias of `input`, if it needs a gradient); starts the call's watch.
  torch::Tensor watch_call(size_t u, const torch::Tensor& input);
  // After it: hooks the call's nodes that lead out of it; the watch, or
  // null when the call leaves nothing to wait for.
  std::shared_ptr<CallWatch> hook_call(std::shared_ptr<CallWatch> call,
                                       const torch::Tensor& output);
  // A hooked node of `call` ran (`counted`: the hook's last backward).
  void call_node_ran(CallWatch& call, uint64_t& counted);
  // Whether unit u's backward is over: every parameter's gradient landed
  // and, with a frozen parameter, its calls' nodes have run and the units
  // inside it are over.
  bool backward_over(size_t u) const;
  // Finishes unit u if its backward is over, then the units around it that
  // waited for it; reshards a finished unit gathered again for a later call.
  void settle(size_t u);
  // Whether the accumulator `node` is of a parameter of unit u or of a unit
  // inside it.
  bool accumulates_within(const torch::autograd::Node* node, size_t u) const;
  // Unit u's backward is over: reshards it and lets its reduce-scatter go
  // (with leaves: pushes its leaf gradient).
  void finish_unit(size_t u);
  // Starts the all-gather of the unit whose backward follows unit u's.
  void prefetch_after(size_t u);
  void launch_ready();
  Work launch(size_t u);
  // Waits for the reduce-scatters in flight and frees their buffers (a
  // failure is kept and thrown at the end of backward).
  void retire_in_flight();
  void end_backward();
  // Held by the hook on an outermost forward's output, so freed with that
  // forward's graph: reshards every unit if no backward ran through it.
  struct GraphWatch;
  void graph_freed(uint64_t forward);
  // Reshards every unit, swallowing a refusal (called where nothing may throw).
  void reshard_all_quietly() noexcept;
  // Ends a backward that threw: waits for what is in flight, drops the
  // gradients of the units that reduce, reshards every unit.
  void backward_failed() noexcept;
  // WorldSizeInvariant (fsdp_state_leaves.cpp).
  void setup_leaves(int64_t leaves);
  void begin_leaf_forward();
  void leaf_gradients_ready(size_t u);
  void end_leaf_backward();
  // A leaf's forward or backward threw: the step's leaves and buffers are
  // dropped, the next forward is a first leaf (fsdp_state_leaves.cpp).
  void abandon_leaf_step() noexcept;
  void keep_buffers(std::vector<torch::Tensor>& into) const;
  void restore_buffers(const std::vector<torch::Tensor>& from);
  std::string where() const;
  /// Whether each parameter of each unit, in unit order, had a gradient.
  std::vector<char> had_gradients() const;

  std::vector<UnitEntry> units_;
  std::vector<torch::Tensor> buffers_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Communicator> world_;
  size_t root_;                         // 0, or kRoot if the root has no parameters
  std::vector<size_t> backward_order_;  // [0,] then the reverse of call_order_
  std::vector<size_t> backward_next_;   // unit -> the unit after it in backward (none: size)
  // The units in the order of their first call: in this forward of the
  // root, and in its forwards with gradients since the last backward
  // began; unit -> whether listed there; unit -> the unit called after it
  // in the previous forward (none: size; before any forward, u + 1).
  std::vector<size_t> forward_order_, call_order_;
  std::vector<char> in_forward_order_, in_call_order_;
  std::vector<size_t> forward_next_;
  uint64_t call_order_backward_ = 0;  // the backwards begun when call_order_ started
  // The reduce-scatters' launch order (the queue's), and per unit its
  // bucket's parts and bytes.
  std::vector<size_t> queue_order_;
  std::vector<int64_t> bucket_parts_, bucket_bytes_;
  // Every parameter of every unit, and its unit.
  std::vector<size_t> unit_of_;
  std::vector<size_t> first_param_;    // unit -> index of its first parameter
  std::vector<torch::Tensor> params_;  // every parameter of every unit
  std::unordered_map<const c10::TensorImpl*, size_t> param_unit_;  // parameter -> its unit
  std::vector<size_t> parts_;           // unit -> its parameters that require grad
  std::vector<size_t> parent_;          // unit -> the unit around it (none: kNone)
  std::vector<size_t> inside_;          // unit -> the units inside it
  std::vector<size_t> arrived_;         // unit -> gradients landed in this backward
  std::vector<char> backward_started_;  // unit -> its pre_backward ran in this backward
  // This backward: units whose backward is over; per unit, its calls whose
  // backward began and whose hooked nodes have not all run, and the units
  // inside it not over.
  std::vector<char> finished_;
  std::vector<size_t> open_, inside_open_;
  // Per unit: the CallWatch its pre_forward made, for its post_forward;
  // the outermost forwards before the last forward that hooked a call (-1:
  // none).
  std::vector<std::shared_ptr<CallWatch>> call_watch_;
  std::vector<int64_t> watched_after_;
  uint64_t backward_id_ = 0;      // backwards begun so far
  uint64_t forwards_before_ = 0;  // outermost forwards before the previous backward began
  std::unique_ptr<AccumulatorHooks> hooks_;
  BucketQueue queue_;
  bool in_backward_ = false;
  bool in_forward_ = false;            // between the root's pre- and post-forward
  uint64_t outermost_forwards_ = 0;    // outermost forwards with a graph so far
  uint64_t backward_after_ = 0;        // how many there were when the last backward began
  std::vector<char> reducing_;         // unit -> this backward reduce-scatters its gradients
  bool any_reducing_ = false;          // some unit does
  std::vector<std::string> failures_;  // of reduce-scatters retired early
  ScheduleCheck check_;
  std::vector<int64_t>
      settings_;  // as last agreed: reshard code per unit, requires_grad per parameter
  // WorldSizeInvariant: per unit its leaf sums; whether this leaf pushed it;
  // leaves done in this step; the step's starting buffers and those the
  // rank's first leaf left (the step keeps global leaf 0's, rank 0's).
  std::vector<std::unique_ptr<LeafReduction>> leaf_;
  std::vector<char> leaf_pushed_;
  int64_t leaf_done_ = 0;
  // A training leaf forward whose backward has not ended.
  bool leaf_forward_open_ = false;
  std::vector<torch::Tensor> step_buffers_, first_leaf_buffers_;
};

}  // namespace cohort::fsdp
