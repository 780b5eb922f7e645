// ZeroRedundancyOptimizer: construction and one step (gradients, update,
// all-gather). The sharded checkpoint half is in zero_checkpoint.cpp.
#include "cohort/optim/zero_redundancy_optimizer.h"

#include <algorithm>
#include <numeric>

#include "cohort/comm/error.h"
#include "cohort/optim/optimizer_state.h"

namespace cohort {

std::string ZeroRedundancyOptimizer::where(const std::string& op) const {
  return "ZeroRedundancyOptimizer::" + op + " (rank " + std::to_string(comm_->rank()) + " of " +
         std::to_string(comm_->size()) + ", group " + comm_->name() + ")";
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    std::vector<torch::optim::OptimizerParamGroup> groups, Factory factory,
    std::shared_ptr<Communicator> comm, ZeroOptions options)
    : comm_(std::move(comm)), options_(options) {
  if (options_.stage != 1 && options_.stage != 2) {
    throw InvalidArgument(where("constructor") + ": stage must be 1 or 2, got " +
                          std::to_string(options_.stage));
  }
  if (options_.stage == 2 && !options_.reduce_gradients) {
    throw InvalidArgument(where("constructor") +
                          ": stage 2 reduce-scatters the gradients itself (reduce_gradients "
                          "must be true; do not all-reduce them with DDP first)");
  }
  std::vector<int64_t> numels;
  std::vector<size_t> group_of;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      if (!p.is_floating_point() || p.is_sparse() || !p.device().is_cpu()) {
        throw Unsupported(where("constructor") +
                          ": parameters must be dense floating-point CPU tensors");
      }
      if (!params_.empty() && p.scalar_type() != params_[0].scalar_type()) {
        throw Unsupported(where("constructor") + ": all parameters must share one dtype (" +
                          std::string(c10::toString(params_[0].scalar_type())) + " and " +
                          c10::toString(p.scalar_type()) + " found)");
      }
      params_.push_back(p);
      numels.push_back(p.numel());
      group_of.push_back(g);
    }
  }
  if (params_.empty()) throw InvalidArgument(where("constructor") + ": no parameters");

  // Every rank must lay out the same flat buffer, or the collectives would
  // silently mix unrelated elements.
  const int world = comm_->size();
  auto mine = torch::tensor({static_cast<int64_t>(params_.size()),
                             std::accumulate(numels.begin(), numels.end(), int64_t{0})});
  if (world > 1) {
    auto all = torch::empty({world * 2}, torch::kLong);
    comm_->all_gather_into_tensor(all, mine).wait();
    for (int r = 0; r < world; ++r) {
      if (!all.narrow(0, 2 * r, 2).equal(mine)) {
        throw MismatchError(where("constructor") + ": rank " + std::to_string(r) + " has " +
                            std::to_string(all[2 * r].item<int64_t>()) + " parameters of " +
                            std::to_string(all[2 * r + 1].item<int64_t>()) +
                            " elements, this rank " + std::to_string(mine[0].item<int64_t>()) +
                            " of " + std::to_string(mine[1].item<int64_t>()));
      }
    }
  }

  const int64_t elem = params_[0].element_size();
  const auto bucket_elements =
      static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024 / static_cast<double>(elem));
  partition_ = std::make_unique<FlatPartition>(numels, group_of, world, comm_->rank(),
                                               std::max<int64_t>(bucket_elements, 1));

  // Parameters become views into one flat buffer, so that the all-gather
  // writes the new values in place and a piece is a plain slice.
  torch::NoGradGuard no_grad;
  flat_params_ = torch::zeros({partition_->padded_numel()}, params_[0].options());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto view = flat_params_.narrow(0, partition_->params()[i].offset, numels[i]);
    view.copy_(params_[i].reshape(-1));
    params_[i].set_data(view.view(params_[i].sizes()));
  }
  if (options_.stage == 2 && world > 1) {
    shard_grads_ = torch::zeros({partition_->shard_numel()}, flat_params_.options());
    const auto& buckets = partition_->buckets();
    bucket_params_.resize(buckets.size());
    param_buckets_.resize(params_.size());
    pending_init_.assign(buckets.size(), 0);
    seen_.assign(params_.size(), 0);
    for (size_t b = 0; b < buckets.size(); ++b) {
      for (size_t i = 0; i < params_.size(); ++i) {
        const auto& prm = partition_->params()[i];
        if (prm.numel > 0 && prm.offset < buckets[b].offset + buckets[b].numel &&
            prm.offset + prm.numel > buckets[b].offset) {
          bucket_params_[b].push_back(i);
          param_buckets_[i].push_back(b);
          ++pending_init_[b];
        }
      }
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].requires_grad()) continue;
      hooks_.emplace_back(
          i, params_[i].register_hook([this, i](torch::Tensor g) { return on_gradient(i, g); }));
    }
  } else if (options_.reduce_gradients && world > 1) {
    flat_grads_ = torch::zeros({partition_->padded_numel()}, flat_params_.options());
  }

  std::vector<std::vector<torch::Tensor>> shard_params(groups.size());
  for (const auto& piece : partition_->pieces()) {
    const auto& param = partition_->params()[piece.param];
    // detach(): a leaf sharing the flat buffer's storage.
    auto t = flat_params_.narrow(0, param.offset + piece.param_offset, piece.numel).detach();
    pieces_.push_back(t);
    shard_params[param.group].push_back(t);
  }
  std::vector<torch::optim::OptimizerParamGroup> shard_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].has_options()) {
      shard_groups.emplace_back(shard_params[g], groups[g].options().clone());
    } else {
      shard_groups.emplace_back(shard_params[g]);
    }
  }
  inner_ = factory(std::move(shard_groups));
  if (!inner_ || inner_->param_groups().size() != groups.size()) {
    throw InvalidArgument(where("constructor") +
                          ": the factory must build one group per shard group");
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() {
  for (const auto& [i, key] : hooks_) params_[i].remove_hook(key);
}

std::vector<torch::optim::OptimizerParamGroup>& ZeroRedundancyOptimizer::param_groups() {
  return inner_->param_groups();
}

void ZeroRedundancyOptimizer::set_lr(double lr) {
  for (auto& group : inner_->param_groups()) group.options().set_lr(lr);
}

void ZeroRedundancyOptimizer::zero_grad() {
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  for (auto& t : pieces_) t.mutable_grad() = torch::Tensor();
}

void ZeroRedundancyOptimizer::step() {
  reduce_gradients();
  inner_->step();
  all_gather_parameters();
}

std::vector<char> ZeroRedundancyOptimizer::globally_has_grad() {
  std::vector<char> local(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) local[i] = params_[i].grad().defined() ? 1 : 0;
  return globally_has_grad_from(local);
}

std::vector<char> ZeroRedundancyOptimizer::globally_has_grad_from(const std::vector<char>& local) {
  // A parameter with a gradient on any rank is reduced (missing ones count
  // as zeros, as in DDP); one with none anywhere is skipped by the inner
  // optimizer, as LibTorch's optimizers skip an undefined .grad.
  auto mask = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kInt);
  auto* m = mask.data_ptr<int>();
  for (size_t i = 0; i < params_.size(); ++i) m[i] = local[i];
  if (comm_->size() > 1) comm_->all_reduce(mask, {ReduceOp::Max}).wait();
  return std::vector<char>(m, m + params_.size());
}

