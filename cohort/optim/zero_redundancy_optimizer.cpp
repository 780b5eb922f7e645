// ZeroRedundancyOptimizer: construction and one step (gradients, update,
// all-gather). The sharded checkpoint half is in zero_checkpoint.cpp.
#include "cohort/optim/zero_redundancy_optimizer.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <utility>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"
#include "cohort/grad_sync/canonical_norm.h"
#include "cohort/grad_sync/flat_views.h"
#include "cohort/grad_sync/gradient_presence.h"
#include "cohort/grad_sync/parameter_check.h"
#include "cohort/optim/optimizer_state.h"

namespace cohort {

// DDP's WorldSizeInvariant chunk, kept as the rank's gradient shard.
class LeafChunkOwner : public ReductionOwner {
 public:
  explicit LeafChunkOwner(GradientReducer& ddp) : ddp_(ddp) {}
  ~LeafChunkOwner() override { ddp_.set_reduction_owner(nullptr); }
  void gradient_ready(size_t) override {}
  void backward_finished() override {}
  // Never called: with leaves DDP refuses to take up a parameter while an
  // owner takes its chunks (the chunk is laid out over DDP's parameters of
  // make(), as our flat partition is), and keeps one frozen since.
  void parameters_changed() override {}
  bool takes_leaf_chunks() const override { return true; }
  void leaf_chunk_ready(torch::Tensor chunk, std::vector<char> used) override {
    chunk_ = std::move(chunk);
    used_ = std::move(used);
  }
  // The chunk of the last backward (undefined after take()).
  torch::Tensor take() { return std::exchange(chunk_, torch::Tensor()); }
  // Per parameter of DDP (ours, in the same order): whether any leaf on any
  // rank gave it a gradient in the last backward.
  const std::vector<char>& used() const { return used_; }

 private:
  GradientReducer& ddp_;
  torch::Tensor chunk_;
  std::vector<char> used_;
};

std::string ZeroRedundancyOptimizer::where(const std::string& op) const {
  return "ZeroRedundancyOptimizer::" + op + " (rank " + std::to_string(comm_->rank()) + " of " +
         std::to_string(comm_->size()) + ", group " + comm_->name() + ")";
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    std::vector<torch::optim::OptimizerParamGroup> groups, Factory factory,
    std::shared_ptr<Communicator> comm, ZeroOptions options)
    : comm_(std::move(comm)), options_(options) {
  // Every rank must lay out the same flat buffer, or the collectives would
  // silently mix unrelated elements. What one rank refuses before that
  // check is refused in it, on every rank: thrown on that rank alone, it
  // would leave the others waiting in the next collective to its timeout.
  std::vector<int64_t> numels;
  std::vector<size_t> group_of;
  std::exception_ptr refusal;
  try {
    take_parameters(groups, numels, group_of);
  } catch (...) {  // an ATen error (an undefined tensor) too
    refusal = std::current_exception();
  }
  const int world = comm_->size();
  verify_same_parameters(*comm_, params_, {}, "ZeroRedundancyOptimizer", refusal);
  // Each rank steps its own shard from its own values and the all-gather
  // then assembles the model from every rank's shard: ranks that start from
  // different values would train a silent mix of them. PyTorch's
  // ZeroRedundancyOptimizer assumes equal values (DDP broadcast them); a
  // digest per rank checks it for one word of all-gather, where
  // broadcasting rank 0's values would move the whole model.
  verify_same_values(*comm_, params_, {}, "ZeroRedundancyOptimizer",
                     "ZeRO steps each rank's shard from that rank's values and all-gathers the "
                     "shards, so the model would silently mix the ranks' values. Build it over "
                     "parameters equal on every rank: after cohort DDP (which broadcasts rank "
                     "0's), or initialized from the same seed or checkpoint on every rank");

  const int64_t elem = params_[0].element_size();
  auto bucket_elements =
      static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024 / static_cast<double>(elem));
  const bool leaves = options_.determinism == Determinism::WorldSizeInvariant;
  // One bucket: rank r's shard is then chunk r of the leaf reduction.
  if (leaves) bucket_elements = std::numeric_limits<int64_t>::max() / 2;
  partition_ = std::make_unique<FlatPartition>(numels, group_of, world, comm_->rank(),
                                               std::max<int64_t>(bucket_elements, 1));

