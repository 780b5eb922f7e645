#include "cohort/train/tensor_data_source.h"

#include <string>

#include "cohort/core/error.h"

namespace cohort {

TensorDataSource::TensorDataSource(torch::Tensor data, torch::Tensor targets,
                                   int64_t micro_batch, int rank, int world_size, bool shuffle)
    : data_(std::move(data)),
      targets_(std::move(targets)),
      micro_batch_(micro_batch),
      shuffle_(shuffle),
      random_(static_cast<size_t>(data_.size(0)), static_cast<size_t>(world_size),
              static_cast<size_t>(rank)),
      sequential_(static_cast<size_t>(data_.size(0)), static_cast<size_t>(world_size),
                  static_cast<size_t>(rank)) {
  if (data_.size(0) != targets_.size(0)) {
    throw InvalidArgument("TensorDataSource: " + std::to_string(data_.size(0)) +
                          " samples but " + std::to_string(targets_.size(0)) + " targets");
  }
  if (micro_batch_ < 1) {
    throw InvalidArgument("TensorDataSource: micro-batch size must be positive, got " +
                          std::to_string(micro_batch_));
  }
  set_epoch(0);
}

void TensorDataSource::set_epoch(int64_t epoch) {
  torch::data::samplers::DistributedSampler<>& sampler =
      shuffle_ ? static_cast<torch::data::samplers::DistributedSampler<>&>(random_)
               : sequential_;
  // The random sampler shuffles with the epoch as seed: every rank draws
  // the same permutation and takes its own slice of it.
  sampler.set_epoch(static_cast<size_t>(epoch));
  sampler.reset({});  // keep the dataset size
  auto picked = sampler.next(static_cast<size_t>(data_.size(0)));
  std::vector<int64_t> idx;
  if (picked) idx.assign(picked->begin(), picked->end());
  indices_ = torch::tensor(idx, torch::kInt64);
}

int64_t TensorDataSource::num_batches() const { return indices_.numel() / micro_batch_; }

torch::data::Example<> TensorDataSource::batch(int64_t index) {
  if (index < 0 || index >= num_batches()) {
    throw InvalidArgument("TensorDataSource: batch " + std::to_string(index) + " of " +
                          std::to_string(num_batches()));
  }
  auto rows = indices_.narrow(0, index * micro_batch_, micro_batch_);
  return {data_.index_select(0, rows), targets_.index_select(0, rows)};
}

}  // namespace cohort
