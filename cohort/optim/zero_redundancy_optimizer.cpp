// ZeroRedundancyOptimizer: construction and one step (gradients, update,
// all-gather). The sharded checkpoint half is in zero_checkpoint.cpp.
#include "cohort/optim/zero_redundancy_optimizer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <numeric>

#include "cohort/core/error.h"
#include "cohort/optim/optimizer_state.h"

namespace cohort {
namespace {

// A post hook on a parameter's gradient accumulator, as DDP's: it runs after
// AccumulateGrad, so .grad holds the gradient accumulated over earlier
// (no_sync) backwards as well, which is what must be reduced. (A tensor
// hook would see only this backward's contribution.)
class ZeroReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ZeroReadyHook(ZeroRedundancyOptimizer* zero, size_t index) : zero_(zero), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    zero_->on_gradient_ready(index_);
    return outputs;
  }

 private:
  ZeroRedundancyOptimizer* zero_;
  size_t index_;
};

}  // namespace

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
    staging_buffer_ =
        std::make_unique<StagingBuffer>(partition_->padded_numel(), flat_params_.options());
    const auto& buckets = partition_->buckets();
    bucket_params_.resize(buckets.size());
    param_buckets_.resize(params_.size());
    pending_init_.assign(buckets.size(), 0);
    staged_.assign(params_.size(), 0);
    has_.assign(params_.size(), 0);
    for (size_t b = 0; b < buckets.size(); ++b) {
      for (size_t i = 0; i < params_.size(); ++i) {
        const auto& prm = partition_->params()[i];
        if (prm.numel > 0 && prm.offset < buckets[b].offset + buckets[b].numel &&
            prm.offset + prm.numel > buckets[b].offset) {
          bucket_params_[b].push_back(i);
          param_buckets_[i].push_back(b);
          // Only parameters that can get a gradient are waited for; the
          // others are zeros when their bucket goes.
          if (params_[i].requires_grad()) ++pending_init_[b];
        }
      }
    }
    if (options_.reduce_gradients) hook_accumulators();
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
  for (size_t k = 0; k < hooks_.size(); ++k) accumulators_[k]->del_post_hook(hooks_[k].second);
  if (ddp_) ddp_->set_reduction_owner(nullptr);
}

void ZeroRedundancyOptimizer::hook_accumulators() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) continue;
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    hooks_.emplace_back(i, acc->add_post_hook(std::make_unique<ZeroReadyHook>(this, i)));
    accumulators_.push_back(std::move(acc));
  }
}

void ZeroRedundancyOptimizer::take_over_reduction(GradientReducer& ddp) {
  if (options_.stage != 2 || options_.reduce_gradients) {
    throw InvalidArgument(where("take_over_reduction") +
                          ": only stage 2 with reduce_gradients = false reduces for DDP (stage 1 "
                          "reads DDP's averaged gradients)");
  }
  if (&ddp.communicator() != comm_.get()) {
    throw InvalidArgument(where("take_over_reduction") +
                          ": DDP reduces over another communicator (" + ddp.communicator().name() +
                          ")");
  }
  if (ddp_) throw InvalidArgument(where("take_over_reduction") + ": already reducing for a DDP");
  if (comm_->size() == 1) return;  // nothing to reduce: .grad is read as it is
  std::map<const void*, size_t> ours;
  for (size_t i = 0; i < params_.size(); ++i) ours[params_[i].unsafeGetTensorImpl()] = i;
  const auto& theirs = ddp.parameters();
  from_ddp_.assign(theirs.size(), 0);
  for (size_t k = 0; k < theirs.size(); ++k) {
    auto it = ours.find(theirs[k].unsafeGetTensorImpl());
    if (it == ours.end()) {
      throw InvalidArgument(where("take_over_reduction") + ": DDP's parameter '" +
                            ddp.parameter_names()[k] +
                            "' is not one of this optimizer's; pass ddp.parameters()");
    }
    from_ddp_[k] = it->second;
  }
  ddp.set_reduction_owner(this);
  ddp_ = &ddp;
}

std::vector<torch::optim::OptimizerParamGroup>& ZeroRedundancyOptimizer::param_groups() {
  return inner_->param_groups();
}