  // Parameters become views into one flat buffer, so that the all-gather
  // writes the new values in place and a piece is a plain slice.
  torch::NoGradGuard no_grad;
  std::vector<int64_t> offsets;
  for (const auto& prm : partition_->params()) offsets.push_back(prm.offset);
  flat_params_ = flatten_into(params_, offsets, partition_->padded_numel());
  if (options_.stage == 2 && world > 1 && !leaves) {
    shard_reducer_ = std::make_unique<GradientShardReducer>(
        params_, *partition_, comm_, /*hook=*/options_.reduce_gradients,
        [this](const std::string& op) { return where(op); }, options_.max_staged_buckets);
  } else if (options_.reduce_gradients && world > 1) {
    flat_grads_ = torch::zeros({partition_->padded_numel()}, flat_params_.options());
  }
  build_inner(groups, factory);
  kept_.assign(params_.size(), 0);
}

void ZeroRedundancyOptimizer::take_parameters(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, std::vector<int64_t>& numels,
    std::vector<size_t>& group_of) {
  if (options_.stage != 1 && options_.stage != 2) {
    throw InvalidArgument(where("constructor") + ": stage must be 1 or 2, got " +
                          std::to_string(options_.stage));
  }
  if (options_.max_staged_buckets != 1 && options_.max_staged_buckets != 2) {
    throw InvalidArgument(where("constructor") + ": max_staged_buckets must be 1 or 2, got " +
                          std::to_string(options_.max_staged_buckets));
  }
  if (options_.determinism == Determinism::WorldSizeInvariant && options_.reduce_gradients) {
    throw InvalidArgument(where("constructor") +
                          ": determinism WorldSizeInvariant needs cohort DDP with the same "
                          "option (make(ddp, ...)), which runs the leaf loop");
  }
  // Each tensor once, as DDP (and PyTorch's module.parameters()): LibTorch's
  // parameters() lists a tensor registered in two modules (tied weights)
  // twice, and two slots of one tensor would each take its gradient (stage
  // 2 would stage it into the first and give the second, where the tensor
  // lives, nothing). In two groups it is refused, as PyTorch refuses it.
  std::unordered_map<const void*, size_t> seen;
  std::string in_two_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      const auto [at, fresh] = seen.emplace(p.unsafeGetTensorImpl(), g);
      if (!fresh) {
        if (at->second != g && in_two_groups.empty()) {
          in_two_groups = "groups " + std::to_string(at->second) + " and " + std::to_string(g);
        }
        continue;
      }
      if (!p.is_floating_point() || p.is_sparse()) {
        throw Unsupported(where("constructor") +
                          ": parameters must be dense floating-point tensors");
      }
      // The flat parameters and shards are one tensor on one device.
      if (!params_.empty() && p.device() != params_[0].device()) {
        throw Unsupported(where("constructor") + ": all parameters must share one device (" +
                          params_[0].device().str() + " and " + p.device().str() + " found)");
      }
      if (!params_.empty() && p.scalar_type() != params_[0].scalar_type()) {
        throw Unsupported(where("constructor") + ": all parameters must share one dtype (" +
                          std::string(c10::toString(params_[0].scalar_type())) + " and " +
                          c10::toString(p.scalar_type()) + " found)");
      }
      params_.push_back(p);
      shapes_.push_back(p.sizes().vec());
      numels.push_back(p.numel());
      group_of.push_back(g);
    }
  }
  if (params_.empty()) throw InvalidArgument(where("constructor") + ": no parameters");
  if (!in_two_groups.empty()) {
    throw InvalidArgument(where("constructor") + ": a parameter is in " + in_two_groups +
                          "; each tensor may be in one group only");
  }
}

