// defines: TensorParallelModule, the interface through which a layer tells
// the layers that cannot see its type (a GradientSynchronizer, the gradient
// norms, the checkpoint adapters, the Trainer's wirings) which of its
// parameters are split over a tensor-parallel group, along which dimension
// and over which group, and which are whole on every rank but see
// sequence-split activations; TensorParallelSplit, one such parameter; and
// mark_tensor_parallel_split, with which such a layer marks its split
// parameters for the modes that replicate them (DDP, ZeRO, FSDP and the rest
// sit lower still, and see only tensors).
#pragma once

#include <torch/types.h>

#include <memory>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// A parameter split over a tensor-parallel group of tp ranks: TP rank r
/// holds slice r of tp of the whole tensor along `dim` (the whole size along
/// `dim` is tp times this rank's).
struct TensorParallelSplit {
  torch::Tensor parameter;  ///< this rank's part
  int64_t dim = 0;          ///< the dimension the whole tensor is split along
};

/// A module whose parameters are laid out over a tensor-parallel group.
/// Everything that counts or saves a parameter once per model (the gradient
/// norms, dcp's checkpoints, the Trainer's wirings) reads the layout from
/// here, so a layer of one's own that implements it is treated as cohort's
/// own TP layers are; one that splits parameters without implementing it is
/// taken for replicated (its parts counted and saved as whole tensors).
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  /// Its own parameters of which each TP rank holds a different part (their
  /// gradients differ across TP ranks by design), each with the dimension it
  /// is split along. Over a group of one rank they are whole tensors, and the
  /// consumers take them for plain parameters.
  virtual std::vector<TensorParallelSplit> tensor_parallel_splits() const = 0;
  /// The group it splits them over (not null).
  virtual std::shared_ptr<Communicator> tensor_parallel_group() const = 0;
  /// Whether it splits or gathers activations along the sequence over the
  /// group (sequence parallelism): the wirings that train TP layers without a
  /// mesh refuse such a layer, because only a GradientSynchronizer sums the
  /// gradients of the replicated parameters that see those activations.
  virtual bool sequence_parallel() const = 0;
  /// Its own parameters that are whole on every TP rank but whose gradients
  /// are partial sums per TP rank, because the activations they see are
  /// split along the sequence over TP (sequence parallelism): a
  /// GradientSynchronizer over a stage holding the module sums them over TP.
  virtual std::vector<torch::Tensor> sequence_parallel_parameters() const { return {}; }
  /// The parameters of tensor_parallel_splits(), in its order.
  std::vector<torch::Tensor> tensor_parallel_split_parameters() const;
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
