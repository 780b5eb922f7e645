#include "cohort/optim/fused_distributed_optimizer.h"

#include <algorithm>
#include <exception>
#include <unordered_map>

#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"
#include "cohort/grad_sync/flat_views.h"
#include "cohort/grad_sync/gradient_presence.h"
#include "cohort/grad_sync/parameter_check.h"
#include "cohort/optim/fused_adamw.h"

namespace cohort {
namespace {

// Elements per slice of the update: 256 KiB of float32 per operand.
constexpr int64_t kUpdateSlice = 64 * 1024;

}  // namespace

FusedDistributedOptimizer::FusedDistributedOptimizer(std::vector<torch::Tensor> params,
                                                     std::shared_ptr<Communicator> comm,
                                                     torch::optim::AdamWOptions options,
                                                     FusedOptions fused)
    : comm_(std::move(comm)),
      options_(options),
      params_(std::move(params)),
      queue_(comm_->tracer(), "fused", "fused.bucket") {
  const std::string where = "FusedDistributedOptimizer (rank " + std::to_string(comm_->rank()) +
                            " of " + std::to_string(comm_->size()) + ")";
  // Every rank must build the same buckets, or the all-reduces would mix
  // unrelated elements (or hang on different sizes). What one rank refuses
  // is refused in that check, on every rank: thrown on that rank alone, it
  // would leave the others waiting in the next collective to its timeout.
  std::exception_ptr refusal;
  try {
    if (params_.empty()) throw InvalidArgument(where + ": no parameters");
    for (const auto& p : params_) {
      if (!p.is_floating_point() || p.is_sparse() || p.device() != params_[0].device() ||
          p.scalar_type() != params_[0].scalar_type()) {
        throw Unsupported(where +
                          ": parameters must be dense tensors of one floating dtype on one device");
      }
    }
  } catch (...) {  // an ATen error (an undefined tensor) too
    refusal = std::current_exception();
  }
  verify_same_parameters(*comm_, params_, {}, "FusedDistributedOptimizer", refusal);
  // The state is replicated and every rank applies the same averaged
  // update to its own values: ranks that start apart stay apart, silently.
  // A digest per rank checks it for one word of all-gather.
  verify_same_values(*comm_, params_, {}, "FusedDistributedOptimizer",
                     "every rank applies the same averaged update to its own values, so the "
                     "ranks' models would silently stay different. Build it over parameters "
                     "equal on every rank: broadcast them (cohort DDP's constructor does), or "
                     "initialize them from the same seed or checkpoint on every rank");
  steps_.assign(params_.size(), 0);
  grad_views_.resize(params_.size());
  seen_.assign(params_.size(), 0);
  // A tensor listed twice (a tied weight: LibTorch's parameters() lists it
  // under each of its names) is one parameter, at its first place: in one
  // bucket, with one .grad (the one the caller clips), stepped once, as
  // AdamW over the distinct tensors steps it. Two places would each step
  // their own copy, and the one the model does not read keep stale state.
  first_place_.resize(params_.size());
  {
    std::unordered_map<const void*, size_t> first;
    for (size_t i = 0; i < params_.size(); ++i) {
      first_place_[i] = first.emplace(params_[i].unsafeGetTensorImpl(), i).first->second;
    }
  }
  // Greedy buckets in parameter order, each at most the cap (in bytes).
  const double cap = fused.bucket_cap_mb * 1024 * 1024;
  double bytes = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (first_place_[i] != i) continue;
    const double nb = static_cast<double>(params_[i].nbytes());
    if (buckets_.empty() || (bytes + nb > cap && !buckets_.back().params.empty())) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().params.push_back(i);
    bytes += nb;
  }
  torch::NoGradGuard no_grad;
  place_.resize(params_.size());
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    auto& b = buckets_[bi];
    int64_t n = 0;
    for (size_t k = 0; k < b.params.size(); ++k) {
      place_[b.params[k]] = {bi, k};
      b.offsets.push_back(n);
      n += params_[b.params[k]].numel();
    }
    std::vector<torch::Tensor> members;
    for (size_t i : b.params) members.push_back(params_[i]);
    b.param = flatten_into(members, b.offsets, n);
    b.grad = torch::zeros_like(b.param);
    const auto views = flat_views(b.grad, members, b.offsets);
    for (size_t k = 0; k < b.params.size(); ++k) grad_views_[b.params[k]] = views[k];
    b.exp_avg = torch::zeros_like(b.param);
    b.exp_avg_sq = torch::zeros_like(b.param);
    if (options_.amsgrad()) b.max_exp_avg_sq = torch::zeros_like(b.param);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t first = first_place_[i];
    if (first != i) {  // a later place: its tensor's
      place_[i] = place_[first];
      grad_views_[i] = grad_views_[first];
      continue;
    }
    if (params_[i].grad().defined()) grad_views_[i].copy_(params_[i].grad());
    params_[i].mutable_grad() = grad_views_[i];
  }
  // .grad is always its view, defined: only an accumulator run with a
  // gradient says the parameter has one (a checkpointed block's recompute
  // may run it with none).
  hooks_ = std::make_unique<AccumulatorHooks>(params_, [this](size_t i, bool has) {
    if (has) seen_[first_place_[i]] = 1;
  });
  // All in step(), in bucket order: every bucket is ready at once.
  std::vector<size_t> order(buckets_.size());
  std::vector<int64_t> grad_bytes(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    order[b] = b;
    grad_bytes[b] = buckets_[b].grad.nbytes();
  }
  queue_.set_layout(std::move(order), std::vector<int64_t>(buckets_.size(), 0),
                    std::move(grad_bytes));
}

