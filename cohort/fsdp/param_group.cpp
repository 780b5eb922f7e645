#include "cohort/fsdp/param_group.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"
#include "cohort/grad_sync/flat_views.h"

namespace cohort::fsdp {
namespace {

// A tensor of `sizes` at element `offset` of `storage` (not an autograd
// view of anything, so set_data to it leaves version counters alone).
torch::Tensor over_storage(const c10::Storage& storage, const torch::TensorOptions& options,
                           int64_t offset, c10::IntArrayRef sizes) {
  auto t = torch::empty({0}, options);
  t.set_(storage, offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

// Frees a collective's buffer once its collective completed, and drops
// `t`. The engine may still hold a reference to it (its work object, until
// its worker lets go), which would keep the bytes for as long as that takes:
// the bytes go now, so what a rank holds does not depend on the engine's
// timing. A buffer that shares its storage with `keep` is only dropped.
void release(torch::Tensor& t, const torch::Tensor& keep = {}) {
  if (t.defined() && !(keep.defined() && t.storage().is_alias_of(keep.storage()))) {
    auto* impl = t.storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(c10::DataPtr(nullptr, impl->device()));
    impl->set_nbytes(0);
  }
  t = torch::Tensor();
}

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

WeakTensor no_tensor() {
  return WeakTensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
}

}  // namespace

FSDPParamGroup::FSDPParamGroup(std::vector<torch::Tensor> params, std::vector<std::string> names,
                               std::shared_ptr<Communicator> comm, std::string unit,
                               const MixedPrecisionPolicy& policy,
                               std::shared_ptr<Communicator> replicate,
                               std::shared_ptr<Communicator> post_forward)
    : params_(std::move(params)),
      names_(std::move(names)),
      comm_(std::move(comm)),
      replicate_(std::move(replicate)),
      post_forward_(std::move(post_forward)),
      unit_(std::move(unit)) {
  if (params_.empty()) throw InvalidArgument("fully_shard(" + unit_ + "): no parameters");
  const auto options = params_[0].options().requires_grad(false);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].dtype() != params_[0].dtype() || params_[i].device() != params_[0].device()) {
      throw InvalidArgument(
          "fully_shard(" + unit_ + ") on rank " + std::to_string(comm_->rank()) + ": parameter '" +
          names_[i] + "' is " + std::string(params_[i].dtype().name()) + " on " +
          params_[i].device().str() + ", '" + names_[0] + "' is " +
          std::string(params_[0].dtype().name()) + " on " + params_[0].device().str() +
          "; a unit's parameters share dtype and device (wrap them in "
          "separate units)");
    }
  }
  sharded_dtype_ = params_[0].scalar_type();
  param_dtype_ = policy.param_dtype.value_or(sharded_dtype_);
  reduce_dtype_ = policy.reduce_dtype.value_or(param_dtype_);
  check_policy();
  layout_ = make_shard_layout(params_, comm_->size(), comm_->rank());
  const size_t n = params_.size();
  stash_.resize(n);
  kept_grad_.assign(n, no_tensor());
  kept_version_.assign(n, 0);
  grad_sharded_.assign(n, 0);
  had_grad_.assign(n, 0);

  // The full storage, with a view per parameter, made while it has its bytes
  // (set_ would otherwise grow it).
  const auto full_options = options.dtype(param_dtype_);
  // A device's allocator allocates on the current device: make it the
  // parameters' (here and in allocate_full()).
  const c10::DeviceGuard on_device(params_[0].device());
  full_storage_ = c10::Storage(c10::Storage::use_byte_size_t(),
                               layout_.full_numel * c10::elementSize(param_dtype_),
                               c10::GetAllocator(params_[0].device().type()), /*resizable=*/true);
  shard_flat_ = torch::zeros({layout_.shard_numel}, options);
  torch::NoGradGuard no_grad;
  // DDP's rule: every rank starts from rank 0's values (in the parameters'
  // own dtype).
  auto initial = torch::empty({layout_.full_numel}, options);
  std::vector<torch::Tensor> initial_views;
  for (size_t i = 0; i < n; ++i) {
    const auto& p = layout_.params[i];
    initial_views.push_back(over_storage(initial.storage(), options, p.full_offset, p.full_sizes));
    initial_views[i].copy_(params_[i]);
    full_views_.push_back(over_storage(full_storage_, full_options, p.full_offset, p.full_sizes));
    shard_views_.push_back(
        over_storage(shard_flat_.storage(), options, p.shard_offset, p.shard_sizes));
  }
  if (comm_->size() > 1 && layout_.full_numel > 0) comm_->broadcast(initial, {0}).wait();
  // HSDP: then from the first replica, so every rank starts from the
  // values of the mesh's rank 0.
  if (replicate_ && replicate_->size() > 1 && layout_.full_numel > 0) {
    replicate_->broadcast(initial, {0}).wait();
  }
  for (size_t i = 0; i < n; ++i) {
    copy_local_rows(layout_.params[i], layout_.rank, initial_views[i], shard_flat_);
    full_views_[i].copy_(initial_views[i]);
    // The accumulator records the full param_dtype parameter it is made for.
    params_[i].set_data(full_views_[i]);
    accumulators_.push_back(
        params_[i].requires_grad() ? torch::autograd::impl::grad_accumulator(params_[i]) : nullptr);
  }
  unsharded_ = true;
  reshard();
}