void ZeroRedundancyOptimizer::build_inner(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const Factory& factory) {
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

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::take_over_reduction(GradientReducer& ddp) {
  if (options_.stage != 2 || options_.reduce_gradients) {
    throw InvalidArgument(where("take_over_reduction") +
                          ": only stage 2 with reduce_gradients = false reduces for DDP (stage 1 "
                          "reads DDP's averaged gradients)");
  }
  if (ddp.process_group() != comm_) {
    throw InvalidArgument(where("take_over_reduction") +
                          ": DDP reduces over another communicator (" +
                          ddp.process_group()->name() + ")");
  }
  if (comm_->size() == 1) return;  // nothing to reduce: .grad is read as it is
  if (options_.determinism == Determinism::WorldSizeInvariant) {
    check_determinism(ddp);
    if (leaf_owner_) throw InvalidArgument(where("take_over_reduction") + ": already taken over");
    leaf_owner_ = std::make_unique<LeafChunkOwner>(ddp);
    ddp.set_reduction_owner(leaf_owner_.get());
    return;
  }
  shard_reducer_->take_over(ddp);
}

void ZeroRedundancyOptimizer::check_is_ddps(const std::shared_ptr<Communicator>& comm,
                                            const GradientReducer& ddp) {
  // Agreed first, so that a rank passing another communicator fails every
  // rank rather than leaving the others waiting in ZeRO's first collective.
  Communicator& group = *ddp.process_group();
  const bool ddps = comm == ddp.process_group();
  const std::string who =
      "ZeroRedundancyOptimizer::make on rank " + std::to_string(group.rank()) + ": ";
  agree_text(group, ddps ? "DDP's" : "another", who, "whether the communicator given is DDP's");
  if (ddps) return;
  throw InvalidArgument(who +
                        "the communicator given is not DDP's; ZeRO over DDP runs over DDP's "
                        "(make(ddp, defaults, options) takes it from DDP)");
}

void ZeroRedundancyOptimizer::check_determinism(const GradientReducer& ddp) const {
  const auto& d = ddp.options();
  const bool mine = options_.determinism == Determinism::WorldSizeInvariant;
  const bool theirs = d.determinism == Determinism::WorldSizeInvariant;
  if (mine != theirs || (mine && d.leaves != options_.leaves)) {
    throw InvalidArgument(
        where("make") + ": determinism differs from DDP's (" +
        (mine ? "WorldSizeInvariant, " + std::to_string(options_.leaves) + " leaves"
              : std::string("Default")) +
        " here, " +
        (theirs ? "WorldSizeInvariant, " + std::to_string(d.leaves) + " leaves"
                : std::string("Default")) +
        " in DDP)");
  }
  if (!mine) return;
  const auto& theirs_params = ddp.parameters();
  bool same = theirs_params.size() == params_.size();
  for (size_t i = 0; same && i < params_.size(); ++i) {
    same = theirs_params[i].is_same(params_[i]);
  }
  if (!same) {
    throw InvalidArgument(where("make") +
                          ": with WorldSizeInvariant the parameters must be DDP's, in DDP's "
                          "order (ddp.parameters())");
  }
}

double ZeroRedundancyOptimizer::clip_grad_norm(double max_norm) {
  if (options_.determinism != Determinism::WorldSizeInvariant) {
    throw Unsupported(where("clip_grad_norm") +
                      ": the canonical norm needs determinism WorldSizeInvariant (otherwise "
                      "clip the shard_pieces() with the Trainer's ShardedGradNorm)");
  }
  finish_gradients("clip_grad_norm");
  torch::NoGradGuard no_grad;
  const int64_t total = partition_->numel();
  double squares = 0;
  if (!leaf_shard_.defined()) {
    // Stage 1 or world 1: every rank holds DDP's whole canonical mean.
    std::vector<torch::Tensor> flat;
    for (const auto& p : params_) {
      flat.push_back(p.grad().defined() ? p.grad().reshape(-1)
                                        : torch::zeros({p.numel()}, p.options()));
    }
    squares = canonical_squared_norm(nullptr, torch::cat(flat), 0, total);
  } else {
    const int64_t chunk = partition_->buckets().front().chunk;
    const int64_t offset = std::min(total, chunk * comm_->rank());
    const int64_t len = std::min(total, offset + chunk) - offset;
    squares = canonical_squared_norm(comm_.get(), leaf_shard_.narrow(0, 0, len), offset, total);
  }
  const double norm = std::sqrt(squares);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& t : pieces_) {
      if (t.grad().defined()) t.mutable_grad().mul_(coef);
    }
  }
  return norm;
}