FusedDistributedOptimizer::~FusedDistributedOptimizer() = default;

std::vector<std::vector<size_t>> FusedDistributedOptimizer::bucket_layout() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

void FusedDistributedOptimizer::zero_grad(bool set_to_none) {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) b.grad.zero_();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& g = params_[i].mutable_grad();
    if (g.defined() && g.is_same(grad_views_[i])) continue;
    // Set to none or replaced by the caller since: zero_grad(false) keeps
    // a defined one (a zero gradient), as LibTorch zeroes it in place.
    if (!set_to_none) seen_[i] = g.defined() ? 1 : 0;
    g = grad_views_[i];
  }
  if (set_to_none) std::fill(seen_.begin(), seen_.end(), 0);
  averaged_ = false;
}

void FusedDistributedOptimizer::fill(Bucket& b) {
  // Normally every .grad is its view already; adopt any that is not.
  for (size_t i : b.params) {
    auto& g = params_[i].mutable_grad();
    if (g.defined() && g.is_same(grad_views_[i])) continue;
    if (g.defined()) {
      grad_views_[i].copy_(g);
      seen_[i] = 1;
    } else {
      // Set to none since: none, whatever it had before.
      grad_views_[i].zero_();
      seen_[i] = 0;
    }
    g = grad_views_[i];
  }
}

void FusedDistributedOptimizer::apply(Bucket& b, const std::vector<char>& has) {
  // amsgrad turned on after construction (through options() or a checkpoint).
  if (options_.amsgrad() && !b.max_exp_avg_sq.defined()) allocate_amsgrad_state();
  // The all-reduce summed (finish_gradients() divided already).
  if (comm_->size() > 1 && !averaged_) b.grad.div_(comm_->size());
  // Consecutive parameters with a gradient and the same step count share one
  // update (almost always the whole bucket).
  size_t k = 0;
  while (k < b.params.size()) {
    const size_t i = b.params[k];
    if (!has[i]) {
      ++k;
      continue;
    }
    size_t e = k + 1;
    while (e < b.params.size() && has[b.params[e]] && steps_[b.params[e]] == steps_[i]) ++e;
    const int64_t lo = b.offsets[k];
    const int64_t hi = e < b.params.size() ? b.offsets[e] : b.param.numel();
    // In slices that stay in cache across the update's passes (and whose
    // temporaries the allocator recycles instead of mapping fresh pages).
    for (int64_t a = lo; a < hi; a += kUpdateSlice) {
      const int64_t n = std::min(kUpdateSlice, hi - a);
      auto p = b.param.narrow(0, a, n);
      auto g = b.grad.narrow(0, a, n);
      auto m = b.exp_avg.narrow(0, a, n);
      auto v = b.exp_avg_sq.narrow(0, a, n);
      torch::Tensor vmax;
      if (options_.amsgrad()) vmax = b.max_exp_avg_sq.narrow(0, a, n);
      adamw_update(p, g, m, v, vmax, steps_[i] + 1, options_);
    }
    for (size_t j = k; j < e; ++j) ++steps_[b.params[j]];
    k = e;
  }
}

std::string FusedDistributedOptimizer::where(const std::string& op) const {
  return "FusedDistributedOptimizer::" + op + " (rank " + std::to_string(comm_->rank()) + " of " +
         std::to_string(comm_->size()) + ", group " + comm_->name() + ")";
}

