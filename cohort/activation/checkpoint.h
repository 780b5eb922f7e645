// defines: checkpoint (activation checkpointing: recompute a function's
// activations in backward instead of keeping them), CheckpointOptions.
// Modules: checkpoint_wrapper.h.
//
// As PyTorch's torch.utils.checkpoint with use_reentrant=False: the forward
// runs under no grad and keeps only its inputs; backward runs the function
// again with grad enabled (the same RNG state, so the same dropout masks)
// and differentiates it. The parameters the function uses are passed in, so
// that their gradients reach their accumulators (and the hooks DDP, ZeRO and
// the fused optimizer keep there) as they would without checkpointing.
//
//   auto y = cohort::checkpoint([block](const torch::Tensor& x) { return block->forward(x); },
//                               x, block->parameters());
#pragma once

#include <ATen/core/Generator.h>
#include <torch/types.h>

#include <functional>
#include <vector>

namespace cohort {

/// How checkpoint recomputes.
struct CheckpointOptions {
  /// Save the default CPU generator's state (and the CUDA generators' of the
  /// inputs' devices) at forward and run the recompute from it, so that
  /// dropout draws the same masks; the caller's random stream after backward
  /// is as if nothing had been recomputed. Off saves the copies, when the
  /// function draws nothing random. The generators are process-wide: ranks
  /// run as threads of one process share them.
  bool preserve_rng_state = true;
  /// Generators of one's own that `fn` draws from besides the default ones
  /// (tensor_parallel::RngTracker's), saved and restored with them under
  /// preserve_rng_state: a generator left out would draw other masks in
  /// the recompute than in the forward, and the gradients would be wrong.
  std::vector<at::Generator> generators;
  /// The buffers `fn` may update in place (a module's buffers(): BatchNorm's
  /// running statistics and num_batches_tracked). Each recompute copies them
  /// first and writes the copies back once its gradients are taken, so that
  /// training with checkpointing leaves them as training without it does;
  /// buffers not listed are updated again by every recompute (twice per
  /// micro-batch, three times under zero-bubble). CheckpointWrapper adds
  /// its module's buffers itself.
  std::vector<torch::Tensor> buffers;
};

/// A function from tensors to tensors, run once at forward (no grad) and
/// again at each backward that needs its gradients.
using CheckpointFunction =
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `fn(inputs)` without keeping its activations; returns its outputs.
/// When grad mode is on and an input or a parameter requires grad, the
/// floating-point outputs require grad and their backward recomputes `fn`
/// and differentiates only what that backward pass needs (the inputs, the
/// parameters, or both: zero-bubble's separate input and weight passes
/// recompute once each). Otherwise it is `fn(inputs)`.
///
/// `params`: every tensor `fn` reads that requires grad and is not an input
/// (a module's parameters); those not requiring grad are ignored. `fn` must
/// be deterministic given the RNG state (and, under tensor parallelism, run
/// the same collectives in the same order on every rank), must not modify
/// its inputs, and must outlive the backward (capture by value). Inputs and
/// parameters must not be modified in place before the backward. `fn` runs
/// in whatever training mode its modules are in, so pass the buffers it
/// updates in `options.buffers`. The recompute runs under the autocast
/// state (CPU and CUDA) the forward ran under.
///
/// Outputs that share memory are views as they were in `fn`: outputs of one
/// tensor (itself twice, or a view of it) are views of one base, and an
/// output that is a view of an input or parameter is that view of it, so a
/// change in place of one reaches the others' gradients, as without
/// checkpoint. Such a change of an input through its view makes a backward
/// that recomputes throw ("modified by an inplace operation"): the
/// recompute would read the changed input.
///
/// Throws InvalidArgument (naming checkpoint) when `fn` returns no
/// floating-point tensor while grad is needed, changes an input or
/// parameter in place, or returns outputs that share memory with each other
/// or with an input under different dtypes; and, in backward, when its
/// recompute returns no tensor requiring grad, outputs of another number,
/// shape or dtype than the forward's, or reaches a tensor requiring grad that
/// is neither an input nor in `params` (its gradient would be lost).
/// Its gradients are differentiable once: a second backward through them
/// (after a backward with create_graph) throws c10::Error naming checkpoint.
std::vector<torch::Tensor> checkpoint(CheckpointFunction fn,
                                      const std::vector<torch::Tensor>& inputs,
                                      const std::vector<torch::Tensor>& params = {},
                                      CheckpointOptions options = {});

/// The one-tensor form: `fn(input)`, checkpointed.
torch::Tensor checkpoint(std::function<torch::Tensor(const torch::Tensor&)> fn,
                         const torch::Tensor& input, const std::vector<torch::Tensor>& params = {},
                         CheckpointOptions options = {});

}  // namespace cohort