void ZeroRedundancyOptimizer::set_lr(double lr) {
  for (auto& group : inner_->param_groups()) group.options().set_lr(lr);
}

void ZeroRedundancyOptimizer::zero_grad() {
  // A backward whose reduction was never finished is dropped (its
  // reduce-scatters were launched alike on every rank; wait for them).
  if (staging_.defined()) {
    for (auto& w : rs_work_) w.wait();
    sync_.abandon();
    release_iteration();
  }
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  for (auto& t : pieces_) t.mutable_grad() = torch::Tensor();
  reduced_ = false;
}

void ZeroRedundancyOptimizer::finish_gradients() {
  if (reduced_) return;
  reduce_gradients();
  reduced_ = true;
}

void ZeroRedundancyOptimizer::step() {
  finish_gradients();
  reduced_ = false;
  if (comm_->size() == 1) {
    inner_->step();  // the shard is the whole buffer
    return;
  }
  step_and_all_gather();
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
  // Stage 2 reduces alone or for DDP; stage 1 only alone.
  const bool reduce = comm_->size() > 1 && (options_.stage == 2 || options_.reduce_gradients);

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
      sync_.bucket_issued();
    }
    sync_.blocked([&] { wait_all(works); });
    sync_.sync_done();
    for (size_t k = 0; k < pieces.size(); ++k) {
      const auto& prm = part.params()[pieces[k].param];
      pieces_[k].mutable_grad() =
          has[pieces[k].param]
              ? flat_grads_.narrow(0, prm.offset + pieces[k].param_offset, pieces[k].numel)
              : torch::Tensor();
    }
  }
}

// Stage 2. When a parameter's gradient is ready (its accumulator's post
// hook alone, DDP's report with DDP) it is copied into the flat staging
// buffer and its .grad becomes a view of that copy (autograd's tensor is
// freed: one copy of the gradients, as DDP's buckets). A bucket is
// reduce-scattered into this rank's shard as soon as all its parameters
// are in, from the last bucket down (the order backward fills them; the
// same on every rank, so the collectives match), so the reduction overlaps
// the rest of backward, as DDP's all-reduce does. finish_gradients()
// launches what backward did not, waits, and releases the .grad views and
// the staging buffer: between steps a rank holds only its gradient shard.
void ZeroRedundancyOptimizer::begin_iteration() {
  staging_ = staging_buffer_->acquire();
  pending_ = pending_init_;
  std::fill(staged_.begin(), staged_.end(), 0);
  std::fill(has_.begin(), has_.end(), 0);
  rs_work_.assign(partition_->buckets().size(), Work());
  next_launch_ = static_cast<int64_t>(partition_->buckets().size()) - 1;
  twice_ = false;
}

void ZeroRedundancyOptimizer::release_iteration() {
  for (auto& p : params_) {
    auto& g = p.mutable_grad();
    if (g.defined() && g.is_alias_of(staging_)) g = torch::Tensor();
  }
  staging_ = torch::Tensor();
  rs_work_.clear();  // the finished collectives' hold on the buffer
  staging_buffer_->release();
}

void ZeroRedundancyOptimizer::on_gradient_ready(size_t i) {
  if (no_sync_depth_ > 0) return;  // accumulate locally in .grad
  stage_gradient(i);
  launch_ready_buckets(false);
}

void ZeroRedundancyOptimizer::gradient_ready(size_t ddp_index) {
  stage_gradient(from_ddp_[ddp_index]);
  launch_ready_buckets(false);
}

void ZeroRedundancyOptimizer::backward_finished() {
  if (staging_.defined()) launch_ready_buckets(true);
}

void ZeroRedundancyOptimizer::stage_gradient(size_t i) {
  torch::NoGradGuard no_grad;
  if (!staging_.defined()) begin_iteration();
  if (staged_[i]) {
    // A second backward before step(): its bucket may be on the wire.
    twice_ = true;
    return;
  }
  const auto& prm = partition_->params()[i];
  auto view = staging_.narrow(0, prm.offset, prm.numel);
  auto& g = params_[i].mutable_grad();
  if (g.defined()) {
    view.copy_(g.reshape(-1));
    g = view.view(params_[i].sizes());
    has_[i] = 1;
  } else {
    view.zero_();  // unused here (DDP reports it): zeros, as in DDP
  }
  staged_[i] = 1;
  for (size_t b : param_buckets_[i]) {
    if (params_[i].requires_grad()) --pending_[b];
  }
}

