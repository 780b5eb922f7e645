// GradientReducer, per-iteration half: forward bookkeeping, the gradient
// ready hook, bucket launches, and the end-of-backward callback.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "cohort/core/error.h"
#include "cohort/grad_sync/accumulator_hooks.h"
#include "cohort/grad_sync/gradient_presence.h"
#include "cohort/grad_sync/gradient_reducer.h"

namespace cohort {
void GradientReducer::start_iteration_clock() {
  queue_.start_clock();
  stats_.bytes = 0;
  sent_at_start_ = comm_->stats().bytes_sent_ever;
}

void GradientReducer::reset_iteration() {
  // locally_used_ is not reset here: it spans a no_sync() accumulation
  // (clear_local_use()).
  std::fill(ready_.begin(), ready_.end(), 0);
  queue_.reset();
  if (!order_recorded_) ready_order_.clear();
  backward_started_ = false;
  backward_finished_ = true;
  unused_.clear();
  unused_grads_.clear();
}

void GradientReducer::clear_local_use() {
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
}

void GradientReducer::prepare_forward() {
  // A forward outside any backward while one is marked running: that
  // backward threw, and the autograd engine runs no final callback then.
  const bool in_backward = in_autograd_engine();
  if (!in_backward) {
    if (backward_started_ && !backward_finished_) {
      backward_failed();
    } else if (forward_awaits_backward_) {
      backward_skipped();
    }
  }
  if (!pending_error_.empty()) {
    std::string message;
    std::swap(message, pending_error_);
    reset_iteration();
    clear_local_use();
    throw Error(message);
  }
  // Only a forward with grad mode on leads to a backward; one inside a
  // backward (a checkpointed module recomputing) must not rebuild it.
  if (torch::GradMode::is_enabled() && !in_backward) follow_requires_grad();
  // LibTorch gives a parameter a new accumulator when Module::load
  // replaces its storage: follow it, or gradients stop being reduced.
  hooks_->refresh();
  if (leaf_) {
    prepare_leaf_forward();
    return;
  }
  // An owner reduces in its own layout: nothing to rebuild (and no
  // collective to spend on it).
  if (order_recorded_ && !rebuilt_) {
    if (owner_) {
      rebuilt_ = true;
    } else {
      rebuild_buckets();
    }
  }
  sync_this_iteration_ = no_sync_depth_ == 0 && options_.strategy != SyncStrategy::NoSync;
  // PyTorch 1.13's rule (will_sync_module_buffers): buffers are broadcast
  // before a forward when the PREVIOUS forward was a synchronizing training
  // forward (grad mode on, gradients to be reduced), and before the very
  // first one. So the evaluation forward right after training and the first
  // micro-batch under no_sync() broadcast; the ones after them do not.
  if (options_.broadcast_buffers && require_forward_param_sync_) broadcast_buffers();
  reset_iteration();
}

void GradientReducer::backward_failed() {
  // Thrown at the same call on every rank, what was launched was launched
  // alike everywhere, and waiting for it ends. Left in flight, a bucket's
  // all-reduce would write the failed step's average into the bucket while
  // the next step fills it. Its failures would only hide the user's
  // exception.
  std::vector<int64_t> launched;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (queue_.launched(b)) launched.push_back(static_cast<int64_t>(b));
  }
  queue_.drain();
  // A stateful hook (error feedback, PowerSGD) folded the failed step's
  // gradients into those buckets' state: it starts them afresh, as after a
  // rebuild, rather than carry them into the next step.
  if (hook_ && !launched.empty()) hook_->buckets_changed(launched);
  if (leaf_) abandon_leaf_step();
  // Part of the failed step's gradients are averaged and part local: none
  // may reach a later step. A reduction owner (ZeRO-2) drops what it staged
  // and waits for what it launched; the gradients it had not staged yet
  // are in .grad.
  if (owner_) owner_->backward_failed();
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  clear_local_use();
  reset_iteration();
  agree_skipped("the last backward threw (its step was dropped)");
}

void GradientReducer::backward_skipped() {
  forward_awaits_backward_ = false;
  if (leaf_) {
    abandon_leaf_step();
    clear_local_use();
  }
  agree_skipped(
      "the last training forward had no backward through DDP (none was run, the forward "
      "threw, or the backward threw before any parameter's gradient)");
}

