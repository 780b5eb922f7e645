// defines: once_differentiable, what a hand-written backward passes its
// gradients through so that differentiating them again is an error.
//
// Some of cohort's autograd functions (ring attention, the MoE exchanges,
// the vocab-parallel cross-entropy, activation checkpointing) compute their
// gradients on detached tensors: a communicator writes into plain buffers,
// or the gradient comes from saved results. Under backward with
// create_graph those gradients would carry no graph back to the inputs, so
// a second derivative through them would silently miss their terms. As
// PyTorch's @once_differentiable does, each gradient then gets an error
// node: a second backward that reaches it throws, one that does not is
// unaffected.
#pragma once

#include <torch/csrc/autograd/variable.h>

#include <string>

namespace cohort {

/// `grads` as they are when grad mode is off (a plain backward); under
/// create_graph, each defined one behind a node that throws, naming
/// `what`, if a second backward reaches it.
torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads,
                                                   const std::string& what);

}  // namespace cohort