std::string FusedDistributedOptimizer::replaced_storage() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (first_place_[i] != i) continue;  // its tensor is checked at its first place
    const auto& p = params_[i];
    const auto [bi, k] = place_[i];
    const auto& flat = buckets_[bi].param;
    const auto& view = grad_views_[i];  // shaped as the parameter was
    if (p.has_storage() && p.storage().is_alias_of(flat.storage()) &&
        p.storage_offset() == flat.storage_offset() + buckets_[bi].offsets[k] &&
        p.sizes() == view.sizes() && p.is_contiguous() && p.scalar_type() == flat.scalar_type() &&
        p.device() == flat.device()) {
      continue;
    }
    return "parameter " + std::to_string(i) +
           " no longer holds the storage FusedDistributedOptimizer gave it (a view into its "
           "bucket's flat buffer, " +
           dtype_name(flat.scalar_type()) + " " + c10::str(view.sizes()) + " on " +
           flat.device().str() + "; it is now " + dtype_name(p.scalar_type()) + " " +
           c10::str(p.sizes()) + " on " + p.device().str() +
           "): something replaced it after the optimizer was built (torch::load, which set_()s "
           "each tensor, Module::to, set_data or set_), and the step would update the bucket, "
           "which the model no longer reads, and leave the new values untrained. Copy values "
           "into the parameters in place (p.copy_(value) under torch::NoGradGuard) or load them "
           "with dcp::set_state_dict, and change dtype or device before building the optimizer";
  }
  return "";
}

std::vector<char> FusedDistributedOptimizer::globally_has_grad(const std::string& op) {
  // Before fill(): a replaced parameter's .grad may no longer fit its view.
  // The refusal rides on the presence all-reduce, which every step takes
  // before its first gradient all-reduce.
  const std::string replaced = replaced_storage();
  if (comm_->size() == 1 && !replaced.empty()) throw InvalidArgument(where(op) + ": " + replaced);
  std::vector<char> local(seen_.size(), 0);
  if (replaced.empty()) {
    for (auto& b : buckets_) fill(b);  // a replaced .grad counts as seen
    local = seen_;
  }
  return any_rank_has_unless_refused(*comm_, local, replaced, where(op));
}

void FusedDistributedOptimizer::finish_gradients() {
  if (averaged_) return;
  TraceSpan span(active(comm_->tracer()), "fused reduce gradients", "optim");
  torch::NoGradGuard no_grad;
  has_ = globally_has_grad("finish_gradients");
  if (comm_->size() > 1) {
    queue_.reset();
    queue_.start_clock();
    // No bucket waits for parts: this launches all of them, in order.
    queue_.launch_ready([this](size_t b) { return all_reduce(b, ReduceOp::Avg); });
    sync_.blocked([&] {
      while (queue_.in_flight() > 0) queue_.retire_oldest();
    });
    sync_.sync_done();
  }
  averaged_ = true;
}

void FusedDistributedOptimizer::step() {
  TraceSpan span(active(comm_->tracer()), "fused optimizer step", "optim");
  torch::NoGradGuard no_grad;
  const int world = comm_->size();
  if (averaged_ || world == 1) {
    // Reduced by finish_gradients() (or nothing to reduce): update only.
    // finish_gradients() checked the storage; a replacement since is
    // refused here, on every rank (an update has no collective to ride on).
    if (averaged_) {
      const std::string replaced = replaced_storage();
      if (world > 1) any_rank_has_unless_refused(*comm_, {}, replaced, where("step"));
      if (!replaced.empty()) throw InvalidArgument(where("step") + ": " + replaced);
    }
    if (!averaged_) has_ = globally_has_grad("step");
    for (auto& b : buckets_) apply(b, has_);
    averaged_ = false;
    ++timestep_;
    bump_versions();
    return;
  }
  const auto has = globally_has_grad("step");
  queue_.reset();
  queue_.start_clock();
  // Bucket i's all-reduce is in flight while bucket i-1 is updated.
  while (!queue_.all_launched()) {
    queue_.launch_next([this](size_t b) { return all_reduce(b, ReduceOp::Sum); });
    if (queue_.in_flight() > 1) apply(buckets_[wait_oldest()], has);
  }
  const size_t last = wait_oldest();
  sync_.sync_done();
  apply(buckets_[last], has);
  ++timestep_;
  bump_versions();
}

void FusedDistributedOptimizer::bump_versions() {
  // apply() wrote through the buckets' flat parameters, whose version
  // counters are not the parameters': theirs move as an in-place step would
  // move them, so what tracks them sees the change (a pending async save, a
  // graph that saved a parameter).
  for (size_t i = 0; i < params_.size(); ++i) {
    if (first_place_[i] == i) params_[i].unsafeGetTensorImpl()->bump_version();
  }
}

