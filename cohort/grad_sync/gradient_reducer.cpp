// GradientReducer, setup half: parameters, hooks, the construction-time
// check and broadcast, bucket layout and its one rebuild. The per-iteration
// half is gradient_reducer_iteration.cpp.
#include "cohort/grad_sync/gradient_reducer.h"

#include <algorithm>
#include <map>
#include <unordered_set>

#include "cohort/core/error.h"
#include "cohort/core/serial_worker.h"
#include "cohort/grad_sync/flat_views.h"
#include "cohort/grad_sync/leaf_buckets.h"
#include "cohort/grad_sync/parameter_check.h"

namespace cohort {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

}  // namespace

GradientReducer::GradientReducer(std::shared_ptr<torch::nn::Module> module,
                                 std::shared_ptr<Communicator> comm, DDPOptions options)
    : module_(std::move(module)),
      comm_(std::move(comm)),
      options_(options),
      hook_(std::make_shared<AllReduceHook>()),
      queue_(comm_ ? comm_->tracer() : nullptr, "ddp", "ddp.bucket") {
  if (!module_ || !comm_) {
    throw InvalidArgument("DistributedDataParallel: module and communicator must be non-null");
  }
  if (!(options_.bucket_cap_mb > 0) || !(options_.first_bucket_mb > 0)) {
    throw InvalidArgument(
        "DistributedDataParallel: bucket_cap_mb and first_bucket_mb must be > 0 (rank " +
        std::to_string(comm_->rank()) + ")");
  }
  // Each tensor once, under its first name, as PyTorch's DDP: LibTorch's
  // named_parameters() lists a tensor registered in two modules (tied
  // weights) under both names, and two slots of one tensor would each take
  // its gradient.
  std::unordered_set<const void*> seen;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (p.is_sparse() || !p.is_contiguous()) {
      throw InvalidArgument("DistributedDataParallel: parameter '" + item.key() + "' on rank " +
                            std::to_string(comm_->rank()) + " must be a dense, contiguous tensor");
    }
    all_params_.push_back(p);
    all_names_.push_back(item.key());
    reduced_.push_back(p.requires_grad() ? 1 : 0);
  }
  split_parameters();
  // A bucket is one flat tensor: its parameters share one device.
  for (size_t i = 1; i < params_.size(); ++i) {
    if (params_[i].device() == params_[0].device()) continue;
    throw InvalidArgument("DistributedDataParallel: parameter '" + names_[i] + "' on rank " +
                          std::to_string(comm_->rank()) + " is on " + params_[i].device().str() +
                          " but '" + names_[0] + "' on " + params_[0].device().str() +
                          "; the module's parameters must share one device");
  }
  for (const auto& b : module_->buffers(/*recurse=*/true)) buffers_.push_back(b);
  // The compressors work on host memory.
  if (options_.compression.kind != compression::CompressionKind::None && !params_.empty() &&
      !params_[0].device().is_cpu()) {
    throw InvalidArgument("DistributedDataParallel: gradient compression on rank " +
                          std::to_string(comm_->rank()) + " takes CPU parameters; these are on " +
                          params_[0].device().str());
  }

  verify_same_parameters(*comm_, params_, names_);
  verify_same_parameters(*comm_, frozen_, frozen_names_,
                         "DistributedDataParallel (parameters without requires_grad)");
  broadcast_state();

  // Reverse registration order: the last layers' gradients are ready first.
  std::vector<size_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  build_buckets(order);

  if (options_.determinism == Determinism::WorldSizeInvariant) setup_leaves();
  hooks_ = std::make_unique<AccumulatorHooks>(
      params_, [this](size_t i, bool has) { on_gradient_ready(i, has); });
  ready_.assign(params_.size(), 0);
  locally_used_.assign(params_.size(), 0);
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::split_parameters() {
  params_.clear();
  names_.clear();
  frozen_.clear();
  frozen_names_.clear();
  all_index_.clear();
  for (size_t i = 0; i < all_params_.size(); ++i) {
    if (reduced_[i]) {
      all_index_.push_back(i);
      params_.push_back(all_params_[i]);
      names_.push_back(all_names_[i]);
    } else {
      // Not reduced, but rank 0's values too (broadcast_state()): a frozen
      // part initialised after a per-rank seed would otherwise differ.
      frozen_.push_back(all_params_[i]);
      frozen_names_.push_back(all_names_[i]);
    }
  }
}

