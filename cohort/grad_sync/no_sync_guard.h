// defines: ScopedNoSync, the one no-sync depth guard of DDP and ZeRO:
// NoSyncGuard is DistributedDataParallel::no_sync()'s scope,
// ZeroRedundancyOptimizer::NoSync the optimizer's own (stage 2 alone).
// While one lives, backward accumulates gradients locally (no
// communication); the first backward after it reduces the accumulated sum.
#pragma once

#include "cohort/grad_sync/gradient_reducer.h"

namespace cohort {

/// RAII: calls owner.push_no_sync() now and owner.pop_no_sync() when it goes
/// (guards nest: the owner counts the depth). Movable, not copyable.
template <typename Owner>
class ScopedNoSync {
 public:
  /// Enters a no-sync scope of `owner`, which must outlive the guard.
  explicit ScopedNoSync(Owner& owner) : owner_(&owner) { owner_->push_no_sync(); }
  ~ScopedNoSync() {
    if (owner_) owner_->pop_no_sync();
  }
  /// Takes over `other`'s scope; `other` no longer leaves it when destroyed.
  ScopedNoSync(ScopedNoSync&& other) noexcept : owner_(other.owner_) { other.owner_ = nullptr; }
  ScopedNoSync(const ScopedNoSync&) = delete;
  ScopedNoSync& operator=(const ScopedNoSync&) = delete;
  ScopedNoSync& operator=(ScopedNoSync&&) = delete;

 private:
  Owner* owner_;
};

/// The scope of DistributedDataParallel::no_sync().
using NoSyncGuard = ScopedNoSync<GradientReducer>;

}  // namespace cohort
