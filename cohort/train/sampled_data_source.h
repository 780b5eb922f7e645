// defines: SampledDataSource, the Trainer's DataSource over in-memory tensors
// dealt by a data::DistributedSampler: each rank gets what PyTorch's
// DistributedSampler gives it (elements r, r + n, ... of the epoch's
// order, padded or cut by drop_last), reshuffled by the sampler every epoch.
//
// For programs ported from PyTorch that deal with DistributedSampler.
// The sampler's epoch order is its permutation repeated from its start
// (padding; cut by drop_last), whatever num_replicas, and rank r takes its
// elements r, r + num_replicas, ...: micro-batch i of all ranks together is
// the order's elements [i g, (i + 1) g), g = micro_batch x num_replicas. So
// it resumes at another world or data-parallel size, as TensorDataSource
// does (DataSource::global_micro_batch).
#pragma once

#include <torch/types.h>

#include <vector>

#include "cohort/data/distributed_sampler.h"
#include "cohort/train/data_source.h"

namespace cohort {

/// A DataSource over data[i], targets[i] through `sampler` (file comment):
/// micro-batch k of an epoch is this rank's sampled indices [k * micro_batch,
/// (k + 1) * micro_batch); a last incomplete micro-batch is left out.
class SampledDataSource : public DataSource {
 public:
  /// InvalidArgument when data and targets differ in length, micro_batch < 1,
  /// or the sampler was made for another number of samples.
  SampledDataSource(torch::Tensor data, torch::Tensor targets, int64_t micro_batch,
                    data::DistributedSampler sampler);
  /// Sets the sampler's epoch (and its copies') and draws this rank's indices.
  void set_epoch(int64_t epoch) override;
  int64_t num_batches() const override;
  torch::data::Example<> batch(int64_t index) override;
  /// micro_batch x the sampler's num_replicas (file comment).
  int64_t global_micro_batch() const override {
    return micro_batch_ * static_cast<int64_t>(sampler_.num_replicas());
  }
  /// false: the position counts the old dataset's permutation.
  bool resumes_over_another_dataset() const override { return false; }
  /// The sampled indices micro-batch `index` takes.
  torch::Tensor sample_indices(int64_t index) override;
  /// The sampler's rank, num_replicas and dataset size.
  DataShard shard() const override {
    return {sampler_.rank(), sampler_.num_replicas(),
            static_cast<int64_t>(sampler_.dataset_size())};
  }
  /// "DistributedSampler seed 5, shuffle true": the sampler's settings that
  /// pick the order. Not drop_last: each rank's indices with it are a prefix
  /// of those without, so micro-batch i names the same samples either way
  /// (and the micro-batches an epoch are compared apart).
  std::string order_settings() const override;
  /// The sampler this source deals with.
  const data::DistributedSampler& sampler() const { return sampler_; }

 private:
  torch::Tensor data_;
  torch::Tensor targets_;
  int64_t micro_batch_;
  data::DistributedSampler sampler_;
  torch::Tensor indices_;  ///< this rank's, for the current epoch
};

}  // namespace cohort
