#include "cohort/train/trainer_layout.h"

#include "cohort/core/error.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/observability/trace.h"

namespace cohort {

void ReplicaLayout::check(const LossFn& loss_fn, int64_t, int) const {
  if (!loss_fn) throw InvalidArgument("Trainer: no LossFn (only a pipeline brings its own)");
}

double ReplicaLayout::step(const std::vector<torch::data::Example<>>& micro_batches,
                           const LossFn& loss_fn, Tracer* tracer) {
  const size_t k = micro_batches.size();
  double loss_sum = 0.0;
  for (size_t i = 0; i < k; ++i) {
    // Per leaf, every backward reaches the reducer, which sums the leaves
    // in its canonical tree and divides by the leaf count.
    std::shared_ptr<void> no_sync = i + 1 == k || per_leaf_ ? nullptr : sync_.skip_sync();
    torch::Tensor loss;
    {
      TraceSpan span(tracer, "forward", "train");
      loss = loss_fn(micro_batches[i]);
    }
    // Dividing by k makes the accumulated gradient that of the mean loss
    // over the k micro-batches (equal sizes), as one k-times batch would.
    TraceSpan span(tracer, "backward", "train");
    (per_leaf_ ? loss : loss / static_cast<double>(k)).backward();
    loss_sum += loss.item<double>();
  }
  return loss_sum / static_cast<double>(k);
}

FSDPLayout::FSDPLayout(GradientSync& sync, FullyShardImpl& root)
    : ReplicaLayout(sync),
      root_(root),
      norm_(std::make_shared<ShardedGradNorm>(root.process_group())) {}

void FSDPLayout::before_checkpoint() { root_.reshard(); }

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
                            Tracer*) {
  // The runtime splits the batch back into the same k micro-batches and
  // backpropagates each loss / k, as ReplicaLayout does.
  std::vector<torch::Tensor> data, targets;
  for (const auto& b : micro_batches) {
    data.push_back(b.data);
    targets.push_back(b.target);
  }
  const auto result = runtime_.step({torch::cat(data)}, {torch::cat(targets)});
  for (const auto& [type, ms] : result.action_ms) {
    if (!pipeline::is_compute(type)) comm_seconds_ += ms * 1e-3;
  }
  return result.loss;
}

}  // namespace cohort
