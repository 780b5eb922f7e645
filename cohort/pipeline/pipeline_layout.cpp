#include "cohort/pipeline/pipeline_layout.h"

#include <string>

#include "cohort/core/error.h"

namespace cohort {

void PipelineLayout::check(const LossFn& loss_fn, int64_t accumulation_steps, int rank) const {
  if (loss_fn) {
    throw InvalidArgument(
        "Trainer: a pipeline computes its loss on its last stage; construct the Trainer "
        "without a LossFn");
  }
  const int m = runtime_.schedule().num_microbatches;
  if (accumulation_steps != m) {
    throw InvalidArgument("Trainer on rank " + std::to_string(rank) + ": accumulation_steps " +
                          std::to_string(accumulation_steps) +
                          " differs from the pipeline schedule's " + std::to_string(m) +
                          " micro-batches");
  }
}

double PipelineLayout::step(const std::vector<torch::data::Example<>>& micro_batches, const LossFn&,
                            Tracer*, double weight) {
  // The runtime splits the batch back into the same k micro-batches and
  // backpropagates each loss / k times the weight, as ReplicaLayout does.
  std::vector<torch::Tensor> data, targets;
  for (const auto& b : micro_batches) {
    data.push_back(b.data);
    targets.push_back(b.target);
  }
  const auto result = runtime_.step({torch::cat(data)}, {torch::cat(targets)}, weight);
  for (const auto& [type, ms] : result.action_ms) {
    if (!pipeline::is_compute(type)) comm_seconds_ += ms * 1e-3;
  }
  return result.loss;
}

std::vector<std::shared_ptr<Communicator>> PipelineLayout::same_samples_groups() const {
  std::vector<std::shared_ptr<Communicator>> out{runtime_.process_group()};
  for (const auto& [name, groups] : dimensions_) {
    if (name == "tp") out.insert(out.end(), groups.begin(), groups.end());
  }
  out.insert(out.end(), sequence_groups_.begin(), sequence_groups_.end());
  return out;
}

std::vector<std::shared_ptr<Communicator>> PipelineLayout::same_inputs_groups() const {
  std::vector<std::shared_ptr<Communicator>> out;
  for (const auto& [name, groups] : dimensions_) {
    if (name == "tp") out.insert(out.end(), groups.begin(), groups.end());
  }
  return out;
}

}  // namespace cohort
