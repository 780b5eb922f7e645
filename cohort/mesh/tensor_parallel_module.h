// defines: TensorParallelModule, the interface through which a layer tells a
// GradientSynchronizer (a layer below the tensor-parallel layers, which
// cannot see their types) which of its parameters differ across the TP
// ranks and which are whole on every rank but see sequence-split activations;
// and mark_tensor_parallel_split, with which such a layer marks its split
// parameters for the modes that replicate them (DDP, ZeRO, FSDP and the
// rest sit lower still, and see only tensors).
#pragma once

#include <torch/types.h>

#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// A module whose parameters are laid out over a tensor-parallel group.
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  /// Its own parameters of which each TP rank holds a different part (their
  /// gradients differ across TP ranks by design).
  virtual std::vector<torch::Tensor> tensor_parallel_split_parameters() const = 0;
  /// Its own parameters that are whole on every TP rank but whose gradients
  /// are partial sums per TP rank, because the activations they see are
  /// split along the sequence over TP (sequence parallelism): a
  /// GradientSynchronizer over a stage holding the module sums them over TP.
  virtual std::vector<torch::Tensor> sequence_parallel_parameters() const { return {}; }
};

/// Marks each of `module.tensor_parallel_split_parameters()` as TP rank
/// `tp_group.rank()`'s part of a tensor split over `tp_group` (nothing when
/// the group is one rank). The modes that replicate parameters over a group
/// (DDP, ZeRO, the fused optimizer, FSDP, the all-reduce sync) compare the
/// marks over it at construction and refuse, on every rank, a group whose
/// ranks hold different TP ranks' parts (one not orthogonal to the TP group,
/// as the whole world of a dp x tp mesh): it would average or broadcast
/// different parts of one tensor. A layer implementing TensorParallelModule
/// calls it where it registers those parameters: at the end of its
/// constructor, or in reset() for a torch::nn::Cloneable, whose clone() gives
/// the copy new tensors through reset() (a mark made in the constructor would
/// not reach them), as cohort's TP layers do.
void mark_tensor_parallel_split(const TensorParallelModule& module, const Communicator& tp_group);

}  // namespace cohort