void FSDPParamGroup::check_policy() const {
  const auto floating = [](torch::Dtype t) { return c10::isFloatingType(t); };
  if (param_dtype_ == sharded_dtype_ && reduce_dtype_ == sharded_dtype_) return;
  if (!floating(sharded_dtype_) || !floating(param_dtype_) || !floating(reduce_dtype_)) {
    throw InvalidArgument("fully_shard(" + unit_ + ") on rank " + std::to_string(comm_->rank()) +
                          ": mixed precision casts floating parameters to floating dtypes; the "
                          "parameters are " +
                          dtype_name(sharded_dtype_) + ", param_dtype " + dtype_name(param_dtype_) +
                          ", reduce_dtype " + dtype_name(reduce_dtype_));
  }
}

void FSDPParamGroup::relink_accumulators() {
  if (param_dtype_ == sharded_dtype_) return;  // set_data kept the link
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!accumulators_[i]) continue;
    auto* meta = torch::autograd::impl::get_autograd_meta(params_[i]);
    std::lock_guard<std::mutex> lock(meta->mutex_);
    meta->grad_accumulator_ = accumulators_[i];
  }
}

void FSDPParamGroup::make_accumulators() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad() || accumulators_[i]) continue;
    // The accumulator records the shape, dtype and device of the tensor it
    // is made for: a placeholder of the full parameter's (one element, no
    // full storage needed) stands in while it is made.
    torch::NoGradGuard no_grad;
    const auto current = unsharded_ ? full_views_[i] : shard_views_[i];
    const auto& sizes = layout_.params[i].full_sizes;
    params_[i].set_data(at::empty_strided(sizes, std::vector<int64_t>(sizes.size(), 0),
                                          shard_flat_.options().dtype(param_dtype_)));
    {
      // One LibTorch made while the parameter was sharded expects the shard.
      auto* meta = torch::autograd::impl::get_autograd_meta(params_[i]);
      std::lock_guard<std::mutex> lock(meta->mutex_);
      meta->grad_accumulator_.reset();
    }
    accumulators_[i] = torch::autograd::impl::grad_accumulator(params_[i]);
    params_[i].set_data(current);
  }
  relink_accumulators();
}

void FSDPParamGroup::allocate_full() {
  auto* impl = full_storage_.unsafeGetStorageImpl();
  const size_t bytes = layout_.full_numel * c10::elementSize(param_dtype_);
  if (impl->nbytes() == bytes) return;
  const c10::DeviceGuard on_device(params_[0].device());
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

void FSDPParamGroup::free_full() {
  auto* impl = full_storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

int64_t FSDPParamGroup::unsharded_bytes() const {
  return static_cast<int64_t>(full_storage_.nbytes());
}

bool FSDPParamGroup::holds_storage(size_t i) const {
  const auto& p = params_[i];
  const auto& want = unsharded_ ? full_views_[i] : shard_views_[i];
  return p.has_storage() && p.storage().is_alias_of(want.storage()) &&
         p.storage_offset() == want.storage_offset() && p.sizes() == want.sizes() &&
         p.strides() == want.strides() && p.scalar_type() == want.scalar_type() &&
         p.device() == want.device();
}

std::string FSDPParamGroup::replaced_storage() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (holds_storage(i)) continue;
    const auto& p = params_[i];
    const auto& want = unsharded_ ? full_views_[i] : shard_views_[i];
    return "parameter '" + names_[i] + "' of unit " + unit_ +
           " no longer holds the storage fully_shard gave it (" +
           (unsharded_ ? "its full value" : "this rank's rows of it") + ", " +
           dtype_name(want.scalar_type()) + " " + c10::str(want.sizes()) + "; it is now " +
           dtype_name(p.scalar_type()) + " " + c10::str(p.sizes()) +
           "): something replaced it after fully_shard (torch::load, which set_()s each tensor, "
           "Module::to, set_data or set_), and fully_shard would discard those values at its "
           "next all-gather. Load values through FullyShard's load_full_state_dict or "
           "dcp::set_state_dict (or into the model before fully_shard), and change dtype or "
           "device before fully_shard";
  }
  return "";
}

