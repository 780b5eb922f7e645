// GradientReducer, Determinism::WorldSizeInvariant: one forward and backward
// per leaf, each gradient folded into the leaf sums of the canonical tree as
// it is computed (LeafBuckets, on grad_sync's LeafReduction; an owner takes
// whole leaves), each bucket's exchange and all-gather run by a worker
// thread from the last leaf's backward on, and the buffers of the global batch's first leaf kept.
// Design: cohort/ddp/README.md.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/engine.h>

#include "cohort/core/error.h"
#include "cohort/core/serial_worker.h"
#include "cohort/grad_sync/flat_views.h"
#include "cohort/grad_sync/gradient_presence.h"
#include "cohort/grad_sync/gradient_reducer.h"
#include "cohort/grad_sync/leaf_buckets.h"

namespace cohort {

void GradientReducer::setup_leaves() {
  const std::string where =
      " on rank " + std::to_string(comm_->rank()) + " of " + std::to_string(comm_->size());
  if (options_.leaves < 1) {
    throw InvalidArgument(
        "DistributedDataParallel: determinism WorldSizeInvariant needs leaves >= 1" + where +
        ", got " + std::to_string(options_.leaves));
  }
  if (options_.compression.kind != compression::CompressionKind::None ||
      options_.strategy == SyncStrategy::NoSync) {
    throw InvalidArgument("DistributedDataParallel: determinism WorldSizeInvariant" + where +
                          " takes neither compression nor SyncStrategy::NoSync");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].is_floating_point() || params_[i].scalar_type() != params_[0].scalar_type()) {
      throw InvalidArgument("DistributedDataParallel: determinism WorldSizeInvariant" + where +
                            " needs parameters of one floating dtype; '" + names_[i] + "' is " +
                            std::string(c10::toString(params_[i].scalar_type())));
    }
  }
  // Every rank must split the batch alike, or the exchange mixes leaves.
  auto mine = torch::full({1}, options_.leaves, torch::kLong);
  auto all = torch::empty({comm_->size()}, torch::kLong);
  comm_->all_gather_into_tensor(all, mine).wait();
  for (int r = 0; r < comm_->size(); ++r) {
    if (all[r].item<int64_t>() != options_.leaves) {
      throw MismatchError("DistributedDataParallel: leaves = " + std::to_string(options_.leaves) +
                          where + " but rank " + std::to_string(r) + " has " +
                          std::to_string(all[r].item<int64_t>()));
    }
  }
  leaf_ = std::make_unique<LeafReduction>(options_.leaves, comm_->rank(), comm_->size(),
                                          "DistributedDataParallel");
}

void GradientReducer::refuse_with_leaves(const std::string& what) const {
  if (!leaf_) return;
  throw InvalidArgument("DistributedDataParallel: " + what + " on rank " +
                        std::to_string(comm_->rank()) +
                        " is refused with determinism WorldSizeInvariant (it would change the "
                        "order of the gradient sums)");
}

void GradientReducer::keep_buffers(std::vector<torch::Tensor>& into) {
  buffers_ = module_->buffers(/*recurse=*/true);
  into.clear();
  for (const auto& b : buffers_) into.push_back(b.detach().clone());
}

void GradientReducer::restore_buffers(const std::vector<torch::Tensor>& from) {
  buffers_ = module_->buffers(/*recurse=*/true);
  COHORT_CHECK(from.size() == buffers_.size(), "the module's buffers changed within a step");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < from.size(); ++i) buffers_[i].detach().copy_(from[i]);
}

void GradientReducer::prepare_leaf_forward() {
  if (no_sync_depth_ > 0) refuse_with_leaves("no_sync()");
  reset_iteration();
  sync_this_iteration_ = true;
  // An evaluation forward leaves the buffers as the last step made them
  // (the same on every rank).
  if (!torch::GradMode::is_enabled() || !module_->is_training()) return;
  if (leaf_->pushed() == 0) {
    keep_buffers(step_buffers_);
    first_leaf_buffers_.clear();
    // Every leaf's backward starts from undefined gradients, so
    // AccumulateGrad stores the leaf's gradient as computed: the same bits
    // whichever leaf ran before it on this rank (0 + g would turn -0 into +0).
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    return;
  }
  // Each leaf's forward sees the step's starting buffers; what the step
  // keeps is the first leaf's update (rank 0's is leaf 0's).
  if (leaf_->pushed() == 1) keep_buffers(first_leaf_buffers_);
  restore_buffers(step_buffers_);
}

