// GradientShardReducer: ZeRO stage 2's staging and reduce-scatter.
//
// When a parameter's gradient is ready (its accumulator's post hook alone,
// DDP's report with DDP) its part in the current bucket is copied into that
// bucket's staging buffer; .grad is set to none (autograd's tensor is
// freed) once every part is staged. The current bucket is reduce-scattered
// into this rank's shard as soon as all its parameters are in, from the
// last bucket down (the order backward fills them; the same on every rank,
// so the collectives match), and the next one becomes current. Its staging
// goes back as soon as its reduce-scatter is done: before the next bucket
// opens (max_staged 1), or while it fills (2, overlapping the reduction
// with the rest of backward).
#include "cohort/optim/gradient_shard_reducer.h"

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <map>
#include <set>

#include "cohort/core/error.h"
#include "cohort/grad_sync/gradient_presence.h"

namespace cohort {

GradientShardReducer::GradientShardReducer(std::vector<torch::Tensor> params,
                                           const FlatPartition& partition,
                                           std::shared_ptr<Communicator> comm, bool hook,
                                           std::function<std::string(const std::string&)> where,
                                           int max_staged)
    : params_(std::move(params)),
      partition_(partition),
      comm_(std::move(comm)),
      where_(std::move(where)),
      max_staged_(static_cast<size_t>(std::max(1, max_staged))),
      queue_(comm_->tracer(), "zero", "zero.bucket") {
  const auto options = params_.at(0).options().requires_grad(false);
  shard_ = torch::zeros({partition_.shard_numel()}, options);
  const auto& buckets = partition_.buckets();
  buckets_.resize(buckets.size());
  param_buckets_.resize(params_.size());
  arrived_.assign(params_.size(), 0);
  has_.assign(params_.size(), 0);
  parts_left_.assign(params_.size(), 0);
  held_grad_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets.size(); ++b) {
    buckets_[b].buffer = std::make_unique<StagingBuffer>(buckets[b].padded, options);
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& prm = partition_.params()[i];
      if (prm.numel > 0 && prm.offset < buckets[b].offset + buckets[b].numel &&
          prm.offset + prm.numel > buckets[b].offset) {
        param_buckets_[i].emplace_back(b, buckets_[b].params.size());
        buckets_[b].params.push_back(i);
      }
    }
    buckets_[b].staged.assign(buckets_[b].params.size(), 0);
  }
  count_parts();
  if (hook) {
    // An accumulator run without a gradient arrives too: arrive() takes
    // whether the parameter has a gradient from .grad itself.
    hooks_ = std::make_unique<AccumulatorHooks>(params_,
                                                [this](size_t i, bool) { on_gradient_ready(i); });
  }
}

void GradientShardReducer::count_parts() {
  const size_t n = buckets_.size();
  std::vector<size_t> order(n);
  std::vector<int64_t> parts(n, 0), bytes(n);
  waited_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) waited_[i] = params_[i].requires_grad() ? 1 : 0;
  for (size_t b = 0; b < n; ++b) {
    order[b] = n - 1 - b;
    // Only parameters that can get a gradient are waited for; the others
    // are zeros when their bucket goes.
    for (size_t i : buckets_[b].params) parts[b] += waited_[i];
    bytes[b] = buckets_[b].buffer->nbytes();
  }
  queue_.set_layout(std::move(order), std::move(parts), std::move(bytes));
}

GradientShardReducer::~GradientShardReducer() {
  if (ddp_) ddp_->set_reduction_owner(nullptr);
}

void GradientShardReducer::take_over(GradientReducer& ddp) {
  if (ddp_) throw InvalidArgument(where_("take_over_reduction") + ": already reducing for a DDP");
  std::set<const void*> ours;
  for (const auto& p : params_) ours.insert(p.unsafeGetTensorImpl());
  const auto& theirs = ddp.parameters();
  for (size_t k = 0; k < theirs.size(); ++k) {
    if (!ours.count(theirs[k].unsafeGetTensorImpl())) {
      throw InvalidArgument(where_("take_over_reduction") + ": DDP's parameter '" +
                            ddp.parameter_names()[k] +
                            "' is not one of this optimizer's; pass ddp.parameters()");
    }
  }
  ddp.set_reduction_owner(this);
  ddp_ = &ddp;
  map_ddp_parameters();
}

