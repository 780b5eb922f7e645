// GradientShardReducer: ZeRO stage 2's staging and reduce-scatter.
//
// When a parameter's gradient is ready (its accumulator's post hook alone,
// DDP's report with DDP) it is copied into the staging buffer of each
// bucket it lies in and .grad is set to none (autograd's tensor is freed).
// A bucket is reduce-scattered into this rank's shard as soon as all its
// parameters are in, from the last bucket down (the order backward fills
// them; the same on every rank, so the collectives match), so the reduction
// overlaps the rest of backward, as DDP's all-reduce does. A bucket's
// staging goes back as soon as its reduce-scatter is done.
#include "cohort/optim/gradient_shard_reducer.h"

#include <algorithm>
#include <map>

#include "cohort/core/error.h"

namespace cohort {
namespace {

// Buckets staged at once: the one filling and the one on the wire.
constexpr size_t kMaxStaged = 2;

}  // namespace

std::vector<char> any_rank_has(Communicator& comm, const std::vector<char>& local) {
  auto mask = torch::zeros({static_cast<int64_t>(local.size())}, torch::kInt);
  auto* m = mask.data_ptr<int>();
  for (size_t i = 0; i < local.size(); ++i) m[i] = local[i];
  if (comm.size() > 1) comm.all_reduce(mask, {ReduceOp::Max}).wait();
  return std::vector<char>(m, m + local.size());
}

GradientShardReducer::GradientShardReducer(std::vector<torch::Tensor> params,
                                           const FlatPartition& partition,
                                           std::shared_ptr<Communicator> comm, bool hook,
                                           std::function<std::string(const std::string&)> where)
    : params_(std::move(params)),
      partition_(partition),
      comm_(std::move(comm)),
      where_(std::move(where)) {
  const auto options = params_.at(0).options().requires_grad(false);
  shard_ = torch::zeros({partition_.shard_numel()}, options);
  const auto& buckets = partition_.buckets();
  buckets_.resize(buckets.size());
  param_buckets_.resize(params_.size());
  staged_.assign(params_.size(), 0);
  has_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets.size(); ++b) {
    buckets_[b].buffer = std::make_unique<StagingBuffer>(buckets[b].padded, options);
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& prm = partition_.params()[i];
      if (prm.numel > 0 && prm.offset < buckets[b].offset + buckets[b].numel &&
          prm.offset + prm.numel > buckets[b].offset) {
        buckets_[b].params.push_back(i);
        param_buckets_[i].push_back(b);
        // Only parameters that can get a gradient are waited for; the
        // others are zeros when their bucket goes.
        if (params_[i].requires_grad()) ++buckets_[b].pending_init;
      }
    }
  }
  if (hook) {
    hooks_ =
        std::make_unique<AccumulatorHooks>(params_, [this](size_t i) { on_gradient_ready(i); });
  }
}

GradientShardReducer::~GradientShardReducer() {
  if (ddp_) ddp_->set_reduction_owner(nullptr);
}

void GradientShardReducer::take_over(GradientReducer& ddp) {
  if (ddp_) throw InvalidArgument(where_("take_over_reduction") + ": already reducing for a DDP");
  std::map<const void*, size_t> ours;
  for (size_t i = 0; i < params_.size(); ++i) ours[params_[i].unsafeGetTensorImpl()] = i;
  const auto& theirs = ddp.parameters();
  from_ddp_.assign(theirs.size(), 0);
  for (size_t k = 0; k < theirs.size(); ++k) {
    auto it = ours.find(theirs[k].unsafeGetTensorImpl());
    if (it == ours.end()) {
      throw InvalidArgument(where_("take_over_reduction") + ": DDP's parameter '" +
                            ddp.parameter_names()[k] +
                            "' is not one of this optimizer's; pass ddp.parameters()");
    }
    from_ddp_[k] = it->second;
  }
  ddp.set_reduction_owner(this);
  ddp_ = &ddp;
}

void GradientShardReducer::begin_iteration() {
  for (auto& b : buckets_) {
    b.pending = b.pending_init;
    b.launched = false;
  }
  std::fill(staged_.begin(), staged_.end(), 0);
  std::fill(has_.begin(), has_.end(), 0);
  next_launch_ = static_cast<int64_t>(buckets_.size()) - 1;
  twice_ = false;
  active_ = true;
}

torch::Tensor& GradientShardReducer::staging(size_t b) {
  auto& bucket = buckets_[b];
  if (!bucket.live.defined()) {
    // Bounded staging: wait for the older bucket on the wire first.
    // (Buckets still filling cannot be waited for: gradients arriving far
    // out of bucket order may stage more than two.)
    release_finished(false);
    while (live_bytes_ > 0 && live_staged() >= kMaxStaged && !in_flight_.empty())
      release_finished(true);
    bucket.live = bucket.buffer->acquire();
    live_bytes_ += bucket.buffer->nbytes();
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  }
  return bucket.live;
}