void GradientReducer::agree_skipped(const std::string& what) {
  // A rank that did not drop the step is waiting for the rest of its
  // buckets, or has gone on to its next step: this rank's next buckets
  // would be averaged with its earlier ones. When every rank dropped it,
  // this is one barrier per dropped step.
  forward_awaits_backward_ = false;
  if (comm_->size() == 1) return;
  try {
    comm_->barrier().wait();
  } catch (const MismatchError& e) {
    throw MismatchError("DistributedDataParallel: on rank " + std::to_string(comm_->rank()) +
                        " of " + std::to_string(comm_->size()) + ", " + what +
                        ", but not on every rank at the same call: " + e.what());
  }
}

void GradientReducer::forward_failed() noexcept {
  const bool grad = torch::GradMode::is_enabled();
  if (!grad || !(leaf_ ? module_->is_training() : sync_this_iteration_)) return;
  // The next forward meets the others in agree_skipped(): a rank whose
  // forward did not throw is in its backward's collectives.
  forward_awaits_backward_ = true;
  if (!leaf_) return;
  // Only a training forward is a leaf of the step (prepare_leaf_forward()).
  queue_.drain();
  abandon_leaf_step();
  clear_local_use();
}

void GradientReducer::after_forward(const std::vector<torch::Tensor>& outputs) {
  forward_awaits_backward_ =
      torch::GradMode::is_enabled() && (leaf_ ? module_->is_training() : sync_this_iteration_);
  // Updated after the module's forward, as PyTorch does: a forward that
  // threw leaves the flag as it was.
  require_forward_param_sync_ = sync_this_iteration_ && torch::GradMode::is_enabled();
  if (leaf_) return;
  if (!sync_this_iteration_ || !options_.find_unused_parameters) return;
  // Walk the autograd graph from the outputs, as PyTorch does; every
  // parameter whose accumulator is not reached takes no part in this
  // iteration and is marked ready when backward starts.
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  bool any_graph = false;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    auto fn = t.grad_fn() ? t.grad_fn() : torch::autograd::impl::try_get_grad_accumulator(t);
    if (!fn) continue;
    any_graph = true;
    if (seen.insert(fn.get()).second) stack.push_back(fn.get());
  }
  // No visible graph (outputs of a type we cannot see into): leave the
  // search to the end of backward.
  if (!any_graph) return;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      auto* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen.count(hooks_->accumulator(i))) unused_.push_back(i);
  }
}

void GradientReducer::on_gradient_ready(size_t index, bool has_gradient) {
  if (torch::GradMode::is_enabled()) refuse_create_graph(index);
  // No gradient came (a checkpointed block that did not use the parameter
  // this step): as a parameter outside the graph, it is unused, which the
  // end of backward settles (find_unused_parameters) or reports as missing.
  // Counting it as used would step a defined zero .grad where one process
  // leaves it undefined.
  if (!has_gradient) return;
  if (leaf_) {
    on_leaf_gradient(index);
    return;
  }
  if (!sync_this_iteration_) {
    // no_sync: .grad accumulates locally. A parameter used in any
    // micro-batch of the accumulation has a gradient to average, even if
    // the synchronizing one leaves it out (as PyTorch >= 2.4).
    locally_used_[index] = 1;
    return;
  }
  if (!backward_started_) {
    backward_started_ = true;
    backward_finished_ = false;
    forward_awaits_backward_ = false;
    start_iteration_clock();
    // Runs once the whole backward pass is done, on the same thread.
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
    for (size_t u : unused_) {
      if (!ready_[u]) mark_ready(u, /*used=*/false);
    }
  }
  if (ready_[index]) {
    throw InvalidArgument("DistributedDataParallel: parameter '" + names_[index] + "' on rank " +
                          std::to_string(comm_->rank()) +
                          " got a gradient twice in one iteration (two backward passes "
                          "over one forward, or marked unused but used); use no_sync() "
                          "for all but the last backward");
  }
  mark_ready(index, /*used=*/true);
  if (owner_) return;  // the owner launched what it could
  if (options_.strategy == SyncStrategy::Overlapped) launch_ready_buckets();
  queue_.poll();  // completion times, for the hidden-communication figure
}

