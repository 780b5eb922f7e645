#include "cohort/fsdp/fsdp_adapters.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "cohort/core/error.h"

namespace cohort {

FSDPGradientSync::FSDPGradientSync(FullyShard model) : model_(std::move(model)) {
  if (model_.is_empty()) throw InvalidArgument("FSDPGradientSync: no model");
  start_seconds_ = seconds_now();
}

std::shared_ptr<void> FSDPGradientSync::skip_sync() {
  // Each unit's own flag as it is now: a unit the user set to false
  // (set_requires_gradient_sync on that unit) stays so after the micro-batch.
  std::vector<std::pair<FullyShardImpl*, bool>> flags;
  for (const auto& m : model_->modules()) {
    if (auto* unit = dynamic_cast<FullyShardImpl*>(m.get()))
      flags.emplace_back(unit, unit->requires_gradient_sync());
  }
  model_->set_requires_gradient_sync(false);
  // The model holds its units; the deleter holds the model.
  std::shared_ptr<FullyShardImpl> model = model_.ptr();
  return std::shared_ptr<void>(model.get(), [model, flags](void*) {
    for (const auto& [unit, sync] : flags)
      unit->set_requires_gradient_sync(sync, /*recurse=*/false);
  });
}

void FSDPGradientSync::finish_sync() {
  // Every step: the names (a map of strings) only when a unit refuses.
  const auto modules = model_->modules();
  const bool all_sync = std::all_of(modules.begin(), modules.end(), [](const auto& m) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.get());
    return unit == nullptr || unit->requires_gradient_sync();
  });
  if (all_sync) return;
  for (const auto& item : model_->named_modules("model")) {
    auto* unit = dynamic_cast<FullyShardImpl*>(item.value().get());
    if (unit == nullptr || unit->requires_gradient_sync()) continue;
    throw InvalidArgument(
        "Trainer over FSDP: unit " + item.key() +
        " has set_requires_gradient_sync(false), so its last backward kept full local "
        "gradients that no step can take; the Trainer syncs every unit at each step's last "
        "micro-batch: set it back to true before train_step");
  }
}

double FSDPGradientSync::seconds_now() const {
  const auto stats = model_->process_group()->stats();
  return stats[OpKind::AllGatherIntoTensor].seconds_in_flight +
         stats[OpKind::ReduceScatterTensor].seconds_in_flight +
         stats[OpKind::BroadcastCoalesced].seconds_in_flight;
}

double FSDPGradientSync::comm_seconds() const { return seconds_now() - start_seconds_; }

FSDPLayout::FSDPLayout(GradientSync& sync, FullyShardImpl& root)
    : ReplicaLayout(sync, std::make_shared<ShardedGradNorm>(root.process_group())), root_(root) {}

void FSDPLayout::before_checkpoint() { root_.reshard(); }

}  // namespace cohort
