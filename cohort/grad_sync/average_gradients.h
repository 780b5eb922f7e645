// defines: average_gradients, data parallelism without buckets: the
// gradients averaged after backward in one coalesced all-reduce: the one
// spelling of "average the gradients". The Trainer's AllReduceGradientSync
// (a model without DDP), a pipeline's data-parallel group and the MoE
// layer's dense and expert groups call it.
#pragma once

#include <torch/types.h>

#include <vector>

namespace cohort {

class Communicator;

/// Collective over `comm`: averages the .grad of `params` in one coalesced
/// all-reduce and waits. A parameter without a gradient on this rank takes
/// part as zeros (its .grad becomes a zero tensor), so that every rank sends
/// the same tensors. At world size 1 (or without parameters) nothing is
/// sent and the gradients are left as they are.
void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm);

}  // namespace cohort
