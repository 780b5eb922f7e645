// defines: LeafBuckets, DDP's leaf sums in its bucket layout under
// Determinism::WorldSizeInvariant (without a reduction owner). Each
// parameter's gradient is folded into the partial sums as backward produces
// it (LeafReduction::fold(): held as computed, or added into its slot; no
// per-leaf flat copy), and a bucket's exchange starts as soon as the rank's last leaf has
// completed it, while backward goes on: the cross-rank stage of
// LeafReduction::finish() run on the bucket's elements. Every element gets
// the same additions in the same order as in finish(), so the bits do not
// depend on the buckets; the buffers are kept from step to step.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/grad_sync/leaf_tree.h"

namespace cohort {

/// The partial leaf sums, the exchange buffers and the mean of DDP's
/// parameters, laid out bucket after bucket, each bucket padded to a
/// multiple of the world size (its chunk per rank).
class LeafBuckets {
 public:
  /// `buckets`: parameter indices per bucket, in launch order (every
  /// parameter once). `leaf` must outlive this. Allocates at the first fold().
  LeafBuckets(std::vector<torch::Tensor> params, const std::vector<std::vector<size_t>>& buckets,
              const LeafReduction& leaf, int world);
  /// Folds parameter i's gradient of local leaf k (undefined: zeros) into the
  /// partial sums, by leaf.fold(k).
  void fold(size_t i, int64_t k, const torch::Tensor& grad);
  /// Bucket b's subtree sums are complete (every parameter of the last local
  /// leaf folded): starts its all_to_all (chunk j of each subtree sum to
  /// rank j). At world 1, writes its mean at once and returns a done Work.
  Work exchange(Communicator& comm, size_t b);
  /// After bucket b's exchange completed: completes the tree on this rank's
  /// chunk (LeafReduction::complete_into()) and starts the all-gather of the
  /// bucket's mean.
  Work gather(Communicator& comm, size_t b);
  /// The mean, one alias per parameter (valid after every bucket's gather).
  const std::vector<torch::Tensor>& mean() const { return mean_aliases_; }
  /// The mean's bytes, padding included.
  int64_t bytes() const { return padded_ * element_size_; }

 private:
  void allocate();
  void materialize(size_t b);
  torch::Tensor segment(const torch::Tensor& flat, size_t b) const;
  torch::Tensor exchanged(const torch::Tensor& flat, size_t b) const;

  std::vector<torch::Tensor> params_;
  std::vector<std::vector<size_t>> buckets_;
  const LeafReduction& leaf_;
  int world_;
  int64_t element_size_;
  int64_t padded_ = 0;                             // all buckets, padded
  std::vector<int64_t> offset_;                    // per parameter, in the padded layout
  std::vector<int64_t> start_;                     // per bucket, in the padded layout
  std::vector<int64_t> chunk_;                     // per bucket: elements per rank
  std::vector<int64_t> row_;                       // per bucket: its chunk's offset in rows_
  std::vector<torch::Tensor> slots_;               // LeafReduction::Fold's slots
  std::vector<std::vector<torch::Tensor>> views_;  // per slot, per parameter
  // Per slot, per parameter: a leaf's gradient held as computed instead of
  // in the slot (undefined: the slot's view holds the value).
  std::vector<std::vector<torch::Tensor>> held_;
  torch::Tensor send_;      // [world, m, chunk] per bucket, when a slot cannot be sent as is
  torch::Tensor received_;  // [world, m, chunk] per bucket
  torch::Tensor rows_;      // this rank's chunk of the mean, per bucket
  torch::Tensor mean_;
  std::vector<torch::Tensor> mean_aliases_;
};

}  // namespace cohort
