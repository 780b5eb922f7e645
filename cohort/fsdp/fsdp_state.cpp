#include "cohort/fsdp/fsdp_state.h"

#include <torch/csrc/autograd/engine.h>

#include <utility>

#include "cohort/core/error.h"
#include "cohort/grad_sync/gradient_presence.h"

namespace cohort::fsdp {

FSDPState::FSDPState(std::vector<UnitEntry> units, bool root_has_params,
                     std::vector<torch::Tensor> buffers, std::shared_ptr<Communicator> comm)
    : units_(std::move(units)),
      buffers_(std::move(buffers)),
      comm_(std::move(comm)),
      root_(root_has_params ? 0 : kRoot),
      queue_(comm_->tracer(), "fsdp", "fsdp.reduce_scatter") {
  const size_t k = units_.size();
  if (root_ == 0) backward_order_.push_back(0);
  for (size_t u = k; u-- > (root_ == 0 ? 1 : 0);) backward_order_.push_back(u);
  backward_next_.assign(k, k);
  for (size_t i = 0; i + 1 < k; ++i) backward_next_[backward_order_[i]] = backward_order_[i + 1];

  // Gradients are reduce-scattered from the last unit down to the root.
  std::vector<size_t> order;
  std::vector<int64_t> parts(k, 0), bytes(k, 0);
  for (size_t u = k; u-- > 0;) order.push_back(u);
  std::vector<torch::Tensor> all;
  for (size_t u = 0; u < k; ++u) {
    first_param_.push_back(all.size());
    const auto* g = units_[u].group;
    for (const auto& p : g->params()) {
      all.push_back(p);
      unit_of_.push_back(u);
      if (p.requires_grad()) ++parts[u];
    }
    parts_.push_back(static_cast<size_t>(parts[u]));
    bytes[u] = g->layout().world * g->layout().shard_numel * c10::elementSize(g->reduce_dtype());
  }
  queue_.set_layout(std::move(order), std::move(parts), std::move(bytes));
  hooks_ = std::make_unique<AccumulatorHooks>(all, [this](size_t i) { gradient_ready(i); });
}

size_t FSDPState::next_in_backward(size_t u) const {
  if (u == kRoot) return backward_order_.empty() ? units_.size() : backward_order_[0];
  return backward_next_[u];
}

void FSDPState::pre_forward(size_t u, bool training) {
  if (u == root_ && training && comm_->size() > 1 && !buffers_.empty() &&
      torch::GradMode::is_enabled()) {
    torch::NoGradGuard no_grad;
    comm_->broadcast_coalesced(buffers_, {0}).wait();
  }
  if (u == kRoot) return;
  units_[u].group->wait_unshard();
  if (u + 1 < units_.size()) units_[u + 1].group->start_unshard();
}

void FSDPState::post_forward(size_t u, const torch::Tensor& output) {
  // The root's parameters are needed again as soon as backward starts; a
  // forward inside backward (a checkpointed unit recomputing) keeps them.
  if (u != root_ && !in_backward_ && *units_[u].reshard_after_forward) {
    units_[u].group->reshard();
  }
  if (!torch::GradMode::is_enabled() || !output.defined() || !output.requires_grad()) return;
  std::weak_ptr<FSDPState> self = shared_from_this();
  // The hook runs on the output's grad_fn before it; it leaves the gradient
  // unchanged.
  const_cast<torch::Tensor&>(output).register_hook([self, u](const torch::Tensor&) {
    if (auto state = self.lock()) state->pre_backward(u);
  });
}

void FSDPState::pre_backward(size_t u) {
  if (!in_backward_) begin_backward();
  if (u != kRoot) backward_started_[u] = 1;
  // The unit before this one is reduce-scattering: its input (that unit's
  // full gradients) goes before this unit's all-gather output is copied
  // into its full storage and the next unit's all-gather starts, so that
  // a backward holds at most three units (this one's parameters and
  // gradients, the prefetched one). It went on the wire after this unit's
  // all-gather and before the prefetch: when communication is the slower
  // side this wait takes no extra time.
  retire_in_flight();
  if (u != kRoot) units_[u].group->wait_unshard();
  // A unit whose gradients are reduce-scattered prefetches the next one once
  // they have all landed (gradient_ready); the root (its parameters are
  // few, or none) and a backward without sync prefetch now.
  if (!reducing_ || u == root_) prefetch_after(u);
}

void FSDPState::prefetch_after(size_t u) {
  const size_t next = next_in_backward(u);
  // Not a unit whose backward already ran (its gradients landed late: a
  // parameter it shares with a later unit): that would gather it again.
  if (next < units_.size() && !backward_started_[next]) units_[next].group->start_unshard();
}

void FSDPState::begin_backward() {
  in_backward_ = true;
  reducing_ = sync_;
  for (auto& unit : units_) unit.group->stash_gradients();
  queue_.reset();
  queue_.start_clock();
  arrived_.assign(units_.size(), 0);
  backward_started_.assign(units_.size(), 0);
  failures_.clear();
  std::weak_ptr<FSDPState> self = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (auto state = self.lock()) state->end_backward();
  });
}

