// defines: TensorDataSource, in-memory tensors split over ranks: one global
// order per epoch (LibTorch's DistributedRandomSampler's permutation, or the
// identity), dealt out micro-batch by micro-batch, so that the samples of a
// global micro-batch are the same at every world size (elastic resume).
#pragma once

#include <torch/types.h>

#include "cohort/train/data_source.h"

namespace cohort {

/// A DataSource over in-memory tensors. The epoch's global order P is the permutation LibTorch's
/// DistributedRandomSampler draws for it (shuffle; the identity otherwise); micro-batch i of rank
/// r is P[(i * world + r) * micro_batch, + micro_batch), so micro-batch i of all ranks together is
/// P[i * g, (i + 1) * g) with g = micro_batch * world at any world size (global_micro_batch).
class TensorDataSource : public DataSource {
 public:
  /// data[i], targets[i] is sample i. An epoch has size / g micro-batches per rank; the last
  /// size % g samples of P (an incomplete global micro-batch) are left out of that epoch.
  TensorDataSource(torch::Tensor data, torch::Tensor targets, int64_t micro_batch, int rank,
                   int world_size, bool shuffle = true);
  void set_epoch(int64_t epoch) override;
  int64_t num_batches() const override;
  torch::data::Example<> batch(int64_t index) override;
  int64_t global_micro_batch() const override { return micro_batch_ * world_size_; }
  /// The rows of data micro-batch `index` takes.
  torch::Tensor sample_indices(int64_t index) override;
  /// The rank and world size it was made with, and the data's samples.
  DataShard shard() const override { return {rank_, world_size_, data_.size(0)}; }
  /// "TensorDataSource, shuffle true" (or false).
  std::string order_settings() const override;

 private:
  torch::Tensor data_;
  torch::Tensor targets_;
  int64_t micro_batch_;
  int rank_;
  int world_size_;
  bool shuffle_;
  torch::Tensor indices_;  ///< this rank's sample order for the current epoch
};

namespace detail {

/// InvalidArgument naming `source` unless data and targets have as many
/// samples and micro_batch is positive.
void check_samples(const torch::Tensor& data, const torch::Tensor& targets, int64_t micro_batch,
                   const char* source);

/// The `micro_batch` entries of `indices` that micro-batch `index` takes;
/// InvalidArgument naming `source` when it is not one of the epoch's.
torch::Tensor micro_batch_rows(const torch::Tensor& indices, int64_t micro_batch, int64_t index,
                               const char* source);

/// Micro-batch `index` of `indices`, `micro_batch` rows of data and targets
/// each (micro_batch_rows).
torch::data::Example<> micro_batch_of(const torch::Tensor& data, const torch::Tensor& targets,
                                      const torch::Tensor& indices, int64_t micro_batch,
                                      int64_t index, const char* source);

}  // namespace detail

}  // namespace cohort
