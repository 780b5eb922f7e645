// FSDPState: the order units are called in, which the forward's prefetch,
// the backward's prefetch and the reduce-scatters follow, as FSDP2 follows
// the order of its forward. Pre-order is the order of registration, not of
// calls: a model that registers its blocks first to last and calls them in
// another order (last to first, or an encoder's blocks after a decoder's
// in the module tree) would otherwise prefetch in forward units that
// already ran (gathering each twice and keeping them), prefetch in
// backward the unit that comes last, and hold every finished unit's full
// gradients until the unit registered last, whose backward comes last, let
// the queue go. Every rank runs the same forward (the schedule check sees
// each first call's gather and each reduce-scatter), so every rank derives
// the same order.
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <vector>

#include "cohort/fsdp/fsdp_state.h"

namespace cohort::fsdp {

void FSDPState::begin_call_order() {
  const size_t k = units_.size();
  if (forward_next_.size() != k) {
    // Before any forward: the order of registration.
    forward_next_.resize(k);
    for (size_t u = 0; u < k; ++u) forward_next_[u] = u + 1;
  }
  if (!forward_order_.empty()) {
    forward_next_.assign(k, k);
    for (size_t i = 0; i + 1 < forward_order_.size(); ++i) {
      forward_next_[forward_order_[i]] = forward_order_[i + 1];
    }
  }
  forward_order_.clear();
  in_forward_order_.assign(k, 0);
}

void FSDPState::record_call(size_t u) {
  if (in_forward_order_.size() != units_.size()) begin_call_order();
  if (!in_forward_order_[u]) {
    in_forward_order_[u] = 1;
    forward_order_.push_back(u);
  }
  // A forward no backward follows (an evaluation) says nothing of the next
  // backward's order.
  if (!torch::GradMode::is_enabled()) return;
  if (call_order_backward_ != backward_id_ || in_call_order_.size() != units_.size()) {
    // The first forward with gradients since the last backward began.
    call_order_backward_ = backward_id_;
    call_order_.clear();
    in_call_order_.assign(units_.size(), 0);
  }
  if (!in_call_order_[u]) {
    in_call_order_[u] = 1;
    call_order_.push_back(u);
  }
}

size_t FSDPState::forward_prefetch(size_t u) const {
  const size_t next = forward_next_[u];
  if (next >= units_.size() || in_forward_order_[next]) return units_.size();
  return next;
}

void FSDPState::order_backward() {
  const size_t k = units_.size();
  // Launched in the reverse of the first calls (a unit called twice is over
  // at its first call's backward; the root, called first, goes last), then
  // the units not called, which wait for the end of backward (no gradient
  // of theirs comes) and so must not hold back the others.
  std::vector<size_t> order(call_order_.rbegin(), call_order_.rend());
  std::vector<char> listed(k, 0);
  for (size_t u : order) listed[u] = 1;
  for (size_t u = k; u-- > 0;) {
    if (!listed[u]) order.push_back(u);
  }
  // The root's hook runs first: its prefetch is the first unit after it.
  backward_order_.clear();
  if (root_ == 0) backward_order_.push_back(0);
  for (size_t u : order) {
    if (!(root_ == 0 && u == 0)) backward_order_.push_back(u);
  }
  backward_next_.assign(k, k);
  for (size_t i = 0; i + 1 < k; ++i) backward_next_[backward_order_[i]] = backward_order_[i + 1];
  if (order != queue_order_) {
    queue_order_ = std::move(order);
    queue_.set_layout(queue_order_, bucket_parts_, bucket_bytes_);
  }
}

}  // namespace cohort::fsdp