std::vector<torch::optim::OptimizerParamGroup>& ZeroRedundancyOptimizer::param_groups() {
  return inner_->param_groups();
}

void ZeroRedundancyOptimizer::set_lr(double lr) {
  for (auto& group : inner_->param_groups()) group.options().set_lr(lr);
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  // A backward whose reduction was never finished is dropped (its
  // reduce-scatters were launched alike on every rank; wait for them).
  if (shard_reducer_) shard_reducer_->drop();
  if (leaf_owner_) leaf_owner_->take();
  leaf_shard_ = torch::Tensor();
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    auto& g = p.mutable_grad();
    if (!g.defined()) continue;
    // As LibTorch's zero_grad: detached first (a .grad made with
    // create_graph must not take the zeroing into its graph).
    g.detach_();
    // One that no longer fits its parameter (whose storage was replaced by
    // one of another shape or dtype) goes too: autograd would fail to add
    // the next gradient to it on this rank alone, where the step refuses
    // the replacement on every rank, naming it.
    const bool fits =
        g.sizes() == p.sizes() && g.scalar_type() == p.scalar_type() && g.device() == p.device();
    if (set_to_none || !fits) {
      g = torch::Tensor();
    } else {
      g.zero_();
    }
  }
  // The pieces' .grad are set again when the gradients are finished.
  for (auto& t : pieces_) t.mutable_grad() = torch::Tensor();
  if (set_to_none) std::fill(kept_.begin(), kept_.end(), 0);
  reduced_ = false;
}

const std::vector<char>& ZeroRedundancyOptimizer::keep(const std::vector<char>& has) {
  for (size_t i = 0; i < kept_.size(); ++i) kept_[i] = (kept_[i] || has.at(i)) ? 1 : 0;
  return kept_;
}

void ZeroRedundancyOptimizer::finish_gradients() { finish_gradients("finish_gradients"); }

void ZeroRedundancyOptimizer::finish_gradients(const std::string& op) {
  if (reduced_) return;
  try {
    reduce_gradients(op);
  } catch (...) {
    // A refused step (refused on every rank together) drops its gradients,
    // as zero_grad(): left in .grad, a backward after the caught refusal
    // would add to them and the next step would take the refused one's too.
    zero_grad();
    throw;
  }
  reduced_ = true;
}

void ZeroRedundancyOptimizer::name_parameters(const GradientReducer& ddp) {
  std::unordered_map<const void*, std::string> name_of;
  const auto& theirs = ddp.parameters();
  for (size_t k = 0; k < theirs.size() && k < ddp.parameter_names().size(); ++k) {
    name_of.emplace(theirs[k].unsafeGetTensorImpl(), ddp.parameter_names()[k]);
  }
  names_.clear();
  for (const auto& p : params_) {
    auto it = name_of.find(p.unsafeGetTensorImpl());
    names_.push_back(it == name_of.end() ? std::string() : it->second);
  }
}