// A backward with create_graph (grad mode is on in its hooks) leaves .grad
// with a graph of this rank's gradient alone: the averaged value written
// back (or the bucket view that replaces .grad) carries none of the other
// ranks' graphs, so a term built from .grad (a penalty on the gradient
// norm) would train on this rank's curvature, or on none. Refused at the
// first hook, before anything is reduced; every rank running the same
// backward refuses there too.
void GradientReducer::refuse_create_graph(size_t index) {
  throw InvalidArgument(
      "DistributedDataParallel: a backward with create_graph (loss.backward(create_graph=true), "
      "e.g. for a penalty on the parameters' gradients) reached parameter '" +
      names_[index] + "' on rank " + std::to_string(comm_->rank()) +
      "; the averaged gradients DDP writes back carry no graph of the other ranks' gradients, "
      "so a term built from .grad would be trained on this rank's alone; nothing was reduced. "
      "Take the gradient penalty with torch::autograd::grad(..., create_graph=true) with "
      "respect to the inputs, then backward() without create_graph");
}

void GradientReducer::mark_ready(size_t index, bool used) {
  ready_[index] = 1;
  if (used) locally_used_[index] = 1;
  if (!order_recorded_) ready_order_.push_back(index);
  if (owner_) {
    owner_->gradient_ready(index);
    return;
  }
  auto& bucket = buckets_[slots_[index].bucket];
  auto& view = bucket.views[slots_[index].position];
  torch::NoGradGuard no_grad;
  auto& grad = params_[index].mutable_grad();
  if (!grad.defined()) {
    view.zero_();
  } else if (options_.gradient_as_bucket_view) {
    // .grad is normally already this view (AccumulateGrad adds in place);
    // after zero_grad(set_to_none) it is a fresh tensor: adopt it.
    if (grad.data_ptr() != view.data_ptr()) {
      view.copy_(grad);
      grad = view;
    }
  } else {
    view.copy_(grad);
  }
  if (!used && !locally_used_[index] && grad.defined() && grad.data_ptr() == view.data_ptr()) {
    unused_grads_[index] = grad.clone();
  }
  if (queue_.arrive(slots_[index].bucket)) {
    if (Tracer* t = active(comm_->tracer())) {
      t->instant("bucket ready", "ddp", std::chrono::steady_clock::now(),
                 {TraceArg::num("bucket", static_cast<double>(slots_[index].bucket)),
                  TraceArg::num("bytes", static_cast<double>(bucket.buffer.numel() *
                                                             bucket.buffer.element_size()))});
    }
  }
}

void GradientReducer::launch_ready_buckets() {
  queue_.launch_ready([this](size_t b) { return launch(b); });
}

Work GradientReducer::launch(size_t b) {
  auto& bucket = buckets_[b];
  GradBucket view{
      static_cast<int64_t>(b), bucket.buffer, b + 1 == buckets_.size(), bucket.views, {}};
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    if (locally_used_[bucket.params[k]]) continue;
    const auto& v = bucket.views[k];
    view.unused.push_back({v.storage_offset() - bucket.buffer.storage_offset(), v.numel()});
  }
  Work work = hook_->run(*comm_, view);
  stats_.bytes += bucket.buffer.numel() * bucket.buffer.element_size();
  return work;
}

void GradientReducer::finish_backward() {
  const double backward_end = queue_.now_s();
  backward_finished_ = true;
  std::vector<size_t> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    if (options_.find_unused_parameters) {
      mark_ready(i, /*used=*/false);  // outputs were not visible at forward
    } else {
      missing.push_back(i);
    }
  }
  if (!missing.empty()) {
    // Do not throw inside the autograd engine: finish what was launched (it
    // was launched alike on every rank) and fail the next forward instead.
    std::ostringstream os;
    os << "DistributedDataParallel: on rank " << comm_->rank() << " of " << comm_->size()
       << ", the previous backward did not produce gradients for " << missing.size()
       << " parameter(s): ";
    for (size_t k = 0; k < missing.size() && k < 10; ++k) {
      os << (k ? ", " : "") << "'" << names_[missing[k]] << "'";
    }
    if (missing.size() > 10) os << ", ...";
    os << ". Gradients were not reduced. Pass find_unused_parameters = true if parameters "
          "may take no part in the loss.";
    pending_error_ = os.str();
    for (const auto& failure : queue_.drain()) pending_error_ += " Also: " + failure;
    return;
  }
  if (!order_recorded_) order_recorded_ = true;
  if (owner_) {
    stats_.iterations += 1;
    stats_.backward_seconds = backward_end;
    clear_local_use();
    owner_->backward_finished();
    return;
  }
  launch_ready_buckets();
  wait_and_write_back(backward_end, options_.find_unused_parameters);
}

