#include "cohort/train/sampled_data_source.h"

#include <string>

#include "cohort/core/error.h"
#include "cohort/train/tensor_data_source.h"

namespace cohort {

SampledDataSource::SampledDataSource(torch::Tensor data, torch::Tensor targets, int64_t micro_batch,
                                     data::DistributedSampler sampler)
    : data_(std::move(data)),
      targets_(std::move(targets)),
      micro_batch_(micro_batch),
      sampler_(std::move(sampler)) {
  detail::check_samples(data_, targets_, micro_batch_, "SampledDataSource");
  // A sampler over more samples would read past the data, one over fewer
  // would never deal the rest.
  if (static_cast<int64_t>(sampler_.dataset_size()) != data_.size(0)) {
    throw InvalidArgument("SampledDataSource: the sampler deals from " +
                          std::to_string(sampler_.dataset_size()) + " samples but the data has " +
                          std::to_string(data_.size(0)));
  }
  set_epoch(sampler_.epoch());
}

void SampledDataSource::set_epoch(int64_t epoch) {
  sampler_.set_epoch(epoch);
  const auto picked = sampler_.indices();
  indices_ = torch::tensor(std::vector<int64_t>(picked.begin(), picked.end()), torch::kInt64);
}

std::string SampledDataSource::order_settings() const {
  return "DistributedSampler seed " + std::to_string(sampler_.seed()) + ", shuffle " +
         (sampler_.shuffle() ? "true" : "false");
}

int64_t SampledDataSource::num_batches() const { return indices_.numel() / micro_batch_; }

torch::data::Example<> SampledDataSource::batch(int64_t index) {
  return detail::micro_batch_of(data_, targets_, indices_, micro_batch_, index,
                                "SampledDataSource");
}

torch::Tensor SampledDataSource::sample_indices(int64_t index) {
  return detail::micro_batch_rows(indices_, micro_batch_, index, "SampledDataSource");
}

}  // namespace cohort
