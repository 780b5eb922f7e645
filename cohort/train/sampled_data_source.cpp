#include "cohort/train/sampled_data_source.h"

#include <string>

#include "cohort/core/error.h"

namespace cohort {

SampledDataSource::SampledDataSource(torch::Tensor data, torch::Tensor targets, int64_t micro_batch,
                                     data::DistributedSampler sampler)
    : data_(std::move(data)),
      targets_(std::move(targets)),
      micro_batch_(micro_batch),
      sampler_(std::move(sampler)) {
  if (data_.size(0) != targets_.size(0)) {
    throw InvalidArgument("SampledDataSource: " + std::to_string(data_.size(0)) + " samples but " +
                          std::to_string(targets_.size(0)) + " targets");
  }
  if (micro_batch_ < 1) {
    throw InvalidArgument("SampledDataSource: micro-batch size must be positive, got " +
                          std::to_string(micro_batch_));
  }
  set_epoch(sampler_.epoch());
  // Every index drawn must be a sample: a sampler over more samples would
  // read past the data (index_select would say so only at the first batch).
  if (indices_.numel() > 0 && indices_.max().item<int64_t>() >= data_.size(0)) {
    throw InvalidArgument("SampledDataSource: the sampler deals " +
                          std::to_string(indices_.max().item<int64_t>() + 1) +
                          " or more samples but the data has " + std::to_string(data_.size(0)));
  }
}

void SampledDataSource::set_epoch(int64_t epoch) {
  sampler_.set_epoch(epoch);
  const auto picked = sampler_.indices();
  indices_ = torch::tensor(std::vector<int64_t>(picked.begin(), picked.end()), torch::kInt64);
}

int64_t SampledDataSource::num_batches() const { return indices_.numel() / micro_batch_; }

torch::data::Example<> SampledDataSource::batch(int64_t index) {
  if (index < 0 || index >= num_batches()) {
    throw InvalidArgument("SampledDataSource: batch " + std::to_string(index) + " of " +
                          std::to_string(num_batches()));
  }
  auto rows = indices_.narrow(0, index * micro_batch_, micro_batch_);
  return {data_.index_select(0, rows), targets_.index_select(0, rows)};
}

}  // namespace cohort