std::string ZeroRedundancyOptimizer::replaced_storage() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    const int64_t offset = flat_params_.storage_offset() + partition_->params()[i].offset;
    if (p.has_storage() && p.storage().is_alias_of(flat_params_.storage()) &&
        p.storage_offset() == offset && p.sizes() == at::IntArrayRef(shapes_[i]) &&
        p.is_contiguous() && p.scalar_type() == flat_params_.scalar_type() &&
        p.device() == flat_params_.device()) {
      continue;
    }
    std::string name = "parameter " + std::to_string(i);
    if (i < names_.size() && !names_[i].empty()) name += " ('" + names_[i] + "')";
    return name + " of group " + std::to_string(partition_->params()[i].group) +
           " no longer holds the storage ZeroRedundancyOptimizer gave it (a view into its flat "
           "parameter buffer, " +
           dtype_name(flat_params_.scalar_type()) + " " + c10::str(at::IntArrayRef(shapes_[i])) +
           " on " + flat_params_.device().str() + "; it is now " + dtype_name(p.scalar_type()) +
           " " + c10::str(p.sizes()) + " on " + p.device().str() +
           "): something replaced it after the optimizer was built (torch::load, which set_()s "
           "each tensor, Module::to, set_data or set_), and the step would update the buffer, "
           "which the model no longer reads, and leave the new values untrained. Copy values "
           "into the parameters in place (p.copy_(value) under torch::NoGradGuard) or load them "
           "with dcp::set_state_dict, and change dtype or device before building the optimizer";
  }
  return "";
}

void ZeroRedundancyOptimizer::refuse_replaced_storage(const std::string& op) {
  const std::string replaced = replaced_storage();
  if (comm_->size() > 1) {
    any_rank_has_unless_refused(*comm_, {}, replaced, where(op));
  } else if (!replaced.empty()) {
    throw InvalidArgument(where(op) + ": " + replaced);
  }
}

void ZeroRedundancyOptimizer::step() {
  TraceSpan span(active(comm_->tracer()), "zero step", "optim");
  span.arg(TraceArg::num("stage", options_.stage));
  // Gradients finished before step() (to clip them) checked the storage
  // then; a replacement since is refused here, before anything is stepped.
  // The step's first collective comes after its first update, so the
  // refusal cannot ride on it: this path pays one small all-reduce.
  if (reduced_) {
    try {
      refuse_replaced_storage("step");
    } catch (...) {
      zero_grad();  // as any refused step (finish_gradients())
      throw;
    }
  }
  finish_gradients("step");
  reduced_ = false;
  if (comm_->size() == 1) {
    inner_->step();  // the shard is the whole buffer
  } else {
    step_and_all_gather();
  }
  // The step (and the all-gather) wrote through flat_params_, whose version
  // counter is not the parameters': theirs move as an in-place step would
  // move them, so what tracks them sees the change (a pending async save,
  // a graph that saved a parameter).
  for (auto& p : params_) p.unsafeGetTensorImpl()->bump_version();
}

void ZeroRedundancyOptimizer::reduce_gradients(const std::string& op) {
  torch::NoGradGuard no_grad;
  const auto& part = *partition_;
  const auto& pieces = part.pieces();
  // Stage 2 reduces alone or for DDP; stage 1 only alone.
  const bool reduce = comm_->size() > 1 && (options_.stage == 2 || options_.reduce_gradients);
  // A parameter whose storage was replaced is refused on every rank before
  // anything is stepped. The refusal rides on the gradient-presence
  // all-reduce where the step has one (stage 1 alone, stage 2); stage 1
  // after DDP and the leaf chunk have none, and pay one small all-reduce (an
  // int per rank) for it.
  const bool leaf_chunk =
      options_.stage == 2 && options_.determinism == Determinism::WorldSizeInvariant;
  std::string replaced;
  if (!reduce || leaf_chunk) {
    refuse_replaced_storage(op);
  } else {
    replaced = replaced_storage();
  }

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

  if (leaf_chunk) {
    take_leaf_chunk();
  } else if (options_.stage == 2) {
    reduce_scatter_gradients(replaced, op);
  } else {
    all_reduce_gradients(replaced, op);
  }
}