void FSDPState::gradient_ready(size_t k) {
  if (!in_backward_ || !reducing_) return;
  const size_t u = unit_of_[k];
  queue_.arrive(u);
  launch_ready();
  if (++arrived_[u] != parts_[u]) return;
  // The unit's gradients are all in: its backward needs its parameters no
  // more. They go (launch did it if the queue let the unit go) before the
  // next unit's all-gather output is allocated, so a backward holds the
  // unit computing (parameters and gradients) or the prefetched unit and
  // the reduce-scatter input, two units, never three.
  units_[u].group->reshard();
  prefetch_after(u);
}

void FSDPState::launch_ready() {
  queue_.poll();
  queue_.launch_ready([this](size_t u) { return launch(u); });
  // Each finished reduce-scatter's buffers go now, not at the end of backward.
  size_t u = 0;
  while (queue_.retire_completed(u)) units_[u].group->reduce_scatter_done();
}

Work FSDPState::launch(size_t u) {
  // Its gradients are all in: backward needs its parameters no more, and
  // they go before the reduce-scatter input is made.
  units_[u].group->reshard();
  retire_in_flight();
  auto work = units_[u].group->start_reduce_scatter();
  return work;
}

void FSDPState::retire_in_flight() {
  while (queue_.in_flight() > 0) {
    try {
      const size_t b = queue_.retire_oldest();
      units_[b].group->reduce_scatter_done();
    } catch (const std::exception& e) {
      failures_.emplace_back(e.what());  // thrown at the end of backward
    }
  }
}

void FSDPState::end_backward() {
  in_backward_ = false;
  if (!reducing_) {
    for (auto& unit : units_) {
      unit.group->keep_full_gradients();
      unit.group->reshard();
    }
    return;
  }
  while (!queue_.all_launched()) queue_.launch_next([this](size_t u) { return launch(u); });
  auto failures = std::move(failures_);
  failures_.clear();
  for (auto& f : queue_.drain()) failures.push_back(std::move(f));
  if (!failures.empty()) throw Error(failures.front());
  std::vector<char> had;
  for (const auto& unit : units_) {
    for (size_t i = 0; i < unit.group->params().size(); ++i) {
      had.push_back(unit.group->had_gradient(i) ? 1 : 0);
    }
  }
  const auto any = any_rank_has(*comm_, had);
  for (size_t u = 0; u < units_.size(); ++u) {
    const size_t n = units_[u].group->params().size();
    units_[u].group->finish_gradients(
        std::vector<char>(any.begin() + first_param_[u], any.begin() + first_param_[u] + n));
    units_[u].group->reshard();
  }
}

void FSDPState::unshard_all() {
  for (auto& unit : units_) unit.group->start_unshard();
  for (auto& unit : units_) unit.group->wait_unshard();
}

void FSDPState::reshard_all() {
  for (auto& unit : units_) unit.group->reshard();
}

}  // namespace cohort::fsdp