void ZeroRedundancyOptimizer::launch_ready_buckets(bool all) {
  torch::NoGradGuard no_grad;
  const auto& part = *partition_;
  while (next_launch_ >= 0 && (all || pending_[next_launch_] == 0)) {
    const auto b = static_cast<size_t>(next_launch_--);
    const auto& bucket = part.buckets()[b];
    // Parameters without a gradient this iteration count as zeros, and so
    // does the padding.
    for (size_t i : bucket_params_[b]) {
      if (staged_[i]) continue;
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
    sync_.bucket_issued();
  }
}

void ZeroRedundancyOptimizer::reduce_scatter_gradients() {
  torch::NoGradGuard no_grad;
  if (!options_.reduce_gradients && !ddp_) {
    throw Error(where("step") +
                ": stage 2 with reduce_gradients = false reduces for cohort DDP, but no DDP "
                "handed its reduction over (build it with make(ddp, ...) or call "
                "take_over_reduction(ddp.reducer()))");
  }
  if (!staging_.defined()) begin_iteration();
  // Gradients that did not come through a synchronizing backward: set by
  // hand, or accumulated under no_sync() with no backward after it.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!staged_[i] && params_[i].grad().defined()) stage_gradient(i);
  }
  launch_ready_buckets(true);
  const auto has = globally_has_grad_from(has_);
  sync_.blocked([&] {
    for (auto& w : rs_work_) w.wait();
  });
  sync_.sync_done();
  const bool twice = twice_;
  release_iteration();
  if (twice) {
    throw Error(where("step") +
                ": a parameter got a second gradient before step(); stage 2 reduces during "
                "backward, so accumulate with no_sync() (ddp.no_sync() with DDP) around all "
                "but the last backward");
  }
  const auto& pieces = partition_->pieces();
  for (size_t k = 0; k < pieces.size(); ++k) {
    pieces_[k].mutable_grad() =
        has[pieces[k].param] ? shard_grads_.narrow(0, pieces[k].shard_offset, pieces[k].numel)
                             : torch::Tensor();
  }
}

// The inner optimizer steps one bucket's pieces at a time (the other
// pieces' .grad hidden meanwhile), and each bucket's all-gather is launched
// as soon as its pieces are updated, so it overlaps the updates of the
// buckets after it. LibTorch's optimizers update every parameter from its
// own gradient and state only (a parameter without .grad is skipped), so
// stepping the pieces bucket by bucket equals stepping them all at once.
void ZeroRedundancyOptimizer::step_and_all_gather() {
  torch::NoGradGuard no_grad;
  const auto& buckets = partition_->buckets();
  const auto& pieces = partition_->pieces();
  std::vector<torch::Tensor> grads;
  for (auto& t : pieces_) grads.push_back(t.grad());
  std::vector<Work> works;
  size_t k = 0;  // pieces are ordered by shard offset, so by bucket
  for (size_t b = 0; b < buckets.size(); ++b) {
    const size_t first = k;
    while (k < pieces.size() && pieces[k].bucket == b) ++k;
    if (k > first) {
      for (size_t j = 0; j < pieces_.size(); ++j) {
        pieces_[j].mutable_grad() = j >= first && j < k ? grads[j] : torch::Tensor();
      }
      inner_->step();
    }
    // This rank's chunk, in place inside the output: the algorithms skip
    // copying it onto itself, Gloo reads it before writing the output, MPI
    // passes MPI_IN_PLACE.
    auto in = flat_params_.narrow(0, partition_->chunk_offset(b), buckets[b].chunk);
    auto out = flat_params_.narrow(0, buckets[b].offset, buckets[b].padded);
    AllGatherOptions opts;
    opts.algo = options_.gather_algo;
    works.push_back(comm_->all_gather_into_tensor(out, in, opts));
  }
  for (size_t j = 0; j < pieces_.size(); ++j) pieces_[j].mutable_grad() = grads[j];
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