void FSDPParamGroup::check_storage() const {
  const auto why = replaced_storage();
  if (!why.empty()) {
    throw InvalidArgument("fully_shard(" + unit_ + ") on rank " + std::to_string(comm_->rank()) +
                          ": " + why);
  }
}

void FSDPParamGroup::start_unshard() {
  if (unsharded_ || gathering_) return;
  check_storage();
  const bool post_forward = post_forward_shard_.defined();
  // After hpZ's reshard: the post-forward shards, within the smaller group.
  gather_input_ = post_forward ? std::move(post_forward_shard_)
                               : shard_flat_.to(param_dtype_);  // the shard itself when no cast
  post_forward_shard_ = torch::Tensor();
  gathered_ = torch::empty({layout_.world * layout_.shard_numel}, gather_input_.options());
  gather_ =
      (post_forward ? post_forward_ : comm_)->all_gather_into_tensor(gathered_, gather_input_);
  gathering_ = true;
}

void FSDPParamGroup::reshard_after_forward(int code) {
  if (code == 0 || !unsharded_) return;
  check_storage();
  if (code == 1 || !post_forward_ || post_forward_->size() != code) {
    COHORT_CHECK(code == 1, "fully_shard: no post-forward group of the size asked for");
    reshard();
    return;
  }
  // The full buffer, rank-major as the all-gather over the shard group
  // would fill it (copy_in lays out full tensors that way); this rank keeps
  // the span of W/N ranks' shards its place in its post-forward group owns.
  torch::NoGradGuard no_grad;
  const int64_t span = layout_.world / code * layout_.shard_numel;
  auto flat = torch::empty({layout_.world * layout_.shard_numel},
                           shard_flat_.options().dtype(param_dtype_));
  for (size_t i = 0; i < params_.size(); ++i) copy_in_param(layout_, i, full_views_[i], flat);
  post_forward_shard_ = flat.narrow(0, post_forward_->rank() * span, span).clone();
  release(flat);
  set_sharded();
  free_full();
  unsharded_ = false;
}

void FSDPParamGroup::wait_unshard() {
  if (unsharded_) return;
  start_unshard();
  gather_.wait();
  gathering_ = false;
  gather_ = Work();
  allocate_full();
  torch::NoGradGuard no_grad;
  copy_out(layout_, gathered_, full_views_);
  release(gathered_);
  release(gather_input_, shard_flat_);
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
  relink_accumulators();
  unsharded_ = true;
}

void FSDPParamGroup::drop_post_forward_shard() { release(post_forward_shard_); }

void FSDPParamGroup::reshard() {
  release(post_forward_shard_);
  if (gathering_) {
    gather_.wait();
    gathering_ = false;
    gather_ = Work();
    release(gathered_);
    release(gather_input_, shard_flat_);
  }
  if (!unsharded_) return;
  check_storage();
  set_sharded();
  free_full();
  unsharded_ = false;
}

void FSDPParamGroup::set_sharded() {
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(shard_views_[i]);
  relink_accumulators();
}

void FSDPParamGroup::stash_gradients() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (grad_sharded_[i]) {
      stash_[i] = std::move(params_[i].mutable_grad());
      params_[i].mutable_grad() = torch::Tensor();
      grad_sharded_[i] = 0;
    } else if (stash_[i].defined() && !holds_kept_gradient(i)) {
      // .grad is a full accumulation (or none) that the user zeroed or
      // replaced since the backward without sync left it (zero_grad, set
      // to none or in place): one process's .grad held what was put aside
      // too, so that goes as well.
      stash_[i] = torch::Tensor();
    }
  }
}

bool FSDPParamGroup::holds_kept_gradient(size_t i) const {
  const auto& g = params_[i].grad();
  // The weak reference keeps the kept tensor's address from being reused.
  return g.defined() && g.unsafeGetTensorImpl() == kept_grad_[i]._unsafe_get_target() &&
         g._version() == kept_version_[i];
}

