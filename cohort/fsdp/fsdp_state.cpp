#include "cohort/fsdp/fsdp_state.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "cohort/core/error.h"
#include "cohort/grad_sync/accumulator_hooks.h"
#include "cohort/grad_sync/gradient_presence.h"

namespace cohort::fsdp {

namespace {

std::vector<std::string> unit_names(const std::vector<UnitEntry>& units) {
  std::vector<std::string> out;
  for (const auto& u : units) out.push_back(u.name);
  return out;
}

// What each settings flag is (ScheduleCheck::set_settings).
std::vector<std::string> setting_names(const std::vector<UnitEntry>& units) {
  std::vector<std::string> out;
  for (const auto& u : units) out.push_back("reshard_after_forward of unit '" + u.name + "'");
  for (const auto& u : units) {
    for (const auto& name : u.group->names())
      out.push_back("requires_grad of '" + name + "' of unit '" + u.name + "'");
  }
  return out;
}

}  // namespace

FSDPState::FSDPState(std::vector<UnitEntry> units, bool root_has_params,
                     std::vector<torch::Tensor> buffers, std::shared_ptr<Communicator> comm,
                     std::shared_ptr<Communicator> world, int64_t leaves)
    : units_(std::move(units)),
      buffers_(std::move(buffers)),
      comm_(std::move(comm)),
      world_(std::move(world)),
      root_(root_has_params ? 0 : kRoot),
      queue_(comm_->tracer(), "fsdp", "fsdp.reduce_scatter"),
      check_(world_, unit_names(units_), setting_names(units_)) {
  const size_t k = units_.size();
  for (size_t u = 0; u < k; ++u) {
    first_param_.push_back(params_.size());
    for (const auto& p : units_[u].group->params()) {
      params_.push_back(p);
      unit_of_.push_back(u);
      param_unit_[p.unsafeGetTensorImpl()] = u;
    }
  }
  // Each unit's enclosing unit: the root's (when it has parameters) holds
  // every other; a unit's path is a prefix of those inside it (pre-order).
  parent_.assign(k, kNone);
  inside_.assign(k, 0);
  for (size_t v = 1; v < k; ++v) {
    for (size_t u = v; u-- > 0;) {
      const auto& outer = units_[u].name;
      if ((u == 0 && root_ == 0) || units_[v].name.rfind(outer + ".", 0) == 0) {
        parent_[v] = u;
        break;
      }
    }
    for (size_t a = parent_[v]; a != kNone; a = parent_[a]) ++inside_[a];
  }
  call_watch_.resize(k);
  watched_after_.assign(k, -1);
  settings_ = settings();
  check_.set_settings(settings_);
  check_.set_sync(sync_flags());
  // Until a forward says otherwise: the order of registration.
  for (size_t u = k; u-- > 0;) queue_order_.push_back(u);
  order_backward();
  layout_gradients();
  if (leaves > 0) setup_leaves(leaves);
}

std::vector<int64_t> FSDPState::settings() const {
  std::vector<int64_t> out;
  for (const auto& u : units_) out.push_back(*u.reshard_after_forward);
  for (const auto& p : params_) out.push_back(p.requires_grad() ? 1 : 0);
  return out;
}

std::vector<int64_t> FSDPState::sync_flags() const {
  std::vector<int64_t> out;
  for (const auto& u : units_) out.push_back(*u.requires_gradient_sync ? 1 : 0);
  return out;
}

void FSDPState::layout_gradients() {
  // Hooks come off before the accumulators are remade (a parameter frozen
  // when it was wrapped has none, and one made now, while its parameter is
  // sharded, would expect gradients of the shard's shape).
  hooks_.reset();
  const size_t k = units_.size();
  bucket_parts_.assign(k, 0);
  bucket_bytes_.assign(k, 0);
  parts_.assign(k, 0);
  for (size_t u = 0; u < k; ++u) {
    auto* g = units_[u].group;
    g->make_accumulators();
    for (const auto& p : g->params()) parts_[u] += p.requires_grad() ? 1 : 0;
    // A bucket goes once its unit's backward is over (finish_unit).
    bucket_parts_[u] = 1;
    bucket_bytes_[u] =
        g->layout().world * g->layout().shard_numel * c10::elementSize(g->reduce_dtype());
  }
  // In the order of the last backward (order_backward).
  queue_.set_layout(queue_order_, bucket_parts_, bucket_bytes_);
  // Any accumulator run counts toward its unit's backward being over.
  hooks_ =
      std::make_unique<AccumulatorHooks>(params_, [this](size_t i, bool) { gradient_ready(i); });
}

void FSDPState::begin_forward(bool training) {
  in_forward_ = true;
  begin_call_order();
  // Every unit is sharded between steps, unless an earlier forward's
  // output lives without a backward (its graph keeps them gathered).
  check_.next_pass(std::any_of(units_.begin(), units_.end(),
                               [](const auto& unit) { return !unit.group->will_gather(); }));
  check_.set_sync(sync_flags());
  // hpZ's kept spans are for the backward of the forward that made them.
  for (auto& unit : units_) unit.group->drop_post_forward_shard();
  // What shapes the schedule, taken up (and agreed on by the next
  // collective's check) once per forward: FSDP2 too lets requires_grad and
  // reshard_after_forward change between steps.
  auto now = settings();
  if (now != settings_) {
    const auto first_param = static_cast<std::ptrdiff_t>(units_.size());
    const bool grads_changed =
        !std::equal(now.begin() + first_param, now.end(), settings_.begin() + first_param);
    settings_ = now;
    check_.set_settings(std::move(now));
    if (grads_changed) layout_gradients();
  }
  if (!leaf_.empty() && training && torch::GradMode::is_enabled()) {
    // The last leaf's forward had no backward (none was run, or it threw
    // before reaching the model): the user skipped that step.
    if (leaf_forward_open_) abandon_leaf_step();
    begin_leaf_forward();
    leaf_forward_open_ = true;
    return;
  }
  if (training && world_->size() > 1 && !buffers_.empty() && torch::GradMode::is_enabled()) {
    check_.before(ScheduleStep::kBuffers, kNoUnit);
    torch::NoGradGuard no_grad;
    world_->broadcast_coalesced(buffers_, {0}).wait();
  }
}

void FSDPState::start_unshard(size_t u, ScheduleStep step) {
  auto* group = units_[u].group;
  if (!group->will_gather()) return;
  // A rank whose parameters were replaced refuses on every rank, before
  // the all-gather would discard the new values.
  const auto replaced = group->replaced_storage();
  check_.before(step, u, replaced.empty() ? "" : "unit '" + units_[u].name + "': " + replaced);
  group->start_unshard();
}

void FSDPState::wait_unshard(size_t u, ScheduleStep step) {
  start_unshard(u, step);
  units_[u].group->wait_unshard();
}

size_t FSDPState::next_in_backward(size_t u) const {
  if (u == kRoot) return backward_order_.empty() ? units_.size() : backward_order_[0];
  return backward_next_[u];
}

torch::Tensor FSDPState::pre_forward(size_t u, bool training, const torch::Tensor& input) {
  // A root forward outside any backward while one is marked running: that
  // backward threw (its graph still lives, so graph_freed did not end it).
  if (u == root_ && in_backward_ && !in_autograd_engine()) backward_failed();
  if (u == root_ && !in_backward_) begin_forward(training);
  if (u == kRoot) return input;
  wait_unshard(u, ScheduleStep::kForwardGather);
  // Not while a checkpointed unit recomputes in backward: the next unit's
  // backward came before.
  if (!in_backward_) {
    record_call(u);
    const size_t next = forward_prefetch(u);
    if (next < units_.size()) start_unshard(next, ScheduleStep::kForwardGather);
  }
  return watch_call(u, input);
}

// A training forward's graph freed with no backward run through it (its
// loss dropped, an exception between forward and backward) would leave what
// the forward kept (the root's parameters at least) gathered, and an
// optimizer step would go into the gathered copy (lost at the next reshard,
// or a shape error), as post_forward says of a forward under NoGradGuard.
// So the graph's end reshards, as the end of its backward would have.
// Only on the thread that ran the forward: a graph freed elsewhere (an
// output handed to a logging thread) must not reshard under the training
// thread's forward or backward; its units stay gathered, as while it lived.
struct FSDPState::GraphWatch {
  GraphWatch(std::weak_ptr<FSDPState> state, uint64_t forward)
      : state(std::move(state)), forward(forward), thread(std::this_thread::get_id()) {}
  GraphWatch(const GraphWatch&) = delete;
  GraphWatch& operator=(const GraphWatch&) = delete;
  ~GraphWatch() {
    if (std::this_thread::get_id() != thread) return;
    if (auto s = state.lock()) s->graph_freed(forward);
  }
  std::weak_ptr<FSDPState> state;
  uint64_t forward;
  std::thread::id thread;
};

void FSDPState::graph_freed(uint64_t forward) {
  // Freed on the forward's thread outside any backward while one is marked
  // running: that backward threw, and the exception on its way out drops
  // the graph.
  if (in_backward_ && !in_autograd_engine()) {
    backward_failed();
    return;
  }
  // A backward began after that forward (it resharded at its end, or will),
  // a later forward's graph watches the units now, or a forward is running
  // (its units are in use).
  if (in_backward_ || in_forward_ || backward_after_ >= forward || outermost_forwards_ != forward) {
    return;
  }
  reshard_all_quietly();
}

void FSDPState::forward_failed() noexcept {
  if (in_backward_) return;
  // No post_forward will run for this forward and no graph watches it: what
  // it gathered (the root's parameters, the unit that was computing) and
  // the all-gather it prefetched would outlive it, so an optimizer step
  // after the caught exception would go into the gathered copy, and the
  // next forward would take the prefetch gathered before that step.
  in_forward_ = false;
  // Only a training forward is a leaf of the step (begin_forward()).
  if (leaf_forward_open_) abandon_leaf_step();
  reshard_all_quietly();
}

void FSDPState::backward_failed() noexcept {
  // The autograd engine runs no final callback for a backward that threw,
  // so end_backward never ran: left as it is, the next forward would take
  // itself for a recomputation inside backward (no begin_forward, no new
  // backward, so no reduce-scatter ever again), and the units this
  // backward gathered would stay gathered under the optimizer's step. The
  // exception was thrown on every rank at the same call, so what is in
  // flight was issued on every rank, and waiting for it ends (at worst at
  // the communicator's timeout); its failures would only hide the user's
  // exception.
  in_backward_ = false;
  while (queue_.in_flight() > 0) {
    try {
      queue_.retire_oldest();
    } catch (const std::exception&) {
    }
  }
  queue_.reset();
  failures_.clear();
  // The failed step's gradients must not reach a later step: the units
  // that reduce lose theirs (part of this backward's reduced gradients may
  // already be added into what was stashed). Units without sync keep their
  // full accumulation, as a plain module keeps what a throwing backward
  // accumulated.
  for (size_t u = 0; u < units_.size(); ++u) {
    if (u < reducing_.size() && reducing_[u]) {
      units_[u].group->drop_gradients();
    } else {
      try {
        units_[u].group->keep_full_gradients();
      } catch (const std::exception&) {
      }
    }
  }
  abandon_leaf_step();
  reshard_all_quietly();
}

void FSDPState::reshard_all_quietly() noexcept {
  // In a destructor or under an exception on its way out: a unit that
  // refuses (a parameter replaced) stays gathered, and its next reshard
  // refuses it.
  for (auto& unit : units_) {
    try {
      unit.group->reshard();
    } catch (const std::exception&) {
    }
  }
}

void FSDPState::post_forward(size_t u, const torch::Tensor& output, bool outermost) {
  // The root's parameters are needed again as soon as backward starts; a
  // forward inside backward (a checkpointed unit recomputing) keeps them.
  if (u != root_ && !in_backward_) {
    units_[u].group->reshard_after_forward(*units_[u].reshard_after_forward);
  }
  if (!torch::GradMode::is_enabled() || !output.defined() || !output.requires_grad()) {
    // No backward follows (an evaluation under NoGradGuard), so none would
    // reshard what the forward kept (the root's parameters, units that keep
    // theirs). The parameters are the tensors the optimizer steps: kept
    // full, a step would land in the gathered copy (lost at the next
    // reshard, or a shape error), and a load would go into shards the next
    // forward does not gather. FSDP2's optimizer holds the sharded
    // parameters whatever the module shows; here they must be sharded.
    if (outermost && !in_backward_) {
      in_forward_ = false;
      reshard_all();
    }
    return;
  }
  if (outermost && !in_backward_) in_forward_ = false;
  std::weak_ptr<FSDPState> self = shared_from_this();
  std::shared_ptr<GraphWatch> watch;
  if (outermost && !in_backward_) watch = std::make_shared<GraphWatch>(self, ++outermost_forwards_);
  // The hook runs on the output's grad_fn before it; it leaves the gradient
  // unchanged. It lives as long as that graph, and so does `watch`.
  std::shared_ptr<CallWatch> call;
  if (u != kRoot && call_watch_[u]) call = hook_call(std::move(call_watch_[u]), output);
  const_cast<torch::Tensor&>(output).register_hook([self, u, watch, call](const torch::Tensor&) {
    if (auto state = self.lock()) state->pre_backward(u, call.get());
  });
}

void FSDPState::pre_backward(size_t u, CallWatch* call) {
  // A backward that builds a graph of its gradients (create_graph: grad
  // mode is on in its hooks) would read each unit's full parameters again
  // in a backward through that graph, after this one freed them. Refused
  // before anything changes, on every rank: the check carries the refusal
  // to a rank whose backward has none, at its next collective.
  if (torch::GradMode::is_enabled()) {
    const std::string unit = u == kRoot ? "the root" : "unit '" + units_[u].name + "'";
    check_.before(ScheduleStep::kBackwardGather, u == kRoot ? kNoUnit : u,
                  "a backward with create_graph (backward(create_graph=true), "
                  "torch::autograd::grad(..., create_graph=true): a gradient penalty, a "
                  "second derivative) reached " +
                      unit +
                      " of the fully sharded model, which frees each unit's full parameters once "
                      "its backward is over, while a backward through the gradients' graph would "
                      "read them again; nothing was changed. Compute such gradients without "
                      "create_graph, or with the model outside fully_shard");
  }
  if (!in_backward_) begin_backward();
  if (u != kRoot) backward_started_[u] = 1;
  // This call's backward runs until its hooked nodes have run.
  if (call && call->opened != backward_id_) {
    call->opened = backward_id_;
    call->left = call->ends;
    ++open_[u];
  }
  // The unit before this one is reduce-scattering: its input (that unit's
  // full gradients) goes before this unit's all-gather output is copied
  // into its full storage and the next unit's all-gather starts, so that
  // a backward holds at most three units (this one's parameters and
  // gradients, the prefetched one). It went on the wire after this unit's
  // all-gather and before the prefetch: when communication is the slower
  // side this wait takes no extra time.
  retire_in_flight();
  if (u != kRoot) wait_unshard(u, ScheduleStep::kBackwardGather);
  // A unit whose gradients are reduce-scattered prefetches the next one once
  // they have all landed (gradient_ready); the root (its parameters are
  // few, or none) and a backward without sync prefetch now.
  if (u == root_ || !reducing_[u]) prefetch_after(u);
}

void FSDPState::prefetch_after(size_t u) {
  const size_t next = next_in_backward(u);
  // Not a unit whose backward already ran (its gradients landed late: a
  // parameter it shares with a later unit): that would gather it again.
  // Nor one whose backward is over (or has nothing to run): it gathers
  // itself if its backward comes after all.
  if (next < units_.size() && !backward_started_[next] && !finished_[next]) {
    start_unshard(next, ScheduleStep::kBackwardGather);
  }
}

void FSDPState::begin_backward() {
  in_backward_ = true;
  ++backward_id_;
  forwards_before_ = backward_after_;
  backward_after_ = outermost_forwards_;
  // Each unit's setting as it is now (FSDP2 reads it in backward too); the
  // ranks' are checked before the next collective.
  const auto sync = sync_flags();
  check_.set_sync(sync);
  reducing_.assign(sync.begin(), sync.end());
  any_reducing_ = std::find(sync.begin(), sync.end(), 1) != sync.end();
  for (auto& unit : units_) unit.group->stash_gradients();
  order_backward();
  queue_.reset();
  // A unit without sync sends nothing: its bucket is ready from the start
  // and launches as nothing (launch), so it never holds back the others.
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!reducing_[u]) queue_.arrive(u);
  }
  queue_.start_clock();
  arrived_.assign(units_.size(), 0);
  backward_started_.assign(units_.size(), 0);
  finished_.assign(units_.size(), 0);
  open_.assign(units_.size(), 0);
  inside_open_ = inside_;
  failures_.clear();
  std::weak_ptr<FSDPState> self = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (auto state = self.lock()) state->end_backward();
  });
  // Units with nothing to wait for (all frozen, no backward of their own
  // to come, nothing inside them) are over already.
  for (size_t u = 0; u < units_.size(); ++u) settle(u);
}