void GradientReducer::broadcast_state() {
  if (comm_->size() == 1) return;
  // Detached aliases: same storage, but writing them is not an in-place
  // operation on a leaf that requires grad.
  std::vector<torch::Tensor> state;
  for (auto& p : params_) state.push_back(p.detach());
  for (auto& p : frozen_) state.push_back(p.detach());
  for (auto& b : buffers_) state.push_back(b.detach());
  torch::NoGradGuard no_grad;
  comm_->broadcast_coalesced(state, {0}).wait();
}

void GradientReducer::broadcast_buffers() {
  // Read the buffers again, as PyTorch does: a module may have replaced one.
  buffers_ = module_->buffers(/*recurse=*/true);
  if (comm_->size() == 1 || buffers_.empty()) return;
  std::vector<torch::Tensor> state;
  for (auto& b : buffers_) state.push_back(b.detach());
  torch::NoGradGuard no_grad;
  comm_->broadcast_coalesced(state, {0}).wait();
}

void GradientReducer::build_buckets(const std::vector<size_t>& order) {
  // Parameters fill one open bucket per dtype in `order`; a bucket closes
  // when it reaches its cap (the very first one at first_bucket_mb). As in
  // PyTorch, a bucket may exceed the cap by its last parameter.
  const auto cap = static_cast<int64_t>(options_.bucket_cap_mb * kMiB);
  const auto first_cap = static_cast<int64_t>(options_.first_bucket_mb * kMiB);
  std::vector<std::vector<size_t>> closed;
  std::map<c10::ScalarType, std::pair<std::vector<size_t>, int64_t>> open;
  for (size_t i : order) {
    auto& [members, bytes] = open[params_[i].scalar_type()];
    members.push_back(i);
    bytes += params_[i].numel() * params_[i].element_size();
    if (bytes >= (closed.empty() ? first_cap : cap)) {
      closed.push_back(std::move(members));
      open.erase(params_[i].scalar_type());
    }
  }
  for (auto& [dtype, entry] : open) closed.push_back(std::move(entry.first));

  // Launch order: by the position of each bucket's first parameter in
  // `order`, so the bucket whose gradients come first goes first.
  std::vector<size_t> position(params_.size());
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  std::stable_sort(closed.begin(), closed.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  install_buckets(std::move(closed));
}

void GradientReducer::install_buckets(std::vector<std::vector<size_t>> closed) {
  buckets_.clear();
  slots_.assign(params_.size(), Slot{});
  for (auto& members : closed) {
    Bucket bucket;
    int64_t numel = 0;
    for (size_t i : members) numel += params_[i].numel();
    for (size_t k = 0; k < members.size(); ++k) slots_[members[k]] = Slot{buckets_.size(), k};
    bucket.params = std::move(members);
    // With a reduction owner the buckets are bookkeeping only: no memory;
    // with leaves, LeafBuckets holds the sums in this layout.
    if (owner_ || options_.determinism == Determinism::WorldSizeInvariant) {
      buckets_.push_back(std::move(bucket));
      continue;
    }
    const auto& first = params_[bucket.params.front()];
    bucket.buffer = torch::zeros({numel}, first.options().requires_grad(false));
    std::vector<torch::Tensor> tensors;
    std::vector<int64_t> offsets;
    int64_t offset = 0;
    for (size_t i : bucket.params) {
      tensors.push_back(params_[i]);
      offsets.push_back(offset);
      offset += params_[i].numel();
    }
    // Not views: gradient_as_bucket_view makes them the .grad (flat_views.h).
    bucket.views = flat_aliases(bucket.buffer, tensors, offsets);
    buckets_.push_back(std::move(bucket));
  }
  stats_.buckets = static_cast<int64_t>(buckets_.size());
  // Launched in index order: the buckets are sorted by when their first
  // gradient is expected.
  std::vector<size_t> launch_order(buckets_.size());
  std::vector<int64_t> parts(buckets_.size()), bytes(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    launch_order[b] = b;
    parts[b] = static_cast<int64_t>(buckets_[b].params.size());
    const auto& buffer = buckets_[b].buffer;
    bytes[b] = buffer.defined() ? buffer.numel() * buffer.element_size() : 0;
  }
  queue_.set_layout(std::move(launch_order), std::move(parts), std::move(bytes));
  if (options_.gradient_as_bucket_view && !owner_ &&
      options_.determinism != Determinism::WorldSizeInvariant) {
    move_grads_into_buckets();
  }
}

void GradientReducer::move_grads_into_buckets() {
  // Existing gradients move into the (new) buckets now, so .grad is a view
  // from here on; AccumulateGrad then accumulates into it in place.
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;
    auto& view = buckets_[slots_[i].bucket].views[slots_[i].position];
    view.copy_(grad);
    grad = view;
  }
}