Work FSDPParamGroup::start_reduce_scatter() {
  torch::NoGradGuard no_grad;
  const auto reduce_options = shard_flat_.options().dtype(reduce_dtype_);
  rs_input_ = torch::empty({layout_.world * layout_.shard_numel}, reduce_options);
  // Each full gradient goes as soon as it is copied in, so the unit's full
  // gradients and the input coexist only while the copy runs. copy_in casts
  // them (param_dtype, or reduce_dtype when accumulated without sync) to
  // reduce_dtype.
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor grad = std::move(params_[i].mutable_grad());
    params_[i].mutable_grad() = torch::Tensor();
    had_grad_[i] = grad.defined() ? 1 : 0;
    copy_in_param(layout_, i, grad, rs_input_);
  }
  rs_output_ = torch::empty({layout_.shard_numel}, reduce_options);
  rs_pending_ = true;
  if (!replicate_ || replicate_->size() == 1) {
    return comm_->reduce_scatter_tensor(rs_output_, rs_input_, {ReduceOp::Avg});
  }
  // HSDP: the shard group's average, then the replicas' average of it: the
  // average over the whole mesh. The reduce-scatter is waited for here (its
  // completion step finishes the average before the all-reduce reads it),
  // so only the all-reduce overlaps the rest of backward.
  comm_->reduce_scatter_tensor(rs_output_, rs_input_, {ReduceOp::Avg}).wait();
  return replicate_->all_reduce(rs_output_, {ReduceOp::Avg});
}

void FSDPParamGroup::reduce_scatter_done() {
  if (!rs_pending_) return;
  rs_pending_ = false;
  release(rs_input_);
  torch::NoGradGuard no_grad;
  rs_output_ = rs_output_.to(sharded_dtype_);  // the shard's .grad has the shard's dtype
  bool all_stashed = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!stash_[i].defined()) {
      all_stashed = false;
      continue;
    }
    // A parameter no rank had a gradient for gets zeros here: unchanged.
    const auto& p = layout_.params[i];
    stash_[i].add_(
        rs_output_.narrow(0, p.shard_offset, p.local_rows * p.row_numel).view(p.shard_sizes));
  }
  if (all_stashed) {
    release(rs_output_);
  } else {
    keep_gradient_rows(/*free=*/true);
  }
}

void FSDPParamGroup::keep_gradient_rows(bool free) {
  rs_offsets_.clear();
  for (const auto& p : layout_.params) rs_offsets_.push_back(p.shard_offset);
  // No rank has a gradient for a parameter that has no accumulator (frozen
  // since it was wrapped; the ranks made theirs at the same forwards) and
  // had none here. Units without one keep the output whole, as it is.
  const auto frozen = [&](size_t i) { return !accumulators_[i] && !had_grad_[i]; };
  bool any_frozen = false;
  for (size_t i = 0; i < params_.size(); ++i) any_frozen = any_frozen || frozen(i);
  if (!any_frozen) return;
  // The output is kept to the end of backward and .grad aliases it after:
  // whole, it would hold a gradient's bytes for every frozen weight (a
  // LoRA unit's nearly all). Only the rows that may become .grad stay.
  torch::NoGradGuard no_grad;
  int64_t numel = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = layout_.params[i];
    rs_offsets_[i] = stash_[i].defined() || frozen(i) ? -1 : numel;
    if (rs_offsets_[i] >= 0) numel += p.local_rows * p.row_numel;
  }
  auto kept = torch::empty({numel}, rs_output_.options());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = layout_.params[i];
    if (rs_offsets_[i] < 0) continue;
    const int64_t n = p.local_rows * p.row_numel;
    kept.narrow(0, rs_offsets_[i], n).copy_(rs_output_.narrow(0, p.shard_offset, n));
  }
  if (free) release(rs_output_);
  rs_output_ = std::move(kept);
}

void FSDPParamGroup::finish_gradients(const std::vector<char>& any) {
  reduce_scatter_done();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads(params_.size());
  if (rs_output_.defined()) {
    std::vector<torch::Tensor> like;
    std::vector<int64_t> offsets;
    std::vector<size_t> kept;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (rs_offsets_[i] < 0) continue;
      like.push_back(shard_views_[i]);
      offsets.push_back(rs_offsets_[i]);
      kept.push_back(i);
    }
    // Aliases, not views: Optimizer::zero_grad() detach_()es every .grad.
    auto aliases = flat_aliases(rs_output_, like, offsets);
    for (size_t k = 0; k < kept.size(); ++k) grads[kept[k]] = std::move(aliases[k]);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& g = params_[i].mutable_grad();
    if (stash_[i].defined()) {
      g = stash_[i];  // the result was added into it
    } else {
      COHORT_CHECK(!any[i] || grads[i].defined(),
                   "fully_shard(" << unit_ << ") on rank " << comm_->rank() << ": '" << names_[i]
                                  << "' got a gradient on another rank but has no accumulator "
                                     "here");
      g = any[i] ? grads[i] : torch::Tensor();
    }
    grad_sharded_[i] = g.defined() ? 1 : 0;
    stash_[i] = torch::Tensor();
  }
  rs_output_ = torch::Tensor();
}

