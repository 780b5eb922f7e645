// defines: the check that the parameters whole on every TP rank (LayerNorms,
// row-parallel biases, embeddings outside TP) hold the same values on every
// TP rank, and tp_digests, the per-tensor digests it and the
// GradientSynchronizer's gradient checks compare over TP. Replicas drawn
// from a seed of each rank's own would train apart with no error: nothing
// else compares values over TP (the data-parallel modes broadcast over
// their own group only). Shared by the GradientSynchronizer and the
// Trainer's wirings that take a model of TP layers without a mesh (ddp,
// all_reduce, fsdp).
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// A parameter under its name in the module that holds it.
using NamedParameter = std::pair<std::string, torch::Tensor>;

/// The parameters of `module` (frozen ones too: one unfrozen later must not train apart
/// unchecked) that are whole on every TP rank: all but those a TensorParallelModule in it
/// splits (tensor_parallel_split_parameters, the module itself included), `experts`, and those
/// marked rank-local (core/rank_local.h: an MoE's experts split over TP). Local.
std::vector<NamedParameter> tp_replicated_parameters(
    const torch::nn::Module& module, const std::vector<torch::Tensor>& experts = {});

/// Per tensor the sum and the sum of magnitudes (zeros where undefined), in double, of every TP
/// rank: [tp.size(), tensors.size(), 2] on the CPU. Equal tensors give equal digests. Collective
/// over `tp`: one all-gather of two doubles per tensor, on `device` (the tensors').
torch::Tensor tp_digests(Communicator& tp, const std::vector<torch::Tensor>& tensors,
                         torch::Device device);

/// Why `replicas` (tp_replicated_parameters) would train apart, or "": the first whose values
/// on some TP rank differ from TP rank 0's, named with both TP ranks and their sums (`sum_of`
/// says of what, after "sum", where they are parts: " of this rank's FSDP shard"). Exact:
/// replicas built alike are equal bit for bit. Collective over `tp` where `replicas` is not
/// empty (tp_digests); every TP rank gets the same answer.
std::string tp_replica_values_mismatch(Communicator& tp,
                                       const std::vector<NamedParameter>& replicas,
                                       const std::string& sum_of = "");

}  // namespace cohort