void GradientReducer::on_leaf_gradient(size_t index) {
  if (!backward_started_) {
    backward_started_ = true;
    backward_finished_ = false;
    forward_awaits_backward_ = false;
    if (leaf_->pushed() == 0) start_iteration_clock();
    torch::autograd::Engine::get_default_engine().queue_callback(
        [this] { finish_leaf_backward(); });
  }
  if (ready_[index]) {
    throw InvalidArgument("DistributedDataParallel: parameter '" + names_[index] + "' on rank " +
                          std::to_string(comm_->rank()) +
                          " got a gradient twice in one leaf (two backward passes over one "
                          "forward); with WorldSizeInvariant run one forward per leaf");
  }
  ready_[index] = 1;
  locally_used_[index] = 1;
  // An owner takes whole leaves (finish_owner_leaf()).
  if (!owner_) fold_leaf_gradient(index, leaf_->pushed() + 1 == leaf_->local_leaves());
}

void GradientReducer::fold_leaf_gradient(size_t index, bool last_leaf) {
  if (!leaf_buckets_) {
    leaf_buckets_ = std::make_unique<LeafBuckets>(params_, bucket_layout(), *leaf_, comm_->size());
  }
  auto& grad = params_[index].mutable_grad();
  leaf_buckets_->fold(index, leaf_->pushed(), grad);
  // Released at once: the next leaf's AccumulateGrad stores its gradient as
  // computed, and the memory serves the gradients still to come.
  grad = torch::Tensor();
  if (!last_leaf) return;
  // The rank's subtree sums of a bucket are complete: its exchange goes
  // while backward computes the rest (buckets in index order on every rank).
  if (queue_.arrive(slots_[index].bucket)) {
    queue_.launch_ready([this](size_t b) { return launch_leaf_bucket(b); });
  }
  queue_.poll();
}

Work GradientReducer::launch_leaf_bucket(size_t b) {
  if (comm_->size() == 1) return leaf_buckets_->exchange(*comm_, b);
  // One job per bucket on a thread of DDP's own: the exchange, its wait, the
  // tree's completion on this rank's chunk and the all-gather's start. So
  // the collectives go out in one order on every rank (exchange b, gather b,
  // exchange b + 1, ...) however the exchanges' completions fall, a gather
  // starts while backward goes on, and backward never waits for a peer.
  // While jobs run the communicator belongs to the worker: the step issues
  // nothing of its own before finish_leaf_exchange() has waited for them.
  if (!leaf_worker_) {
    SerialWorker::Options options;
    options.refusal = "an earlier bucket of this DDP failed";
    // The intra-op thread count is per thread under OpenMP: take it over.
    options.on_start = [] { at::init_num_threads(); };
    leaf_worker_ = std::make_unique<SerialWorker>(std::move(options));
    leaf_gathers_.assign(buckets_.size(), Work());
  }
  OpContext context;
  context.op = "DistributedDataParallel leaf exchange (bucket " + std::to_string(b) + ")";
  context.group = comm_->name();
  context.rank = comm_->rank();
  context.size = comm_->size();
  context.all_peers = true;
  context.timeout = comm_->timeout();
  // leaf_gathers_[b] is written here and read only after this job's Work was waited for.
  auto job = leaf_worker_->submit(context.op, SerialWorker::Clock::time_point::min(), [this, b] {
    torch::NoGradGuard no_grad;  // grad mode is per thread
    leaf_buckets_->exchange(*comm_, b).wait();
    leaf_gathers_[b] = leaf_buckets_->gather(*comm_, b);
  });
  return Work(std::move(job), std::move(context));
}

void GradientReducer::finish_leaf_backward() {
  backward_finished_ = true;
  torch::NoGradGuard no_grad;
  if (owner_) {
    finish_owner_leaf();
    return;
  }
  const bool last = leaf_->pushed() + 1 == leaf_->local_leaves();
  // No gradient in this leaf: zeros, the same on every rank.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) fold_leaf_gradient(i, last);
  }
  leaf_->count_folded();
  if (last) finish_leaf_exchange(queue_.now_s());
}