void GradientShardReducer::parameters_changed() {
  // Thrown on every rank alike (the ranks agreed on DDP's new set), after
  // the remap, so that DDP and we stay consistent.
  const std::string foreign = map_ddp_parameters();
  if (foreign.empty()) return;
  throw InvalidArgument(where_("take_over_reduction") + ": DDP now reduces '" + foreign +
                        "' (its requires_grad changed), which is not one of this optimizer's: "
                        "its gradient would be averaged by no one; build the optimizer over "
                        "ddp.parameters()");
}

std::string GradientShardReducer::map_ddp_parameters() {
  std::map<const void*, size_t> ours;
  for (size_t i = 0; i < params_.size(); ++i) ours[params_[i].unsafeGetTensorImpl()] = i;
  const auto& theirs = ddp_->parameters();
  std::vector<char> ddps(params_.size(), 0);
  from_ddp_.assign(theirs.size(), kNotOurs);
  std::string foreign;
  for (size_t k = 0; k < theirs.size(); ++k) {
    auto it = ours.find(theirs[k].unsafeGetTensorImpl());
    if (it == ours.end()) {
      if (foreign.empty()) foreign = ddp_->parameter_names()[k];
      continue;
    }
    from_ddp_[k] = it->second;
    ddps[it->second] = 1;
  }
  // DDP reduces what requires grad at its forward; ours that it does not
  // reduce are hooked here, as alone, in case they get a gradient all the
  // same (a backward through the bare module after unfreezing): staged
  // during backward, or at its end until hooked (backward_finished()).
  outside_hooks_.reset();
  outside_ddp_.clear();
  std::vector<torch::Tensor> outside;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ddps[i]) continue;
    outside_ddp_.push_back(i);
    outside.push_back(params_[i]);
  }
  if (!outside.empty()) {
    outside_hooks_ = std::make_unique<AccumulatorHooks>(
        outside, [this](size_t k, bool) { on_gradient_ready_outside_ddp(outside_ddp_[k]); });
  }
  return foreign;
}

void GradientShardReducer::begin_iteration() {
  // requires_grad changed since the buckets were counted (a parameter
  // unfrozen, or frozen, between steps): a bucket waits for the parameters
  // that can get a gradient now. One unfrozen since the last step has no
  // hook yet (finish() makes it): its gradient is staged at the end of
  // backward, and its bucket waits until then.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (waited_[i] != (params_[i].requires_grad() ? 1 : 0)) {
      count_parts();
      break;
    }
  }
  for (auto& b : buckets_) std::fill(b.staged.begin(), b.staged.end(), 0);
  queue_.reset();
  queue_.start_clock();
  std::fill(arrived_.begin(), arrived_.end(), 0);
  std::fill(has_.begin(), has_.end(), 0);
  std::fill(held_grad_.begin(), held_grad_.end(), 0);
  held_.now = 0;
  twice_ = false;
  misfit_.clear();
  active_ = true;
}

void GradientShardReducer::open_bucket(size_t b) {
  auto& bucket = buckets_[b];
  if (bucket.live.defined()) return;
  release_finished();
  while (queue_.in_flight() >= max_staged_) release(queue_.retire_oldest());
  bucket.live = bucket.buffer->acquire();
  staging_.add(bucket.buffer->nbytes());
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    if (arrived_[bucket.params[k]]) stage_part(b, k);
  }
}