void GradientReducer::wait_and_write_back(double backward_end, bool agree,
                                          const std::vector<char>* agreed) {
  TraceSpan span(active(comm_->tracer()), "wait and write back", "ddp");
  while (queue_.in_flight() > 0) queue_.retire_oldest();
  const double waited = queue_.now_s() - backward_end;
  // A parameter unused on this rank but used on another still gets the
  // average; one unused everywhere keeps an undefined .grad, and one frozen
  // since construction is given none (as average_gradients).
  std::vector<char> used(params_.size(), 1);
  if (agreed) {
    used = *agreed;
  } else if (agree) {
    used = any_rank_has(*comm_, locally_used_);
  }
  clear_local_use();

  torch::NoGradGuard no_grad;
  leave_unused_alone(used);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!used[i]) continue;
    auto& view = buckets_[slots_[i].bucket].views[slots_[i].position];
    auto& grad = params_[i].mutable_grad();
    if (grad.defined()) {
      if (grad.data_ptr() != view.data_ptr()) grad.copy_(view);
    } else if (params_[i].requires_grad()) {
      grad = options_.gradient_as_bucket_view ? view : view.clone();
    }
  }

  const double all = queue_.busy_seconds();
  const double hidden = queue_.busy_seconds(backward_end);
  stats_.iterations += 1;
  stats_.backward_seconds = backward_end;
  stats_.comm_seconds = all;
  stats_.hidden_comm_seconds = hidden;
  stats_.exposed_wait_seconds = waited;
  stats_.hidden_comm_share = all > 0 ? hidden / all : 0;
  stats_.total_comm_seconds += all;
  stats_.total_hidden_comm_seconds += hidden;
  // bytes_sent_ever: a reset_stats() during the iteration (a hook's) must not wrap it.
  stats_.bytes_sent = static_cast<int64_t>(comm_->stats().bytes_sent_ever - sent_at_start_);
}

void GradientReducer::leave_unused_alone(const std::vector<char>& used) {
  // As in one process, and as PyTorch's DDP leaves the .grad of a parameter
  // no rank used: the step's result for it is not written. A compressing
  // hook's result there is not zero (the error feedback it sent, int8's
  // rounding), and its error must stay for a later step.
  std::map<size_t, std::vector<compression::ElementRange>> left_out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (used[i]) continue;
    const auto& slot = slots_[i];
    const auto& view = buckets_[slot.bucket].views[slot.position];
    left_out[slot.bucket].push_back(
        {view.storage_offset() - buckets_[slot.bucket].buffer.storage_offset(), view.numel()});
    const auto kept = unused_grads_.find(i);
    if (kept != unused_grads_.end()) params_[i].mutable_grad().copy_(kept->second);
  }
  unused_grads_.clear();
  for (const auto& [b, ranges] : left_out) {
    hook_->left_out(*comm_, static_cast<int64_t>(b), ranges);
  }
}

void GradientReducer::synchronize(const std::exception_ptr& failed) {
  refuse_with_leaves("synchronize");
  follow_requires_grad();
  reset_iteration();
  start_iteration_clock();
  if (owner_) {
    // The owner (ZeRO's shard reducer) exchanges in its own order; it is
    // not a pipeline's sync, which alone passes a failure.
    if (failed) std::rethrow_exception(failed);
    for (size_t i = 0; i < params_.size(); ++i) mark_ready(i, /*used=*/true);
    clear_local_use();
    owner_->backward_finished();
    return;
  }
  {
    // The gradients came without the hooks (set by hand, accumulated under
    // no_sync(), or a pipeline's): what .grad holds now is what this rank
    // used. A parameter without one takes part as zeros; whether any rank
    // has one is agreed before the buckets (with any rank's failure), so
    // that one no rank has keeps an undefined .grad, as in one process
    // (weight decay and momentum would step a defined zero).
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& view = buckets_[slots_[i].bucket].views[slots_[i].position];
      const auto& grad = params_[i].grad();
      const bool has = grad.defined() && params_[i].requires_grad();
      if (has) {
        view.copy_(grad);
      } else {
        view.zero_();
      }
      ready_[i] = 1;
      locally_used_[i] = has ? 1 : 0;
    }
  }
  std::vector<char> used;
  try {
    used = any_rank_has_unless_failed(*comm_, locally_used_, failed,
                                      "DistributedDataParallel's gradient average on rank " +
                                          std::to_string(comm_->rank()) + " of group " +
                                          comm_->name());
  } catch (...) {
    clear_local_use();
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    throw;
  }
  queue_.fill_all();
  launch_ready_buckets();
  wait_and_write_back(queue_.now_s(), /*agree=*/true, &used);
}

}  // namespace cohort