void GradientReducer::rebuild_buckets() {
  // Every rank observed its own ready order; rank 0's wins so that all
  // ranks build identical buckets.
  const auto n = static_cast<int64_t>(params_.size());
  auto order = torch::empty({n}, torch::kLong);
  if (comm_->rank() == 0) {
    auto* d = order.data_ptr<int64_t>();
    for (int64_t k = 0; k < n; ++k) d[k] = static_cast<int64_t>(ready_order_[k]);
  }
  comm_->broadcast(order, {0}).wait();
  std::vector<size_t> agreed(n);
  std::vector<char> seen(n, 0);
  const auto* d = order.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = d[k];
    COHORT_CHECK(i >= 0 && i < n && !seen[i], "rank 0's gradient order is not a permutation");
    seen[i] = 1;
    agreed[k] = static_cast<size_t>(i);
  }
  const auto before = bucket_layout();
  build_buckets(agreed);
  rebuilt_ = true;
  stats_.buckets_rebuilt = true;
  tell_hook_changed(before);
}

void GradientReducer::tell_hook_changed(const std::vector<std::vector<size_t>>& before) {
  // A bucket whose parameters changed (even at the same size) must not get
  // the hook's state of the old ones, e.g. error feedback added to other
  // gradients; every rank rebuilt the same buckets, so all tell the hook.
  const auto after = bucket_layout();
  std::vector<int64_t> changed;
  for (size_t b = 0; b < std::max(before.size(), after.size()); ++b) {
    if (b >= before.size() || b >= after.size() || before[b] != after[b]) {
      changed.push_back(static_cast<int64_t>(b));
    }
  }
  if (!changed.empty()) hook_->buckets_changed(changed);
}

void GradientReducer::set_reduction_owner(ReductionOwner* owner) {
  if (owner && !owner->takes_leaf_chunks()) refuse_with_leaves("set_reduction_owner");
  // Outside the engine, an unfinished backward threw (the next forward
  // ends it). With an owner DDP launched nothing of it, so the owner may go
  // now, as ZeRO's destructor does while the exception leaves the training
  // loop (refused, that destructor would end the program): it drops its
  // part first. DDP's own buckets may still be on the wire.
  const bool unfinished = backward_started_ && !backward_finished_;
  if (unfinished && (in_autograd_engine() || !owner_)) {
    throw InvalidArgument("DistributedDataParallel: set_reduction_owner on rank " +
                          std::to_string(comm_->rank()) + " during a backward pass");
  }
  if (owner == owner_) return;
  if (unfinished) owner_->backward_failed();
  torch::NoGradGuard no_grad;
  // .grad tensors that are views into the buckets being freed get memory of
  // their own (the buckets being allocated adopt them again below).
  for (size_t i = 0; i < params_.size() && !owner_; ++i) {
    auto& grad = params_[i].mutable_grad();
    const auto& buffer = buckets_[slots_[i].bucket].buffer;
    if (grad.defined() && buffer.defined() && grad.is_alias_of(buffer)) grad = grad.clone();
  }
  owner_ = owner;
  std::vector<size_t> order;
  for (const auto& b : buckets_) order.insert(order.end(), b.params.begin(), b.params.end());
  build_buckets(order);
}

std::vector<std::vector<size_t>> GradientReducer::bucket_layout() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

void GradientReducer::register_comm_hook(std::shared_ptr<CommHook> hook) {
  if (!hook) {
    throw InvalidArgument("DistributedDataParallel: register_comm_hook on rank " +
                          std::to_string(comm_->rank()) + " got a null hook");
  }
  refuse_with_leaves("register_comm_hook");
  hook_ = std::move(hook);
}

}  // namespace cohort
