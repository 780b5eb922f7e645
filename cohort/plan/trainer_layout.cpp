#include "cohort/plan/trainer_layout.h"

#include "cohort/core/error.h"
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

}  // namespace cohort