void FSDPState::gradient_ready(size_t k) {
  if (!in_backward_) return;
  const size_t u = unit_of_[k];
  ++arrived_[u];
  // Retires finished reduce-scatters as gradients land.
  if (reducing_[u] && leaf_.empty()) launch_ready();
  settle(u);
}

void FSDPState::finish_unit(size_t u) {
  finished_[u] = 1;
  for (size_t a = parent_[u]; a != kNone; a = parent_[a]) --inside_open_[a];
  if (!reducing_[u]) return;  // its full gradients accumulate in .grad
  if (!leaf_.empty()) {
    leaf_gradients_ready(u);
    return;
  }
  queue_.arrive(u);
  launch_ready();
  // The unit's backward is over: it needs its parameters no more. They go
  // (launch did it if the queue let the unit go) before the next unit's
  // all-gather output is allocated, so a backward holds the unit computing
  // (parameters and gradients) or the prefetched unit and the
  // reduce-scatter input, two units, never three.
  units_[u].group->reshard();
  // A unit whose backward never ran (all frozen) is no point in time of
  // the backward order to prefetch from.
  if (backward_started_[u]) prefetch_after(u);
}

void FSDPState::launch_ready() {
  queue_.poll();
  queue_.launch_ready([this](size_t u) { return launch(u); });
  // Each finished reduce-scatter's buffers go now, not at the end of backward.
  size_t u = 0;
  while (queue_.retire_completed(u)) units_[u].group->reduce_scatter_done();
}

