// defines: TensorDataSource, in-memory tensors split over ranks by LibTorch's
// DistributedRandomSampler (or the sequential one for evaluation).
#pragma once

#include <torch/data/samplers/distributed.h>

#include "cohort/train/data_source.h"

namespace cohort {

/// A DataSource over in-memory tensors: this rank's shard, as LibTorch's DistributedRandomSampler
/// would choose it.
class TensorDataSource : public DataSource {
 public:
  /// data[i], targets[i] is sample i. Each rank sees size / world samples
  /// (padded with repeats so ranks have equal counts), reshuffled per epoch
  /// when shuffle is true; incomplete micro-batches at the end are dropped.
  TensorDataSource(torch::Tensor data, torch::Tensor targets, int64_t micro_batch, int rank,
                   int world_size, bool shuffle = true);
  void set_epoch(int64_t epoch) override;
  int64_t num_batches() const override;
  torch::data::Example<> batch(int64_t index) override;

 private:
  torch::Tensor data_;
  torch::Tensor targets_;
  int64_t micro_batch_;
  bool shuffle_;
  torch::data::samplers::DistributedRandomSampler random_;
  torch::data::samplers::DistributedSequentialSampler sequential_;
  torch::Tensor indices_;  ///< this rank's sample order for the current epoch
};

}  // namespace cohort