void ZeroRedundancyOptimizer::reduce_gradients() {
  torch::NoGradGuard no_grad;
  const auto& part = *partition_;
  const auto& pieces = part.pieces();
  const bool reduce = options_.reduce_gradients && comm_->size() > 1;

  if (!reduce) {
    // The gradients are already averaged (stage 1 after DDP), or there is
    // nothing to average (world 1, either stage): read slices of .grad.
    for (size_t k = 0; k < pieces.size(); ++k) {
      const auto& g = params_[pieces[k].param].grad();
      pieces_[k].mutable_grad() =
          g.defined() ? g.reshape(-1).narrow(0, pieces[k].param_offset, pieces[k].numel)
                      : torch::Tensor();
    }
    return;
  }

  if (options_.stage == 2) {
    reduce_scatter_gradients();
  } else {
    all_reduce_gradients();
  }
}

// Stage 1 alone: all-reduce bucket by bucket into the full flat gradient
// buffer; a bucket is launched as soon as its gradients are in.
void ZeroRedundancyOptimizer::all_reduce_gradients() {
  torch::NoGradGuard no_grad;
  const auto& part = *partition_;
  const auto& pieces = part.pieces();
  const auto has = globally_has_grad();
  const auto& buckets = part.buckets();
  auto copy_in = [&](torch::Tensor& dst, int64_t dst_flat_offset, size_t i, int64_t lo,
                     int64_t hi) {
    // Elements [lo, hi) of the flat buffer that belong to parameter i.
    const auto& prm = part.params()[i];
    const int64_t a = std::max(lo, prm.offset), e = std::min(hi, prm.offset + prm.numel);
    if (e <= a) return;
    auto out = dst.narrow(0, a - dst_flat_offset, e - a);
    const auto& g = params_[i].grad();
    if (g.defined()) {
      out.copy_(g.reshape(-1).narrow(0, a - prm.offset, e - a));
    } else {
      out.zero_();
    }
  };

  {
    std::vector<Work> works;
    size_t first_param = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      const int64_t lo = buckets[b].offset, hi = lo + buckets[b].numel;
      for (size_t i = first_param; i < params_.size() && part.params()[i].offset < hi; ++i) {
        copy_in(flat_grads_, 0, i, lo, hi);
      }
      while (first_param < params_.size() &&
             part.params()[first_param].offset + part.params()[first_param].numel <= hi) {
        ++first_param;
      }
      auto view = flat_grads_.narrow(0, lo, buckets[b].padded);
      works.push_back(comm_->all_reduce(view, {ReduceOp::Avg}));
    }
    for (auto& w : works) w.wait();
    for (size_t k = 0; k < pieces.size(); ++k) {
      const auto& prm = part.params()[pieces[k].param];
      pieces_[k].mutable_grad() =
          has[pieces[k].param]
              ? flat_grads_.narrow(0, prm.offset + pieces[k].param_offset, pieces[k].numel)
              : torch::Tensor();
    }
  }
}