void GradientShardReducer::stage_part(size_t b, size_t k) {
  auto& bucket = buckets_[b];
  const size_t i = bucket.params[k];
  const auto& prm = partition_.params()[i];
  const auto& range = partition_.buckets()[b];
  const int64_t lo = std::max(range.offset, prm.offset);
  const int64_t hi = std::min(range.offset + range.numel, prm.offset + prm.numel);
  auto view = bucket.live.narrow(0, lo - range.offset, hi - lo);
  auto& g = params_[i].mutable_grad();
  if (has_[i] && g.numel() == prm.numel) {
    view.copy_(g.reshape(-1).narrow(0, lo - prm.offset, hi - lo));
  } else {
    // Unused here (DDP reports it): zeros, as in DDP. A gradient that no
    // longer fits its place (the parameter's storage was replaced by one
    // of another size) is not staged either: zeros keep this rank's
    // reduce-scatters matching the others', and finish() refuses the step.
    if (has_[i] && misfit_.empty()) {
      misfit_ = "the gradient of parameter " + std::to_string(i) + " has " +
                std::to_string(g.numel()) + " elements, not the " + std::to_string(prm.numel) +
                " of its place in the flat buffer (its storage was replaced)";
    }
    view.zero_();
  }
  bucket.staged[k] = 1;
  if (--parts_left_[i] == 0) {
    held_.add(-held_grad_[i]);
    held_grad_[i] = 0;
    g = torch::Tensor();  // the gradient lives on in the staging only
  }
}

void GradientShardReducer::release(size_t b) {
  auto& bucket = buckets_[b];
  if (!bucket.live.defined()) return;
  bucket.live = torch::Tensor();
  bucket.buffer->release();
  staging_.add(-bucket.buffer->nbytes());
}

void GradientShardReducer::release_finished() {
  size_t b = 0;
  while (queue_.retire_completed(b)) release(b);
}

void GradientShardReducer::on_gradient_ready(size_t i) {
  if (no_sync_depth_ > 0) return;  // accumulate locally in .grad
  if (!active_) {
    // Alone, the end of backward launches what is left (as DDP's end of
    // backward does with DDP): a bucket whose parameters got no gradient
    // would otherwise hold every later gradient in .grad until step().
    torch::autograd::Engine::get_default_engine().queue_callback([this] {
      if (active_) launch_rest();
    });
  }
  arrive(i);
  launch_ready_buckets(false);
}

void GradientShardReducer::on_gradient_ready_outside_ddp(size_t i) {
  // DDP decides whether this backward reduces: its forward under no_sync()
  // accumulates in .grad.
  if (!ddp_->synchronizing()) return;
  arrive(i);
  launch_ready_buckets(false);
}

void GradientShardReducer::gradient_ready(size_t ddp_index) {
  if (from_ddp_[ddp_index] == kNotOurs) return;
  arrive(from_ddp_[ddp_index]);
  launch_ready_buckets(false);
}

void GradientShardReducer::backward_finished() {
  // DDP reported every parameter of its own; a gradient it does not
  // report and no hook of ours saw (a parameter unfrozen since the last
  // step) is staged from .grad now, as alone at the end of backward.
  if (active_) launch_rest();
}

void GradientShardReducer::backward_failed() noexcept {
  // Left active, the next backward would count as a second one before
  // step() and be refused. What was launched was launched alike on every
  // rank that threw at that call; a failed reduce-scatter would only hide
  // the user's exception.
  while (queue_.in_flight() > 0) {
    try {
      release(queue_.retire_oldest());
    } catch (const std::exception&) {
    }
  }
  drop();
  // DDP drops the .grad of its parameters; those it does not reduce are ours.
  for (size_t i : outside_ddp_) params_[i].mutable_grad() = torch::Tensor();
}

void GradientShardReducer::arrive(size_t i) {
  torch::NoGradGuard no_grad;
  if (!active_) begin_iteration();
  if (arrived_[i]) {
    // A second backward before step(): its bucket may be on the wire.
    twice_ = true;
    return;
  }
  arrived_[i] = 1;
  has_[i] = params_[i].grad().defined() ? 1 : 0;
  parts_left_[i] = param_buckets_[i].size();
  bool in_current = false;
  for (const auto& [b, k] : param_buckets_[i]) {
    if (params_[i].requires_grad()) queue_.arrive(b);
    in_current = in_current || (!queue_.all_launched() && b == queue_.next());
    // Its bucket was reduced at the end of an earlier backward: this is a
    // second backward before step().
    if (queue_.launched(b)) twice_ = true;
  }
  if (parts_left_[i] == 0) {
    params_[i].mutable_grad() = torch::Tensor();
    return;
  }
  if (in_current) {
    const size_t b = queue_.next();
    if (!buckets_[b].live.defined()) {
      open_bucket(b);  // stages this gradient too
    } else {
      for (const auto& [pb, k] : param_buckets_[i]) {
        if (pb == b) stage_part(b, k);
      }
    }
  }
  if (parts_left_[i] > 0 && has_[i]) {
    // Kept in .grad until its other buckets are current.
    held_grad_[i] = params_[i].grad().nbytes();
    held_.add(held_grad_[i]);
  }
}

