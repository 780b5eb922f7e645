// defines: CheckpointWrapper and checkpoint_wrapper (a module whose forward
// is checkpointed as a whole, usable as a child of a Sequential, as
// PyTorch's checkpoint_wrapper), checkpoint_blocks (a Sequential's blocks
// checkpointed by one call).
//
//   seq->push_back(cohort::checkpoint_wrapper(Block(...)));
//   auto stage = cohort::checkpoint_blocks(split_sequential(model, bounds, s));
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <memory>

#include "cohort/activation/checkpoint.h"

namespace cohort {

/// A module (one tensor in, one out) whose forward is checkpointed: it keeps
/// only its input for backward. The wrapped module is its child "module",
/// so parameters, train()/eval() and state dicts reach it (names gain the
/// prefix "module."). As a child of a Sequential it is one layer, so a
/// pipeline stage's weight unit is the whole wrapped module.
class CheckpointWrapperImpl : public torch::nn::Module {
 public:
  /// Wraps `module` (any module with a forward(Tensor) -> Tensor); it must
  /// not be empty.
  explicit CheckpointWrapperImpl(torch::nn::AnyModule module, CheckpointOptions options = {});
  /// Wraps a Sequential (whose templated forward an AnyModule cannot hold).
  explicit CheckpointWrapperImpl(torch::nn::Sequential module, CheckpointOptions options = {});

  /// `module(input)`, checkpointed with this module's parameters; its
  /// recomputes leave the module's buffers (BatchNorm's running statistics)
  /// as they find them.
  torch::Tensor forward(const torch::Tensor& input);

  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  // Calls module_'s forward; copied into each call's recompute, so it holds
  // the module by a shared pointer of its own.
  std::function<torch::Tensor(const torch::Tensor&)> call_;
  CheckpointOptions options_;
};
TORCH_MODULE(CheckpointWrapper);

/// `module` checkpointed (as PyTorch's checkpoint_wrapper): e.g.
/// `seq->push_back(checkpoint_wrapper(Block(...)))`.
CheckpointWrapper checkpoint_wrapper(torch::nn::AnyModule module, CheckpointOptions options = {});
/// A Sequential checkpointed as a whole.
CheckpointWrapper checkpoint_wrapper(torch::nn::Sequential module, CheckpointOptions options = {});

/// A Sequential of the same layers in checkpointed blocks: each layer with
/// parameters, with the parameterless layers after it (an activation, a
/// dropout), is one CheckpointWrapper around a Sequential of them; leading
/// parameterless layers join the first block. A block keeps only its input
/// for backward. A pipeline stage built from the result has one weight unit
/// per block. Parameter names change (each block adds "<i>.module.").
torch::nn::Sequential checkpoint_blocks(const torch::nn::Sequential& model,
                                        CheckpointOptions options = {});

}  // namespace cohort
