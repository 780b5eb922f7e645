#include "cohort/train/tensor_data_source.h"

#include <torch/data/samplers/distributed.h>

#include <string>
#include <vector>

#include "cohort/core/error.h"

namespace cohort {

TensorDataSource::TensorDataSource(torch::Tensor data, torch::Tensor targets, int64_t micro_batch,
                                   int rank, int world_size, bool shuffle)
    : data_(std::move(data)),
      targets_(std::move(targets)),
      micro_batch_(micro_batch),
      rank_(rank),
      world_size_(world_size),
      shuffle_(shuffle) {
  if (world_size_ < 1 || rank_ < 0 || rank_ >= world_size_) {
    throw InvalidArgument("TensorDataSource: rank " + std::to_string(rank_) +
                          " is out of range for world size " + std::to_string(world_size_));
  }
  detail::check_samples(data_, targets_, micro_batch_, "TensorDataSource");
  set_epoch(0);
}

void TensorDataSource::set_epoch(int64_t epoch) {
  const int64_t n = data_.size(0);
  torch::Tensor order = torch::arange(n, torch::kInt64);
  if (shuffle_) {
    // The sampler of a one-rank world hands out its whole permutation, the
    // one every rank of a bigger world would slice.
    torch::data::samplers::DistributedRandomSampler sampler(static_cast<size_t>(n), 1, 0);
    sampler.set_epoch(static_cast<size_t>(epoch));
    sampler.reset({});
    auto picked = sampler.next(static_cast<size_t>(n));
    std::vector<int64_t> idx;
    if (picked) idx.assign(picked->begin(), picked->end());
    order = torch::tensor(idx, torch::kInt64);
  }
  // [micro-batches, world, micro_batch]: this rank's column, in order.
  const int64_t g = global_micro_batch();
  const int64_t batches = n / g;
  indices_ = order.narrow(0, 0, batches * g)
                 .view({batches, world_size_, micro_batch_})
                 .select(1, rank_)
                 .reshape({-1})
                 .contiguous();
}

std::string TensorDataSource::order_settings() const {
  return std::string("TensorDataSource, shuffle ") + (shuffle_ ? "true" : "false");
}

int64_t TensorDataSource::num_batches() const { return indices_.numel() / micro_batch_; }

torch::data::Example<> TensorDataSource::batch(int64_t index) {
  return detail::micro_batch_of(data_, targets_, indices_, micro_batch_, index, "TensorDataSource");
}

torch::Tensor TensorDataSource::sample_indices(int64_t index) {
  return detail::micro_batch_rows(indices_, micro_batch_, index, "TensorDataSource");
}

namespace detail {

void check_samples(const torch::Tensor& data, const torch::Tensor& targets, int64_t micro_batch,
                   const char* source) {
  if (data.size(0) != targets.size(0)) {
    throw InvalidArgument(std::string(source) + ": " + std::to_string(data.size(0)) +
                          " samples but " + std::to_string(targets.size(0)) + " targets");
  }
  if (micro_batch < 1) {
    throw InvalidArgument(std::string(source) + ": micro-batch size must be positive, got " +
                          std::to_string(micro_batch));
  }
}

torch::Tensor micro_batch_rows(const torch::Tensor& indices, int64_t micro_batch, int64_t index,
                               const char* source) {
  const int64_t batches = indices.numel() / micro_batch;
  if (index < 0 || index >= batches) {
    throw InvalidArgument(std::string(source) + ": batch " + std::to_string(index) + " of " +
                          std::to_string(batches));
  }
  return indices.narrow(0, index * micro_batch, micro_batch);
}

torch::data::Example<> micro_batch_of(const torch::Tensor& data, const torch::Tensor& targets,
                                      const torch::Tensor& indices, int64_t micro_batch,
                                      int64_t index, const char* source) {
  const auto rows = micro_batch_rows(indices, micro_batch, index, source);
  return {data.index_select(0, rows), targets.index_select(0, rows)};
}

}  // namespace detail

}  // namespace cohort