void GradientShardReducer::launch_ready_buckets(bool all) {
  torch::NoGradGuard no_grad;
  release_finished();
  while (all ? !queue_.all_launched() : queue_.next_ready()) {
    open_bucket(queue_.next());
    queue_.launch_next([this](size_t b) { return reduce_scatter(b); });
  }
}

Work GradientShardReducer::reduce_scatter(size_t b) {
  auto& bucket = buckets_[b];
  const auto& range = partition_.buckets()[b];
  // Parameters without a gradient this iteration count as zeros, and so
  // does the padding.
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    if (bucket.staged[k]) continue;
    const auto& prm = partition_.params()[bucket.params[k]];
    const int64_t lo = std::max(range.offset, prm.offset);
    const int64_t hi = std::min(range.offset + range.numel, prm.offset + prm.numel);
    bucket.live.narrow(0, lo - range.offset, hi - lo).zero_();
  }
  if (range.padded > range.numel) {
    bucket.live.narrow(0, range.numel, range.padded - range.numel).zero_();
  }
  auto out = shard_.narrow(0, range.shard_offset, range.chunk);
  return comm_->reduce_scatter_tensor(out, bucket.live, {ReduceOp::Avg});
}

void GradientShardReducer::launch_rest() {
  torch::NoGradGuard no_grad;
  // Gradients that did not come through a synchronizing backward: set by
  // hand, or accumulated under no_sync() with no backward after it. One
  // that arrived after its parameter was staged is a second backward.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    if (!arrived_[i]) {
      arrive(i);
    } else if (parts_left_[i] == 0) {
      twice_ = true;
    }  // else: kept in .grad for a later bucket
  }
  launch_ready_buckets(true);
}

std::vector<char> GradientShardReducer::finish(const std::string& refusal, const std::string& op) {
  torch::NoGradGuard no_grad;
  if (!hooks_ && !ddp_) {
    throw Error(where_("step") +
                ": stage 2 with reduce_gradients = false reduces for cohort DDP, but no DDP "
                "handed its reduction over (build it with make(ddp, ...) or call "
                "take_over_reduction(ddp.reducer()))");
  }
  // A parameter unfrozen since the hooks were made gets its hook now,
  // outside any backward, for the next one.
  if (hooks_) hooks_->hook_unhooked();
  if (outside_hooks_) outside_hooks_->hook_unhooked();
  if (!active_) begin_iteration();
  launch_rest();
  // The presence all-reduce comes after every bucket was launched on every
  // rank, so a refusal it carries leaves no rank inside a reduce-scatter. A
  // second gradient rides on it too: refused on its rank alone, it would
  // leave the others waiting for that rank in the step's all-gather.
  std::string refuse = refusal.empty() ? misfit_ : refusal;
  if (refuse.empty() && twice_) {
    refuse =
        "a parameter got a second gradient before step(); stage 2 reduces during backward, so "
        "accumulate with no_sync() (ddp.no_sync() with DDP) around all but the last backward";
  }
  std::vector<char> has;
  try {
    has = any_rank_has_unless_refused(*comm_, has_, refuse, where_(op));
  } catch (...) {
    drop();
    throw;
  }
  drop();
  return has;
}

void GradientShardReducer::drop() {
  while (queue_.in_flight() > 0) release(queue_.retire_oldest());
  for (size_t b = 0; b < buckets_.size(); ++b) release(b);
  std::fill(held_grad_.begin(), held_grad_.end(), 0);
  held_.now = 0;
  active_ = false;
}

std::vector<torch::Tensor> GradientShardReducer::live_staging() const {
  std::vector<torch::Tensor> out;
  for (const auto& b : buckets_) {
    if (b.live.defined()) out.push_back(b.live);
  }
  return out;
}

int64_t GradientShardReducer::staging_bytes() const {
  int64_t bytes = 0;
  for (const auto& b : buckets_) bytes += b.buffer->nbytes();
  return bytes;
}

}  // namespace cohort
