// defines: AccumulatorHooks, post hooks on parameters' gradient accumulators
// (shared by DDP, ZeRO stage 2 and the fused optimizer).
//
// Why the accumulator's post hook rather than param.register_hook: a tensor
// hook fires BEFORE AccumulateGrad, with only this backward's contribution,
// so it would have to redo the accumulation into .grad itself (no_sync
// accumulation, gradients as bucket views, zero_grad semantics). The
// accumulator's post hook fires AFTER .grad holds the accumulated value,
// which is what must be reduced; PyTorch's reducer hooks the same place.
// grad_accumulator() and Node::add_post_hook/del_post_hook exist with these
// signatures in LibTorch 1.13 and 2.x.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "cohort/core/torch_compat.h"

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace cohort {

/// Whether this thread is running a backward now (a hook, a checkpointed
/// module recomputing its forward). A backward that threw ran no final
/// callback: a forward outside any backward that finds one still marked
/// running knows it failed.
bool in_autograd_engine();

/// Calls `ready(index, has_gradient)` on the autograd thread each time
/// parameter `index`'s gradient accumulator has run. has_gradient is false
/// when the accumulator got an undefined gradient and left .grad alone (a
/// checkpointed block whose recompute did not use the parameter): to the
/// loss the parameter took no part. Removes its hooks when destroyed.
class AccumulatorHooks {
 public:
  /// Hooks every parameter that requires grad; `ready` gets its index.
  AccumulatorHooks(const std::vector<torch::Tensor>& params,
                   std::function<void(size_t, bool)> ready);
  ~AccumulatorHooks();
  AccumulatorHooks(const AccumulatorHooks&) = delete;
  AccumulatorHooks& operator=(const AccumulatorHooks&) = delete;

  /// Re-hooks parameters whose accumulator LibTorch replaced (Module::load
  /// set_()s every parameter to the loaded tensor: the old accumulator,
  /// still holding the hook, is then part of no graph).
  void refresh();
  /// Hooks the parameters that require grad now and have no hook (frozen
  /// when this was made, unfrozen since). Call it outside any backward.
  void hook_unhooked();
  /// Parameter i's hooked accumulator (null if it does not require grad).
  torch::autograd::Node* accumulator(size_t i) const { return accumulators_[i].get(); }

 private:
  void hook(size_t i);

  std::vector<torch::Tensor> params_;
  std::function<void(size_t, bool)> ready_;
  // The variables hold their accumulators weakly; keeping them alive keeps
  // the hooks registered for the parameters' lifetime.
  std::vector<NodePtr> accumulators_;
  std::vector<uintptr_t> keys_;
};

}  // namespace cohort