// Stage 1 alone: all-reduce bucket by bucket into the full flat gradient
// buffer; a bucket is launched as soon as its gradients are in.
void ZeroRedundancyOptimizer::all_reduce_gradients(const std::string& refusal,
                                                   const std::string& op) {
  torch::NoGradGuard no_grad;
  const auto& part = *partition_;
  const auto& pieces = part.pieces();
  // A parameter with a gradient on any rank is reduced (missing ones count
  // as zeros, as in DDP); one with none anywhere is skipped by the inner
  // optimizer, as LibTorch's optimizers skip an undefined .grad.
  std::vector<char> local(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) local[i] = params_[i].grad().defined() ? 1 : 0;
  const auto has = any_rank_has_unless_refused(*comm_, local, refusal, where(op));
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

// Stage 2: the shard reducer stages and reduce-scatters (during backward
// where it could); the pieces' .grad are slices of the shard.
void ZeroRedundancyOptimizer::reduce_scatter_gradients(const std::string& refusal,
                                                       const std::string& op) {
  // The buckets were issued during backward; what is left to wait for here
  // is the exposed part, and the whole of it is counted as one sync.
  sync_.bucket_issued();
  decltype(shard_reducer_->finish()) has;
  sync_.blocked([&] { has = shard_reducer_->finish(refusal, op); });
  sync_.sync_done();
  // A parameter with no gradient anywhere has zeros in the shard: one
  // kept since zero_grad(false) steps with them.
  const auto& present = keep(has);
  const auto& shard = shard_reducer_->shard();
  const auto& pieces = partition_->pieces();
  for (size_t k = 0; k < pieces.size(); ++k) {
    pieces_[k].mutable_grad() = present[pieces[k].param]
                                    ? shard.narrow(0, pieces[k].shard_offset, pieces[k].numel)
                                    : torch::Tensor();
  }
}

// The inner optimizer steps one bucket's pieces at a time (the other
// pieces' .grad hidden meanwhile), and each bucket's all-gather is launched
// as soon as its pieces are updated, so it overlaps the updates of the
// buckets after it. LibTorch's optimizers update every parameter from its
// own gradient and state only (a parameter without .grad is skipped), so
// stepping the pieces bucket by bucket equals stepping them all at once.
void ZeroRedundancyOptimizer::take_leaf_chunk() {
  if (!leaf_owner_) {
    throw InvalidArgument(where("step") +
                          ": WorldSizeInvariant at stage 2 needs DDP's reduction taken over "
                          "(make(ddp, ...))");
  }
  leaf_shard_ = leaf_owner_->take();
  if (!leaf_shard_.defined() || leaf_shard_.numel() != partition_->buckets().front().chunk) {
    throw InvalidArgument(where("step") +
                          ": no gradient chunk from DDP's leaves (run one forward and backward "
                          "per local leaf before step())");
  }
  // The shard is chunk r of the single bucket: a piece's shard offset is
  // its offset in the chunk. A parameter that no leaf used on any rank has
  // zeros there but no gradient, so the inner optimizer skips it (as DDP
  // leaves its .grad undefined) unless it is kept since zero_grad(false),
  // and then steps with those zeros; DDP's parameters are ours, in our
  // order (check_determinism()).
  const auto& used = leaf_owner_->used();
  COHORT_CHECK(used.size() == params_.size(), "DDP's usage bitmap does not match the parameters");
  const auto& present = keep(used);
  const auto& pieces = partition_->pieces();
  for (size_t k = 0; k < pieces.size(); ++k) {
    pieces_[k].mutable_grad() = present[pieces[k].param]
                                    ? leaf_shard_.narrow(0, pieces[k].shard_offset, pieces[k].numel)
                                    : torch::Tensor();
  }
}

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
  if (leaf_shard_.defined()) out.push_back(leaf_shard_);
  if (shard_reducer_) {
    out.push_back(shard_reducer_->shard());
    for (auto& t : shard_reducer_->live_staging()) out.push_back(t);
  }
  return out;
}

int64_t ZeroRedundancyOptimizer::grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& t : grad_buffers()) bytes += t.nbytes();
  return bytes;
}

}  // namespace cohort