void GradientReducer::finish_leaf_exchange(double backward_end) {
  TraceSpan span(active(comm_->tracer()), "wait and write back", "ddp");
  // Every bucket was launched as its last gradient came; its job started
  // its all-gather (launch_leaf_bucket()).
  while (queue_.in_flight() > 0) queue_.retire_oldest();
  wait_all(leaf_gathers_);
  std::fill(leaf_gathers_.begin(), leaf_gathers_.end(), Work());
  leaf_->restart();
  // As in the default mode: a parameter that no leaf on any rank used keeps
  // an undefined .grad (its mean, zeros, would still be stepped by Adam's
  // moments and weight decay). Issued after the jobs: the communicator is
  // this thread's again.
  const auto used = any_rank_has(*comm_, locally_used_);
  clear_local_use();
  const auto& mean = leaf_buckets_->mean();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!used[i]) {
      params_[i].mutable_grad() = torch::Tensor();
    } else {
      params_[i].mutable_grad() = options_.gradient_as_bucket_view ? mean[i] : mean[i].clone();
    }
  }
  stats_.hidden_comm_seconds = queue_.busy_seconds(backward_end);
  stats_.total_hidden_comm_seconds += stats_.hidden_comm_seconds;
  finish_leaf_step(backward_end, leaf_buckets_->bytes());
}

void GradientReducer::abandon_leaf_step() noexcept {
  // The queue's jobs were drained by the caller; they started these.
  for (auto& gather : leaf_gathers_) {
    try {
      gather.wait();
    } catch (const std::exception&) {
    }
    gather = Work();
  }
  leaf_->abandon();
  // Each leaf of the step began from these (prepare_leaf_forward()); a
  // module whose buffers changed since keeps its own.
  try {
    if (!step_buffers_.empty()) restore_buffers(step_buffers_);
  } catch (const std::exception&) {
  }
  step_buffers_.clear();
  first_leaf_buffers_.clear();
}

void GradientReducer::finish_owner_leaf() {
  std::vector<torch::Tensor> pieces;
  pieces.reserve(params_.size());
  for (auto& p : params_) {
    auto& grad = p.mutable_grad();
    // No gradient in this leaf: zeros, the same on every rank.
    pieces.push_back(grad.defined() ? grad.reshape({-1}) : torch::zeros({p.numel()}, p.options()));
    grad = torch::Tensor();
  }
  leaf_->push(torch::cat(pieces));
  if (leaf_->pushed() < leaf_->local_leaves()) return;
  const double backward_end = queue_.now_s();
  // A shard owner (ZeRO-2) keeps its chunk: no all-gather, no .grad. As
  // without an owner, a parameter that no leaf on any rank used must stay
  // without a gradient (its zeros would still be stepped by Adam's moments
  // and weight decay): the owner gets the same bitmap.
  auto chunk = leaf_->finish_chunk(*comm_);
  auto used = any_rank_has(*comm_, locally_used_);
  clear_local_use();
  owner_->leaf_chunk_ready(chunk, std::move(used));
  stats_.hidden_comm_seconds = 0;
  finish_leaf_step(backward_end, chunk.numel() * chunk.element_size());
}

void GradientReducer::finish_leaf_step(double backward_end, int64_t bytes) {
  if (!first_leaf_buffers_.empty()) restore_buffers(first_leaf_buffers_);
  first_leaf_buffers_.clear();
  // Rank 0's first leaf is the global batch's leaf 0: its statistics are the
  // step's on every rank and at every world size.
  if (options_.broadcast_buffers) broadcast_buffers();
  // Exposed: after backward; hidden (set by the caller): exchanges in
  // flight before it ended.
  const double exposed = queue_.now_s() - backward_end;
  stats_.iterations += 1;
  stats_.backward_seconds = backward_end;
  stats_.comm_seconds = exposed + stats_.hidden_comm_seconds;
  stats_.exposed_wait_seconds = exposed;
  stats_.hidden_comm_share =
      stats_.comm_seconds > 0 ? stats_.hidden_comm_seconds / stats_.comm_seconds : 0;
  stats_.total_comm_seconds += stats_.comm_seconds;
  stats_.bytes = bytes;
  stats_.bytes_sent = static_cast<int64_t>(comm_->stats().bytes_sent_ever - sent_at_start_);
}

}  // namespace cohort
