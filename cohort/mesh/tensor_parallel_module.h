// defines: TensorParallelModule, the interface through which a layer tells a
// GradientSynchronizer (a layer below the tensor-parallel layers, which
// cannot see their types) which of its parameters differ across the TP
// ranks and which are whole on every rank but see sequence-split activations.
#pragma once

#include <torch/types.h>

#include <vector>

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

}  // namespace cohort
