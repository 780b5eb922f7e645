// FSDPState, Determinism::WorldSizeInvariant: one forward and backward per
// leaf; each unit's full gradients of a leaf are pushed, laid out as the
// reduce-scatter input, into the unit's LeafReduction (local subtree sums
// in the canonical tree, no communication), and after the rank's last leaf
// each unit's tree is completed across the ranks straight into its flat
// shard. Buffers as DDP with leaves: every leaf's forward sees the step's
// starting buffers and the step keeps global leaf 0's. Design:
// cohort/fsdp/README.md.
#include <torch/torch.h>

#include "cohort/core/error.h"
#include "cohort/fsdp/fsdp_state.h"
#include "cohort/grad_sync/canonical_norm.h"
#include "cohort/grad_sync/gradient_presence.h"

namespace cohort::fsdp {

std::string FSDPState::where() const {
  return " on rank " + std::to_string(world_->rank()) + " of " + std::to_string(world_->size());
}

void FSDPState::setup_leaves(int64_t leaves) {
  if (world_->size() != comm_->size()) {
    throw InvalidArgument("fully_shard: determinism WorldSizeInvariant" + where() +
                          " takes a 1-D mesh (HSDP's replica average would add in another order)");
  }
  // Every rank must split the batch alike, or the exchange mixes leaves.
  auto mine = torch::full({1}, leaves, torch::kLong);
  auto all = torch::empty({world_->size()}, torch::kLong);
  world_->all_gather_into_tensor(all, mine).wait();
  for (int r = 0; r < world_->size(); ++r) {
    if (all[r].item<int64_t>() != leaves) {
      throw MismatchError("fully_shard: leaves = " + std::to_string(leaves) + where() +
                          " but rank " + std::to_string(r) + " has " +
                          std::to_string(all[r].item<int64_t>()));
    }
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    leaf_.push_back(std::make_unique<LeafReduction>(leaves, comm_->rank(), comm_->size(),
                                                    "fully_shard(" + units_[u].name + ")"));
  }
  leaf_pushed_.assign(units_.size(), 0);
}

void FSDPState::keep_buffers(std::vector<torch::Tensor>& into) const {
  into.clear();
  for (const auto& b : buffers_) into.push_back(b.detach().clone());
}

void FSDPState::restore_buffers(const std::vector<torch::Tensor>& from) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < from.size(); ++i) buffers_[i].detach().copy_(from[i]);
}

void FSDPState::begin_leaf_forward() {
  if (leaf_done_ == 0) {
    // The step starts from rank 0's buffers (the same on every rank after
    // the last step's broadcast; this covers the first step too).
    if (world_->size() > 1 && !buffers_.empty()) {
      check_.before(ScheduleStep::kBuffers, kNoUnit);
      torch::NoGradGuard no_grad;
      world_->broadcast_coalesced(buffers_, {0}).wait();
    }
    keep_buffers(step_buffers_);
    first_leaf_buffers_.clear();
    return;
  }
  // Each leaf's forward sees the step's starting buffers; what the step
  // keeps is the first leaf's update (rank 0's is global leaf 0's).
  if (leaf_done_ == 1) keep_buffers(first_leaf_buffers_);
  restore_buffers(step_buffers_);
}

void FSDPState::leaf_gradients_ready(size_t u) {
  // As the reduce-scatter path: the unit's parameters go first, then its
  // full gradients (into the leaf sums), then the next unit is prefetched.
  units_[u].group->reshard();
  units_[u].group->push_leaf_gradient(*leaf_[u], leaf_done_ == 0);
  leaf_pushed_[u] = 1;
  if (backward_started_[u]) prefetch_after(u);
}

void FSDPState::end_leaf_backward() {
  // Units with no gradient in this leaf push zeros (the same on every rank).
  for (size_t u = units_.size(); u-- > 0;) {
    if (leaf_pushed_[u]) continue;
    units_[u].group->reshard();
    units_[u].group->push_leaf_gradient(*leaf_[u], leaf_done_ == 0);
  }
  leaf_pushed_.assign(units_.size(), 0);
  if (++leaf_done_ < local_leaves()) {
    reshard_all();
    return;
  }
  leaf_done_ = 0;
  const auto had = had_gradients();
  check_.before(ScheduleStep::kGradientPresence, kNoUnit);
  const auto any = any_rank_has(*world_, had);
  // Each unit's tree completed across the ranks (one all_to_all each), from
  // the last unit down as the reduce-scatters go.
  for (size_t u = units_.size(); u-- > 0;) {
    const size_t n = units_[u].group->params().size();
    check_.before(ScheduleStep::kReduceScatter, u);
    units_[u].group->finish_leaf_gradients(
        *leaf_[u],
        std::vector<char>(any.begin() + first_param_[u], any.begin() + first_param_[u] + n));
    units_[u].group->reshard();
  }
  if (!first_leaf_buffers_.empty()) restore_buffers(first_leaf_buffers_);
  first_leaf_buffers_.clear();
  step_buffers_.clear();
  // Rank 0's first leaf is the global batch's leaf 0: its statistics are the
  // step's on every rank and at every world size.
  if (world_->size() > 1 && !buffers_.empty()) {
    check_.before(ScheduleStep::kBuffers, kNoUnit);
    torch::NoGradGuard no_grad;
    world_->broadcast_coalesced(buffers_, {0}).wait();
  }
}

void FSDPState::abandon_leaf_step() noexcept {
  if (leaf_.empty()) return;
  // A leaf's forward or backward threw: the user skips the step, so the
  // leaves it pushed must not count in the next one (they would push past
  // the rank's last leaf, or a failed last leaf's forward would leave the
  // next step's first leaf counted as this one's last), and the buffers go
  // back to how the step found them.
  for (auto& leaf : leaf_) leaf->abandon();
  leaf_pushed_.assign(units_.size(), 0);
  leaf_done_ = 0;
  leaf_forward_open_ = false;
  try {
    if (!step_buffers_.empty()) restore_buffers(step_buffers_);
  } catch (const std::exception&) {
  }
  step_buffers_.clear();
  first_leaf_buffers_.clear();
}

double FSDPState::squared_grad_norm() {
  if (leaf_.empty()) {
    throw Unsupported("fully_shard: clip_grad_norm" + where() +
                      " needs determinism WorldSizeInvariant (otherwise clip the sharded "
                      "parameters with the Trainer's ShardedGradNorm)");
  }
  torch::NoGradGuard no_grad;
  double sum = 0.0;
  for (const auto& unit : units_) {
    const auto& layout = unit.group->layout();
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const auto& p = layout.params[i];
      const auto& param = unit.group->params()[i];
      // Rank r holds rows [r * chunk_rows, ...): a contiguous slice of the
      // parameter's flat index, the ranks' slices in rank order.
      const int64_t offset = std::min(p.rows, layout.rank * p.chunk_rows) * p.row_numel;
      const int64_t len = p.local_rows * p.row_numel;
      auto g = param.grad().defined() ? param.grad().reshape({-1})
                                      : torch::zeros({len}, param.options());
      sum += cohort::canonical_squared_norm(comm_.get(), g, offset, p.rows * p.row_numel);
    }
  }
  return sum;
}

}  // namespace cohort::fsdp