// Stage 2. A hook on every parameter copies its gradient into the flat
// staging buffer as backward produces it and hands autograd a view of that
// buffer as the .grad (so autograd allocates no second copy). A bucket is
// reduce-scattered into this rank's shard as soon as all its parameters
// are in, from the last bucket down (the order backward fills them, the
// same on every rank), so the reduction overlaps the rest of backward, as
// DDP's all-reduce does. step() launches what backward did not, then the
// .grad views and the staging buffer are released: between steps a rank
// holds only its gradient shard.
void ZeroRedundancyOptimizer::begin_iteration() {
  staging_ = torch::empty({partition_->padded_numel()}, flat_params_.options());
  pending_ = pending_init_;
  std::fill(seen_.begin(), seen_.end(), 0);
  rs_work_.assign(partition_->buckets().size(), Work());
  next_launch_ = static_cast<int64_t>(partition_->buckets().size()) - 1;
  twice_ = false;
}

torch::Tensor ZeroRedundancyOptimizer::on_gradient(size_t i, const torch::Tensor& grad) {
  torch::NoGradGuard no_grad;
  if (!staging_.defined()) begin_iteration();
  if (seen_[i]) {
    // A second backward before step(): its bucket may be on the wire.
    twice_ = true;
    return {};
  }
  const auto& prm = partition_->params()[i];
  auto view = staging_.narrow(0, prm.offset, prm.numel);
  view.copy_(grad.reshape(-1));
  stage_param(i);
  launch_ready_buckets(false);
  return view.view(grad.sizes());
}

