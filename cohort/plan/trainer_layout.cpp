#include "cohort/plan/trainer_layout.h"

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"
#include "cohort/observability/trace.h"

namespace cohort {

void ReplicaLayout::check(const LossFn& loss_fn, int64_t, int) const {
  if (!loss_fn) throw InvalidArgument("Trainer: no LossFn (only a pipeline brings its own)");
}

double ReplicaLayout::step(const std::vector<torch::data::Example<>>& micro_batches,
                           const LossFn& loss_fn, Tracer* tracer, double weight) {
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
    torch::Tensor scaled = per_leaf_ ? loss : loss / static_cast<double>(k);
    // A rank whose batch is larger or smaller than its peers' (the
    // Trainer's weight); left out at 1, which would change no bit.
    if (weight != 1.0) scaled = scaled * weight;
    if (non_finite_seeds_nan_) {
      // 1 where the loss is finite (1 + 0·x is 1, the same bits as backward()), NaN where it is
      // NaN or Inf (0·Inf is NaN): the gradients carry it to every rank's global norm, also
      // where they would stay finite. No read of the loss: a GPU does not wait here.
      scaled.backward(torch::ones_like(scaled) + scaled.detach() * 0);
    } else {
      scaled.backward();
    }
    loss_sum += loss.item<double>();
  }
  return loss_sum / static_cast<double>(k);
}

void ReplicaLayout::set_tensor_parallel(std::shared_ptr<GradNorm> norm,
                                        std::shared_ptr<Communicator> tp_group) {
  norm_ = std::move(norm);
  tp_group_ = std::move(tp_group);
}

std::vector<std::shared_ptr<Communicator>> ReplicaLayout::same_samples_groups() const {
  if (!tp_group_) return {};
  return {tp_group_};
}

// A column-parallel layer reads its whole input on each TP rank.
std::vector<std::shared_ptr<Communicator>> ReplicaLayout::same_inputs_groups() const {
  return same_samples_groups();
}

bool ReplicaLayout::reports() const { return !tp_group_ || tp_group_->rank() == 0; }

std::string ReplicaLayout::cannot_checkpoint() const {
  if (!tp_group_) return "";
  return "the model holds tensor-parallel layers and each TP rank's Trainer runs over its "
         "data-parallel group alone, so every TP rank would write its slices under the whole "
         "tensors' names into one checkpoint; train it with TrainerWiring::mesh (a runtime of "
         "one stage when there is no pipeline), whose checkpoints hold each TP rank's slice";
}

}  // namespace cohort
