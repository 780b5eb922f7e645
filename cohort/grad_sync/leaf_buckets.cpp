// LeafBuckets: the fold of each gradient into the partial sums, and the
// per-bucket exchange that completes the canonical tree.
#include "cohort/grad_sync/leaf_buckets.h"

#include "cohort/core/error.h"
#include "cohort/grad_sync/flat_views.h"

namespace cohort {

LeafBuckets::LeafBuckets(std::vector<torch::Tensor> params,
                         const std::vector<std::vector<size_t>>& buckets, const LeafReduction& leaf,
                         int world)
    : params_(std::move(params)),
      buckets_(buckets),
      leaf_(leaf),
      world_(world),
      element_size_(params_.empty() ? 0 : params_.front().element_size()) {
  offset_.assign(params_.size(), -1);
  int64_t rows = 0;
  for (const auto& members : buckets) {
    int64_t numel = 0;
    start_.push_back(padded_);
    for (size_t i : members) {
      offset_[i] = padded_ + numel;
      numel += params_[i].numel();
    }
    chunk_.push_back((numel + world - 1) / world);
    row_.push_back(rows);
    rows += chunk_.back();
    padded_ += world * chunk_.back();
  }
  for (size_t i = 0; i < offset_.size(); ++i) {
    COHORT_CHECK(offset_[i] >= 0, "a parameter is in no bucket");
  }
}

void LeafBuckets::allocate() {
  const auto options = params_.front().options().requires_grad(false);
  const int64_t m = leaf_.max_frontier();
  torch::NoGradGuard no_grad;
  // Zeros: the padding is sent and summed, and must be the same everywhere.
  for (int64_t s = 0; s < leaf_.slots(); ++s) {
    slots_.push_back(torch::zeros({padded_}, options));
    views_.push_back(flat_views(slots_.back(), params_, offset_));
    held_.emplace_back(params_.size());
  }
  if (world_ > 1) {
    if (m > 1 || leaf_.frontier_size() < m) send_ = torch::zeros({m * padded_}, options);
    received_ = torch::empty({m * padded_}, options);
    rows_ = torch::empty({row_.back() + chunk_.back()}, options);
  }
  mean_ = torch::zeros({padded_}, options);
  mean_aliases_ = flat_aliases(mean_, params_, offset_);
}

torch::Tensor LeafBuckets::segment(const torch::Tensor& flat, size_t b) const {
  return flat.narrow(0, start_[b], world_ * chunk_[b]);
}

torch::Tensor LeafBuckets::exchanged(const torch::Tensor& flat, size_t b) const {
  const int64_t m = leaf_.max_frontier();
  return flat.narrow(0, m * start_[b], m * world_ * chunk_[b]).view({world_, m, chunk_[b]});
}

void LeafBuckets::fold(size_t i, int64_t k, const torch::Tensor& grad) {
  if (slots_.empty()) allocate();
  torch::NoGradGuard no_grad;
  const auto& f = leaf_.fold(k);
  auto right = grad.defined() ? grad : torch::zeros_like(views_[0][i]);
  if (f.merges == 0) {
    // Held as computed; copied into its slot only if nothing is added to it
    // and it is sent (materialize()): a left child's first use writes the
    // sum instead, and world 1 divides the mean straight out of it.
    held_[static_cast<size_t>(f.slot)][i] = right;
    return;
  }
  // left + right, the canonical operand order, written into the left slot.
  for (auto s = static_cast<size_t>(f.slot + f.merges); s-- > static_cast<size_t>(f.slot);) {
    auto& left = held_[s][i];
    auto out = views_[s][i];
    at::add_out(out, left.defined() ? left : out, right);
    left = torch::Tensor();
    right = out;
  }
}

void LeafBuckets::materialize(size_t b) {
  for (size_t i : buckets_[b]) {
    for (int64_t k = 0; k < leaf_.frontier_size(); ++k) {
      auto& held = held_[static_cast<size_t>(k)][i];
      if (!held.defined()) continue;
      views_[static_cast<size_t>(k)][i].copy_(held);
      held = torch::Tensor();
    }
  }
}

Work LeafBuckets::exchange(Communicator& comm, size_t b) {
  torch::NoGradGuard no_grad;
  if (world_ == 1) {
    // The whole tree is this rank's one subtree: the mean is divided
    // straight out of where its sum is (a gradient held as computed, or
    // slot 0), with no copy into the slot first. The divisor is the same
    // float as LeafReduction's div(leaves) (the determinism tests compare
    // world 1 with the others bit for bit).
    COHORT_CHECK(leaf_.frontier_size() == 1, "world 1 holds more than one subtree");
    const auto leaves = torch::scalar_tensor(static_cast<double>(leaf_.leaves()), torch::kDouble);
    for (size_t i : buckets_[b]) {
      auto& held = held_[0][i];
      at::div_out(mean_aliases_[i], held.defined() ? held : views_[0][i], leaves);
      held = torch::Tensor();
    }
    return Work();
  }
  materialize(b);
  auto received = exchanged(received_, b);
  if (!send_.defined()) {
    // One subtree sum per rank: its padded bucket is already [world, 1, chunk].
    auto send = segment(slots_[0], b).view({world_, 1, chunk_[b]});
    return comm.all_to_all_single(received, send);
  }
  auto send = exchanged(send_, b);
  for (int64_t k = 0; k < leaf_.frontier_size(); ++k) {
    send.select(1, k).copy_(segment(slots_[static_cast<size_t>(k)], b).view({world_, chunk_[b]}));
  }
  return comm.all_to_all_single(received, send);
}

Work LeafBuckets::gather(Communicator& comm, size_t b) {
  auto row = rows_.narrow(0, row_[b], chunk_[b]);
  leaf_.complete_into(exchanged(received_, b), row);
  auto mean = segment(mean_, b);
  return comm.all_gather_into_tensor(mean, row);
}

}  // namespace cohort