void ZeroRedundancyOptimizer::stage_param(size_t i) {
  seen_[i] = 1;
  for (size_t b : param_buckets_[i]) --pending_[b];
}

void ZeroRedundancyOptimizer::launch_ready_buckets(bool all) {
  const auto& part = *partition_;
  while (next_launch_ >= 0 && (all || pending_[next_launch_] == 0)) {
    const auto b = static_cast<size_t>(next_launch_--);
    const auto& bucket = part.buckets()[b];
    // Parameters without a gradient this iteration count as zeros, and so
    // does the padding.
    for (size_t i : bucket_params_[b]) {
      if (seen_[i]) continue;
      const auto& prm = part.params()[i];
      const int64_t lo = std::max(bucket.offset, prm.offset);
      const int64_t hi = std::min(bucket.offset + bucket.numel, prm.offset + prm.numel);
      staging_.narrow(0, lo, hi - lo).zero_();
    }
    if (bucket.padded > bucket.numel) {
      staging_.narrow(0, bucket.offset + bucket.numel, bucket.padded - bucket.numel).zero_();
    }
    auto out = shard_grads_.narrow(0, bucket.shard_offset, bucket.chunk);
    rs_work_[b] = comm_->reduce_scatter_tensor(
        out, staging_.narrow(0, bucket.offset, bucket.padded), {ReduceOp::Avg});
  }
}

void ZeroRedundancyOptimizer::reduce_scatter_gradients() {
  torch::NoGradGuard no_grad;
  if (!staging_.defined()) begin_iteration();
  // Gradients that did not come through the hooks (set by hand).
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    if (seen_[i] || !g.defined()) continue;
    const auto& prm = partition_->params()[i];
    staging_.narrow(0, prm.offset, prm.numel).copy_(g.reshape(-1));
    stage_param(i);
  }
  launch_ready_buckets(true);
  const auto has = globally_has_grad_from(seen_);
  for (auto& w : rs_work_) w.wait();
  const bool twice = twice_;
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  staging_ = torch::Tensor();
  if (twice) {
    throw Error(where("step") +
                ": stage 2 reduces gradients during backward, so it needs step() after every "
                "backward (a parameter got a second gradient); accumulate with stage 1");
  }
  const auto& pieces = partition_->pieces();
  for (size_t k = 0; k < pieces.size(); ++k) {
    pieces_[k].mutable_grad() =
        has[pieces[k].param] ? shard_grads_.narrow(0, pieces[k].shard_offset, pieces[k].numel)
                             : torch::Tensor();
  }
}

void ZeroRedundancyOptimizer::all_gather_parameters() {
  if (comm_->size() == 1) return;  // the shard is the whole buffer
  torch::NoGradGuard no_grad;
  const auto& buckets = partition_->buckets();
  std::vector<Work> works;
  std::vector<torch::Tensor> inputs;
  for (size_t b = 0; b < buckets.size(); ++b) {
    // A copy of this rank's chunk: the output buffer contains it.
    inputs.push_back(flat_params_.narrow(0, partition_->chunk_offset(b), buckets[b].chunk).clone());
    auto out = flat_params_.narrow(0, buckets[b].offset, buckets[b].padded);
    works.push_back(comm_->all_gather_into_tensor(out, inputs.back()));
  }
  for (auto& w : works) w.wait();
}

int64_t ZeroRedundancyOptimizer::state_bytes() const { return optimizer_state_bytes(*inner_); }

std::vector<torch::Tensor> ZeroRedundancyOptimizer::grad_buffers() const {
  std::vector<torch::Tensor> out;
  if (flat_grads_.defined()) out.push_back(flat_grads_);
  if (shard_grads_.defined()) out.push_back(shard_grads_);
  if (staging_.defined()) out.push_back(staging_);
  return out;
}

int64_t ZeroRedundancyOptimizer::grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& t : grad_buffers()) bytes += t.nbytes();
  return bytes;
}

}  // namespace cohort