void GradientShardReducer::release(size_t b) {
  auto& bucket = buckets_[b];
  bucket.work = Work();  // a finished collective's hold on the buffer
  if (!bucket.live.defined()) return;
  bucket.live = torch::Tensor();
  bucket.buffer->release();
  live_bytes_ -= bucket.buffer->nbytes();
}

void GradientShardReducer::release_finished(bool block) {
  for (size_t k = 0; k < in_flight_.size();) {
    auto& bucket = buckets_[in_flight_[k]];
    if ((block && k == 0) || bucket.work.is_completed()) {
      bucket.work.wait();  // rethrows a failure
      release(in_flight_[k]);
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(k));
      block = false;
    } else {
      ++k;
    }
  }
}

void GradientShardReducer::on_gradient_ready(size_t i) {
  if (no_sync_depth_ > 0) return;  // accumulate locally in .grad
  stage_gradient(i);
  launch_ready_buckets(false);
}

void GradientShardReducer::gradient_ready(size_t ddp_index) {
  stage_gradient(from_ddp_[ddp_index]);
  launch_ready_buckets(false);
}

void GradientShardReducer::backward_finished() {
  if (active_) launch_ready_buckets(true);
}

void GradientShardReducer::stage_gradient(size_t i) {
  torch::NoGradGuard no_grad;
  if (!active_) begin_iteration();
  auto& g = params_[i].mutable_grad();
  if (staged_[i]) {
    // A second backward before step(): its bucket may be on the wire.
    twice_ = true;
    return;
  }
  const auto& prm = partition_.params()[i];
  for (size_t b : param_buckets_[i]) {
    const auto& bucket = partition_.buckets()[b];
    const int64_t lo = std::max(bucket.offset, prm.offset);
    const int64_t hi = std::min(bucket.offset + bucket.numel, prm.offset + prm.numel);
    auto view = staging(b).narrow(0, lo - bucket.offset, hi - lo);
    if (g.defined()) {
      view.copy_(g.reshape(-1).narrow(0, lo - prm.offset, hi - lo));
    } else {
      view.zero_();  // unused here (DDP reports it): zeros, as in DDP
    }
    if (params_[i].requires_grad()) --buckets_[b].pending;
  }
  has_[i] = g.defined() ? 1 : 0;
  g = torch::Tensor();  // the gradient lives on in the staging only
  staged_[i] = 1;
}

void GradientShardReducer::launch_ready_buckets(bool all) {
  torch::NoGradGuard no_grad;
  release_finished(false);
  while (next_launch_ >= 0 && (all || buckets_[next_launch_].pending == 0)) {
    const auto b = static_cast<size_t>(next_launch_--);
    const auto& bucket = partition_.buckets()[b];
    auto& buffer = staging(b);
    // Parameters without a gradient this iteration count as zeros, and so
    // does the padding.
    for (size_t i : buckets_[b].params) {
      if (staged_[i]) continue;
      const auto& prm = partition_.params()[i];
      const int64_t lo = std::max(bucket.offset, prm.offset);
      const int64_t hi = std::min(bucket.offset + bucket.numel, prm.offset + prm.numel);
      buffer.narrow(0, lo - bucket.offset, hi - lo).zero_();
    }
    if (bucket.padded > bucket.numel) {
      buffer.narrow(0, bucket.numel, bucket.padded - bucket.numel).zero_();
    }
    auto out = shard_.narrow(0, bucket.shard_offset, bucket.chunk);
    buckets_[b].work = comm_->reduce_scatter_tensor(out, buffer, {ReduceOp::Avg});
    buckets_[b].launched = true;
    in_flight_.push_back(b);
  }
}

std::vector<char> GradientShardReducer::finish() {
  torch::NoGradGuard no_grad;
  if (!hooks_ && !ddp_) {
    throw Error(where_("step") +
                ": stage 2 with reduce_gradients = false reduces for cohort DDP, but no DDP "
                "handed its reduction over (build it with make(ddp, ...) or call "
                "take_over_reduction(ddp.reducer()))");
  }
  if (!active_) begin_iteration();
  // Gradients that did not come through a synchronizing backward: set by
  // hand, or accumulated under no_sync() with no backward after it. One
  // that arrived after its parameter was staged is a second backward.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    if (staged_[i]) {
      twice_ = true;
    } else {
      stage_gradient(i);
    }
  }
  launch_ready_buckets(true);
  const auto has = any_rank_has(*comm_, has_);
  const bool twice = twice_;
  drop();
  if (twice) {
    throw Error(where_("step") +
                ": a parameter got a second gradient before step(); stage 2 reduces during "
                "backward, so accumulate with no_sync() (ddp.no_sync() with DDP) around all "
                "but the last backward");
  }
  return has;
}

void GradientShardReducer::drop() {
  while (!in_flight_.empty()) release_finished(true);
  for (size_t b = 0; b < buckets_.size(); ++b) release(b);
  active_ = false;
}

size_t GradientShardReducer::live_staged() const {
  size_t n = 0;
  for (const auto& b : buckets_) n += b.live.defined() ? 1 : 0;
  return n;
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
