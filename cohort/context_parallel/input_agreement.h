// defines: agree_inputs, the one all-gather with which the cp ranks agree on
// ring attention's shapes before any block moves.
#pragma once

#include <torch/types.h>

#include "cohort/comm/communicator.h"
#include "cohort/context_parallel/layout.h"

namespace cohort::context_parallel {

// Collective over `group`. Every rank shares a refusal code of its own
// inputs and their batch, heads, rows, head_dim and dtype, and `scale` (the
// resolved softmax scale); then every rank
// checks all of them alike, so a bad input on one rank is the same
// InvalidArgument on every rank (no rank is left waiting for a block that
// never comes). Returns the layout of the total sequence.
ZigZagLayout agree_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          Communicator& group, Millis timeout, double scale);

}  // namespace cohort::context_parallel