Work FusedDistributedOptimizer::all_reduce(size_t b, ReduceOp op) {
  Work work = comm_->all_reduce(buckets_[b].grad, {op});
  sync_.bucket_issued();
  return work;
}

size_t FusedDistributedOptimizer::wait_oldest() {
  size_t b = 0;
  sync_.blocked([&] { b = queue_.retire_oldest(); });
  return b;
}

int64_t FusedDistributedOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& b : buckets_) {
    bytes += b.exp_avg.nbytes() + b.exp_avg_sq.nbytes();
    if (b.max_exp_avg_sq.defined()) bytes += b.max_exp_avg_sq.nbytes();
  }
  return bytes;
}

std::vector<torch::Tensor> FusedDistributedOptimizer::grad_buffers() const {
  std::vector<torch::Tensor> out;
  for (const auto& b : buckets_) out.push_back(b.grad);
  return out;
}

int64_t FusedDistributedOptimizer::grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& b : buckets_) bytes += b.grad.nbytes();
  return bytes;
}

FusedParamState FusedDistributedOptimizer::param_state(size_t i) const {
  const size_t first = first_place_.at(i);  // a tied tensor's state is its first place's
  const auto [bi, k] = place_[first];
  const auto& b = buckets_[bi];
  auto view = [&](const torch::Tensor& flat) {
    return flat.defined()
               ? flat.narrow(0, b.offsets[k], params_[i].numel()).view(params_[i].sizes())
               : torch::Tensor();
  };
  return {view(b.exp_avg), view(b.exp_avg_sq), view(b.max_exp_avg_sq), steps_[first]};
}

void FusedDistributedOptimizer::set_param_step(size_t i, int64_t step) {
  steps_[first_place_.at(i)] = step;
  timestep_ = *std::max_element(steps_.begin(), steps_.end());
}

void FusedDistributedOptimizer::allocate_amsgrad_state() {
  for (auto& b : buckets_) {
    if (!b.max_exp_avg_sq.defined()) b.max_exp_avg_sq = torch::zeros_like(b.param);
  }
}

void FusedDistributedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("fused_timestep", torch::tensor({timestep_}));
  archive.write("fused_steps", torch::tensor(steps_));
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const auto key = "fused_bucket_" + std::to_string(i) + "_";
    archive.write(key + "exp_avg", buckets_[i].exp_avg);
    archive.write(key + "exp_avg_sq", buckets_[i].exp_avg_sq);
    if (options_.amsgrad()) archive.write(key + "max_exp_avg_sq", buckets_[i].max_exp_avg_sq);
  }
}

void FusedDistributedOptimizer::load(torch::serialize::InputArchive& archive) {
  torch::Tensor timestep, steps;
  archive.read("fused_timestep", timestep);
  archive.read("fused_steps", steps);
  if (steps.numel() != static_cast<int64_t>(params_.size())) {
    throw MismatchError("FusedDistributedOptimizer::load (rank " + std::to_string(comm_->rank()) +
                        "): the archive has " + std::to_string(steps.numel()) +
                        " parameters, this optimizer " + std::to_string(params_.size()));
  }
  torch::NoGradGuard no_grad;
  if (options_.amsgrad()) allocate_amsgrad_state();  // turned on after construction
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const auto key = "fused_bucket_" + std::to_string(i) + "_";
    auto read_into = [&](const std::string& name, torch::Tensor& dst) {
      torch::Tensor t;
      archive.read(key + name, t);
      if (t.numel() != dst.numel()) {
        throw MismatchError("FusedDistributedOptimizer::load (rank " +
                            std::to_string(comm_->rank()) + "): bucket " + std::to_string(i) +
                            " has " + std::to_string(t.numel()) + " elements in the archive, " +
                            std::to_string(dst.numel()) + " here");
      }
      dst.copy_(t);
    };
    read_into("exp_avg", buckets_[i].exp_avg);
    read_into("exp_avg_sq", buckets_[i].exp_avg_sq);
    if (options_.amsgrad()) read_into("max_exp_avg_sq", buckets_[i].max_exp_avg_sq);
  }
  timestep_ = timestep.item<int64_t>();
  auto s = steps.contiguous();
  for (size_t i = 0; i < params_.size(); ++i) {
    steps_[i] = first_place_[i] == i ? s[i].item<int64_t>() : 0;
  }
}

}  // namespace cohort
