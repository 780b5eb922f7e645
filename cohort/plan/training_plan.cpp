#include "cohort/plan/training_plan.h"

#include <algorithm>
#include <utility>

#include "cohort/core/error.h"

namespace cohort {

TrainingPlan::TrainingPlan(std::shared_ptr<Communicator> comm,
                           std::shared_ptr<torch::nn::Module> model,
                           std::unique_ptr<TrainerOptimizer> optimizer,
                           std::unique_ptr<GradientSync> sync,
                           std::vector<std::shared_ptr<Communicator>> more_traffic)
    : comm_(std::move(comm)),
      model_(std::move(model)),
      optimizer_(std::move(optimizer)),
      sync_(std::move(sync)),
      layout_(std::make_unique<ReplicaLayout>(*sync_)) {
  if (!comm_) throw InvalidArgument("TrainerWiring: communicator is null");
  if (!model_) throw InvalidArgument("TrainerWiring: model is null");
  traffic_.push_back(comm_);
  for (auto& c : more_traffic) {
    if (std::find(traffic_.begin(), traffic_.end(), c) == traffic_.end()) traffic_.push_back(c);
  }
}

void TrainingPlan::set_leaves(Determinism determinism, int64_t leaves, int64_t local_leaves,
                              std::function<double(double)> canonical_clip) {
  can_be_invariant_ = true;
  if (determinism != Determinism::WorldSizeInvariant) return;
  determinism_ = determinism;
  leaves_ = leaves;
  local_leaves_ = local_leaves;
  canonical_clip_ = std::move(canonical_clip);
  layout_->set_per_leaf();
}

}  // namespace cohort
