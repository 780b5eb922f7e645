// defines: GradNorm (how the trainer measures the global gradient norm),
// ReplicatedGradNorm, ShardedGradNorm, clip_grad_norm.
//
// Clipping by global norm must see the norm of the whole gradient of the
// whole model, over the whole global batch. Two layouts exist:
//  - replicated (DDP, the all-reduce fallback): after the gradient all-reduce
//    every rank holds the same full gradients, so the norm is local and no
//    communication is needed;
//  - sharded (ZeRO-2/3, later): each rank holds the reduced gradients of its
//    own parameters only, so each rank sums the squares of its shard and the
//    partial sums are all-reduced before the square root.
// The trainer calls the interface and does not care which one it has.
#pragma once

#include <torch/types.h>

#include <memory>
#include <vector>

namespace cohort {

class Communicator;

/// How the Trainer measures the global gradient norm for clipping.
class GradNorm {
 public:
  virtual ~GradNorm() = default;
  /// The L2 norm of all gradients of the model (every rank returns the same
  /// value). `params` are the parameters this rank holds gradients for;
  /// parameters without a gradient count as zero.
  virtual double global_norm(const std::vector<torch::Tensor>& params) = 0;
};

/// Every rank has the full, already reduced gradients.
class ReplicatedGradNorm : public GradNorm {
 public:
  double global_norm(const std::vector<torch::Tensor>& params) override;
};

/// Each rank has a disjoint shard of the gradients: sum of squares locally,
/// all-reduce (Sum) of the partial sums over `comm`, then the square root.
class ShardedGradNorm : public GradNorm {
 public:
  /// Sums the squared partial norms over `comm`. `duplicates`: tensors of
  /// this rank that copy a tensor counted on another rank or here (a
  /// pipeline's tied weight on its later stages): left out of the sum.
  explicit ShardedGradNorm(std::shared_ptr<Communicator> comm,
                           const std::vector<torch::Tensor>& duplicates = {});
  double global_norm(const std::vector<torch::Tensor>& params) override;

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<const void*> duplicates_;
};

/// Sum of squares of the gradients in `params`, accumulated in float64 so
/// that the result does not depend on how the parameters are grouped.
double local_squared_norm(const std::vector<torch::Tensor>& params);

/// Scales the gradients by max_norm / (norm + 1e-6) when that is below 1, as
/// torch::nn::utils::clip_grad_norm_ does. Returns true when it scaled.
bool clip_grad_norm(const std::vector<torch::Tensor>& params, double norm, double max_norm);

}  // namespace cohort