Work FSDPState::launch(size_t u) {
  // Without sync a unit keeps its full gradients, and its parameters for
  // its backward (which may not have run yet).
  if (!reducing_[u]) return Work();
  // Its backward is over: it needs its parameters no more, and they go
  // before the reduce-scatter input is made; unless a later call's backward
  // gathered them again (settle reshards after it).
  if (!in_backward_ || open_[u] == 0) units_[u].group->reshard();
  retire_in_flight();
  check_.before(ScheduleStep::kReduceScatter, u);
  return units_[u].group->start_reduce_scatter();
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
  leaf_forward_open_ = false;
  if (!leaf_.empty() && any_reducing_) {
    end_leaf_backward();
    return;
  }
  if (!any_reducing_) {
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
  auto had = had_gradients();
  for (size_t k = 0; k < had.size(); ++k) {
    if (!reducing_[unit_of_[k]]) had[k] = 0;  // not reduced: not asked
  }
  check_.before(ScheduleStep::kGradientPresence, kNoUnit);
  // Over every replica too: a rank whose replica had a gradient gets one.
  const auto any = any_rank_has(*world_, had);
  for (size_t u = 0; u < units_.size(); ++u) {
    const size_t n = units_[u].group->params().size();
    if (reducing_[u]) {
      units_[u].group->finish_gradients(
          std::vector<char>(any.begin() + first_param_[u], any.begin() + first_param_[u] + n));
    } else {
      units_[u].group->keep_full_gradients();
    }
    units_[u].group->reshard();
  }
}

void FSDPState::unshard_all() {
  std::vector<size_t> all(units_.size());
  for (size_t u = 0; u < all.size(); ++u) all[u] = u;
  unshard_units(all);
}

void FSDPState::unshard_units(const std::vector<size_t>& units) {
  // hpZ's kept spans were cut before any optimizer step since that forward:
  // unshard() gathers the shards themselves.
  for (size_t u : units) units_[u].group->drop_post_forward_shard();
  for (size_t u : units) start_unshard(u, ScheduleStep::kUnshard);
  for (size_t u : units) units_[u].group->wait_unshard();
}

void FSDPState::reshard_all() {
  for (auto& unit : units_) unit.group->reshard();
}

std::vector<char> FSDPState::had_gradients() const {
  std::vector<char> had;
  for (const auto& unit : units_) {
    for (size_t i = 0; i < unit.group->params().size(); ++i) {
      had.push_back(unit.group->had_gradient(i) ? 1 : 0);
    }
  }
  return had;
}

}  // namespace cohort::fsdp
