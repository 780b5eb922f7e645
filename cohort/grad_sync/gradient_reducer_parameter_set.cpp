// GradientReducer: the parameters it reduces follow requires_grad.
//
// DDP reduces the parameters that require grad. PyTorch's DDP keeps the set
// of its construction, so a parameter frozen then and unfrozen later trains
// on each rank's own gradient, with no error, and the replicas drift apart;
// one frozen later is refused as unused. Here a forward with grad mode on
// (outside a backward) compares the flags with the set, one pass and no
// collective while nothing changed; a rank that sees a change agrees on it
// with the others (one all-gather) and the buckets are rebuilt for the new
// set as a DDP built now would have them: reverse registration order until
// the next synchronizing backward's ready order rebuilds them once. A rank
// that changed while another did not meets that rank's next collective
// (a bucket's all-reduce) with its all-gather: the signature check makes it
// a MismatchError on both, instead of buckets of two layouts averaged.
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/grad_sync/accumulator_hooks.h"
#include "cohort/grad_sync/gradient_reducer.h"
#include "cohort/grad_sync/leaf_buckets.h"

namespace cohort {
namespace {

std::string quoted(const std::vector<std::string>& names) {
  std::string out;
  for (size_t k = 0; k < names.size(); ++k) out += (k ? ", '" : "'") + names[k] + "'";
  return out;
}

}  // namespace

void GradientReducer::follow_requires_grad() {
  // With leaves a parameter frozen since stays reduced: each leaf gives it
  // zeros and the step leaves it without .grad, as any parameter without a
  // gradient. So there it only needs its hook back once unfrozen again.
  bool changed = false, unhooked = false;
  size_t j = 0;  // index into params_ of the reduced ones
  for (size_t i = 0; i < all_params_.size(); ++i) {
    const bool wants = all_params_[i].requires_grad();
    if (!reduced_[i]) {
      changed = changed || wants;
      continue;
    }
    changed = changed || (!wants && !leaf_);
    unhooked = unhooked || (wants && !hooks_->accumulator(j));
    ++j;
  }
  if (!changed) {
    if (unhooked) hooks_->hook_unhooked();
    return;
  }
  std::vector<char> next(all_params_.size());
  std::vector<std::string> taken, dropped;
  for (size_t i = 0; i < all_params_.size(); ++i) {
    next[i] = all_params_[i].requires_grad() || (leaf_ && reduced_[i]) ? 1 : 0;
    if (next[i] && !reduced_[i]) taken.push_back(all_names_[i]);
    if (!next[i] && reduced_[i]) dropped.push_back(all_names_[i]);
  }
  std::string change;
  if (!taken.empty()) change = "requires grad now: " + quoted(taken);
  if (!dropped.empty()) {
    change += (change.empty() ? "" : "; ") + std::string("no longer: ") + quoted(dropped);
  }
  const std::string refusal = parameter_set_refusal(next);
  const std::string who = "DistributedDataParallel on rank " + std::to_string(comm_->rank()) +
                          " of " + std::to_string(comm_->size()) + ": ";
  if (comm_->size() > 1) {
    try {
      agree_text(*comm_, refusal.empty() ? change : change + "; refused: " + refusal, who,
                 "the parameters whose requires_grad changed since the last forward");
    } catch (const MismatchError& e) {
      throw MismatchError(who + "the parameters' requires_grad changed here (" + change +
                          ") but not on every rank at this forward; every rank must freeze and "
                          "unfreeze the same parameters before the same forward: " +
                          e.what());
    }
  }
  if (!refusal.empty()) {
    throw InvalidArgument(who + "a parameter's requires_grad changed (" + change + "), but " +
                          refusal);
  }
  adopt_parameter_set(std::move(next));
}

std::string GradientReducer::parameter_set_refusal(const std::vector<char>& next) const {
  // The same words on every rank with the same reason (no rank, no device
  // index): the ranks agree on them.
  if (leaf_ && owner_) {
    return "with determinism WorldSizeInvariant the reduction owner (ZeRO-2) takes the leaf "
           "chunk laid out over DDP's parameters of its construction: unfreeze before building "
           "DDP and the optimizer";
  }
  if (leaf_ && leaf_->pushed() > 0) {
    return "with determinism WorldSizeInvariant the parameters may change only between steps, "
           "not between the leaves of one";
  }
  const torch::Tensor* first = nullptr;
  size_t f = 0;
  for (size_t i = 0; i < all_params_.size(); ++i) {
    if (!next[i]) continue;
    const auto& p = all_params_[i];
    if (!first) {
      first = &p;
      f = i;
    }
    // A bucket is one flat tensor: its parameters share one device.
    if (p.device() != first->device()) {
      return "'" + all_names_[i] + "' and '" + all_names_[f] +
             "' are on different devices; the parameters DDP reduces must share one";
    }
    if (options_.compression.kind != compression::CompressionKind::None && !p.device().is_cpu()) {
      return "gradient compression takes CPU parameters, and '" + all_names_[i] + "' is not one";
    }
    if (leaf_ && (!p.is_floating_point() || p.scalar_type() != first->scalar_type())) {
      return "determinism WorldSizeInvariant needs parameters of one floating dtype; '" +
             all_names_[i] + "' is " + std::string(c10::toString(p.scalar_type()));
    }
  }
  return "";
}

void GradientReducer::adopt_parameter_set(std::vector<char> next) {
  // The buckets and the no_sync() accumulation's use, by parameter (index
  // into all_params_), to carry over what stays.
  std::vector<std::vector<size_t>> before;
  for (const auto& b : buckets_) {
    before.emplace_back();
    for (size_t i : b.params) before.back().push_back(all_index_[i]);
  }
  std::vector<char> used(all_params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) used[all_index_[i]] = locally_used_[i];

  reduced_ = std::move(next);
  split_parameters();
  hooks_.reset();  // the old hooks go first: a parameter that stays gets one
  hooks_ = std::make_unique<AccumulatorHooks>(
      params_, [this](size_t i, bool has) { on_gradient_ready(i, has); });
  // As a DDP built now: reverse registration order, then one rebuild in
  // the order of the next synchronizing backward. Gradients accumulated so
  // far (no_sync()) move into the new buckets.
  std::vector<size_t> order(params_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = order.size() - 1 - k;
  build_buckets(order);
  ready_.assign(params_.size(), 0);
  locally_used_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) locally_used_[i] = used[all_index_[i]];
  unused_.clear();
  ready_order_.clear();
  order_recorded_ = false;
  rebuilt_ = false;
  stats_.buckets_rebuilt = false;
  if (leaf_) {
    leaf_buckets_.reset();  // made again at the next fold, in the new layout
    if (leaf_worker_) leaf_gathers_.assign(buckets_.size(), Work());
  }
  // A stateful comm hook starts afresh the buckets whose parameters changed.
  std::vector<size_t> index(all_params_.size(), SIZE_MAX);  // dropped: matches none
  for (size_t i = 0; i < params_.size(); ++i) index[all_index_[i]] = i;
  for (auto& b : before) {
    for (auto& i : b) i = index[i];
  }
  tell_hook_changed(before);
  if (owner_) owner_->parameters_changed();
}

}  // namespace cohort