void FSDPParamGroup::keep_full_gradients() {
  for (size_t i = 0; i < params_.size(); ++i) {
    grad_sharded_[i] = 0;
    auto& g = params_[i].mutable_grad();
    kept_grad_[i] = no_tensor();
    if (!g.defined()) {
      // No full gradient: a shard put aside goes back to .grad (the unit
      // is resharded next), where zero_grad reaches it.
      if (stash_[i].defined()) {
        g = std::move(stash_[i]);
        stash_[i] = torch::Tensor();
        grad_sharded_[i] = 1;
      }
      continue;
    }
    // As FSDP2: full gradients accumulate in reduce_dtype across backwards
    // without sync (the next backward adds its param_dtype gradient to it).
    if (g.scalar_type() != reduce_dtype_) g = g.to(reduce_dtype_);
    // A shard put aside stays there only while .grad is this tensor as
    // left here (stash_gradients).
    kept_grad_[i] = WeakTensor(g.getIntrusivePtr());
    kept_version_[i] = g._version();
  }
}

void FSDPParamGroup::drop_gradients() {
  rs_pending_ = false;
  rs_input_ = torch::Tensor();
  rs_output_ = torch::Tensor();
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].mutable_grad() = torch::Tensor();
    stash_[i] = torch::Tensor();
    grad_sharded_[i] = 0;
  }
}

void FSDPParamGroup::push_leaf_gradient(LeafReduction& leaf, bool first) {
  torch::NoGradGuard no_grad;
  if (first) std::fill(had_grad_.begin(), had_grad_.end(), 0);
  // The rank-major layout of the reduce-scatter input: the canonical sums
  // are elementwise, so each element's sum is the same whatever the layout,
  // and the chunk each rank gets back is its flat shard.
  auto flat = torch::empty({layout_.world * layout_.shard_numel},
                           shard_flat_.options().dtype(reduce_dtype_));
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor grad = std::move(params_[i].mutable_grad());
    params_[i].mutable_grad() = torch::Tensor();
    if (grad.defined()) had_grad_[i] = 1;
    copy_in_param(layout_, i, grad, flat);
  }
  leaf.push(std::move(flat));
}

void FSDPParamGroup::finish_leaf_gradients(LeafReduction& leaf, const std::vector<char>& any) {
  torch::NoGradGuard no_grad;
  auto chunk = leaf.finish_chunk(*comm_);
  COHORT_CHECK(chunk.numel() == layout_.shard_numel,
               "fully_shard: a leaf chunk is not the unit's flat shard");
  rs_output_ = chunk.to(sharded_dtype_);
  rs_pending_ = false;
  // As DDP with leaves: .grad is set to the step's mean, not added to.
  for (auto& s : stash_) s = torch::Tensor();
  keep_gradient_rows(/*free=*/false);  // the chunk may be the tree's own buffer
  finish_gradients(any);
}

std::vector<torch::Tensor> FSDPParamGroup::gather_full() const {
  check_storage();
  torch::NoGradGuard no_grad;
  auto gathered = torch::empty({layout_.world * layout_.shard_numel}, shard_flat_.options());
  comm_->all_gather_into_tensor(gathered, shard_flat_).wait();
  std::vector<torch::Tensor> full;
  for (const auto& p : layout_.params)
    full.push_back(torch::empty(p.full_sizes, shard_flat_.options()));
  copy_out(layout_, gathered, full);
  return full;
}

void FSDPParamGroup::load_full(const std::vector<torch::Tensor>& full) {
  check_storage();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    copy_local_rows(layout_.params[i], layout_.rank, full[i], shard_flat_);
    // Written through the flat shard, whose version counter is not the
    // parameter's: the parameter's own moves as an in-place write would
    // move it, so what tracks it sees the change (a pending async save, a
    // graph that saved the parameter).
    params_[i].unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace cohort::fsdp
