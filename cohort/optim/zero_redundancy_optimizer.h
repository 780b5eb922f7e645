// defines: ZeroOptions, ZeroRedundancyOptimizer (ZeRO stages 1 and 2,
// Rajbhandari et al. 2020): each rank keeps the optimizer state of 1/N of the
// parameters (stage 1) and, at stage 2, only the averaged gradients of that
// 1/N as well.
//
//   // Alone (a plain module):
//   auto zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
//       model->parameters(), mesh["dp"], torch::optim::AdamWOptions(1e-3), {.stage = 2});
//   // With cohort DDP (DDP broadcasts, finds unused parameters, no_sync()):
//   cohort::DistributedDataParallel<Net> ddp(model, mesh["dp"]);
//   auto zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
//       ddp, torch::optim::AdamWOptions(1e-3), {.stage = 2});
//   for (...) { zero->zero_grad(); loss(ddp).backward(); zero->step(); }
//
// How the state, the gradients (stage 1 alone or after DDP, stage 2 through
// GradientShardReducer), the update and the all-gather of the parameters
// work, and gradient accumulation at stage 2: cohort/optim/README.md.
// Every element is updated by the same element-wise formula as
// in the unsharded optimizer, so results equal DDP + the same optimizer (to
// rounding). Requirements: all parameters one floating dtype, dense, CPU,
// equal on every rank (checked at construction), and left where the
// optimizer put them (a replaced storage is refused at the next step).
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/torch_compat.h"
#include "cohort/grad_sync/gradient_reducer.h"
#include "cohort/grad_sync/no_sync_guard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/observability/sync_statistics.h"
#include "cohort/optim/flat_partition.h"
#include "cohort/optim/gradient_shard_reducer.h"

namespace cohort {

/// How ZeroRedundancyOptimizer shards and communicates (the same on every rank).
struct ZeroOptions {
  /// 1: optimizer state sharded; 2: gradients sharded as well.
  int stage = 1;
  /// Largest bucket of the gradient reduction and the parameter all-gather,
  /// in MiB; smaller buckets mean less staging memory at stage 2.
  double bucket_cap_mb = 25;
  /// Stage 2: buckets whose staging may be alive at once. 1: a bucket
  /// starts staging when the previous one's reduce-scatter is done, so the
  /// gradient memory during backward is the shard plus one bucket. 2: the
  /// next bucket fills while the previous one is on the wire (its reduction
  /// overlaps backward), for the shard plus two buckets.
  int max_staged_buckets = 1;
  /// false when cohort DDP is in charge of the model: at stage 1 DDP's
  /// all-reduce averaged the .grad in backward and ZeRO reads them; at stage
  /// 2 DDP hands its reduction over (take_over_reduction(), which make(ddp,
  /// ...) calls). true: the optimizer reduces alone.
  bool reduce_gradients = true;
  /// How the updated parameters are all-gathered (cohort/algorithms);
  /// Default: the communicator's choice.
  Algorithm gather_algo = Algorithm::Default;
  /// Determinism::WorldSizeInvariant (with cohort DDP built with the same
  /// option and leaf count, which runs the leaf loop): the partition is one
  /// bucket, so rank r's shard is chunk r of LeafReduction::finish_chunk();
  /// at stage 2 DDP hands that chunk over (no reduce-scatter, no
  /// all-gather of gradients), at stage 1 ZeRO reads DDP's canonical mean.
  /// Use clip_grad_norm() for clipping. Refused without DDP.
  Determinism determinism = Determinism::Default;
  /// The leaf count (WorldSizeInvariant only): must equal DDP's.
  int64_t leaves = 0;
};

/// Stage 2 with WorldSizeInvariant: keeps the chunk DDP hands over (internal).
class LeafChunkOwner;

/// ZeRO stage 1 or 2 (DeepSpeed's ZeRO, PyTorch's ZeroRedundancyOptimizer) around any LibTorch
/// optimizer: each rank keeps and steps the optimizer state of its own shard of the parameters,
/// then all-gathers the updated parameters; at stage 2 the gradients are reduce-scattered to the
/// shards. Build it with make(); step(), finish_gradients() and consolidate_state_dict() are
/// collective.
class ZeroRedundancyOptimizer {
 public:
  /// Builds the inner optimizer over this rank's shard, from the shard's
  /// parameter groups (each with the caller's group options already set).
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::optim::OptimizerParamGroup>)>;

  /// Collective over comm: every rank passes the same parameter shapes in
  /// the same order, with the same values (as after DDP's broadcast; checked
  /// by a digest: MismatchError on every rank naming the first parameter
  /// that differs); groups without options take the inner defaults. A
  /// tensor listed twice (a tied weight in a module's parameters()) is one
  /// parameter, at its first place; one in two groups is InvalidArgument.
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, Factory factory,
                          std::shared_ptr<Communicator> comm, ZeroOptions options = {});
  /// Removes the stage-2 gradient hooks from the parameters and gives DDP
  /// its reduction back.
  ~ZeroRedundancyOptimizer();
  /// The hooks hold this object's address.
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  /// ZeroRedundancyOptimizer::make<torch::optim::AdamW>(params, mesh["dp"], AdamWOptions(lr)):
  /// what it steps, the group it shards over, the inner optimizer's defaults, ZeRO's options
  /// (the order of DDP and fully_shard).
  template <typename Opt, typename Options>
  static std::unique_ptr<ZeroRedundancyOptimizer> make(
      std::vector<torch::optim::OptimizerParamGroup> groups, std::shared_ptr<Communicator> comm,
      const Options& defaults, ZeroOptions options = {}) {
    return std::make_unique<ZeroRedundancyOptimizer>(
        std::move(groups),
        [defaults](std::vector<torch::optim::OptimizerParamGroup> shard) {
          return std::make_unique<Opt>(std::move(shard), defaults);
        },
        std::move(comm), options);
  }
  /// The same over one group of parameters with the `defaults` options.
  template <typename Opt, typename Options>
  static std::unique_ptr<ZeroRedundancyOptimizer> make(std::vector<torch::Tensor> params,
                                                       std::shared_ptr<Communicator> comm,
                                                       const Options& defaults,
                                                       ZeroOptions options = {}) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::move(params));
    return make<Opt>(std::move(groups), std::move(comm), defaults, options);
  }
  /// Over a 1-D mesh (mesh["dp"]): its group; InvalidArgument naming the mesh otherwise.
  template <typename Opt, typename Options>
  static std::unique_ptr<ZeroRedundancyOptimizer> make(std::vector<torch::Tensor> params,
                                                       const DeviceMesh& mesh,
                                                       const Options& defaults,
                                                       ZeroOptions options = {}) {
    return make<Opt>(std::move(params),
                     one_dimension_group(mesh, "ZeroRedundancyOptimizer::make", "dp"), defaults,
                     options);
  }
  /// The earlier order, kept for programs written against it.
  template <typename Opt, typename Options>
  [[deprecated(
      "use make(params, comm, defaults, options)")]] static std::unique_ptr<ZeroRedundancyOptimizer>
  make(std::vector<torch::optim::OptimizerParamGroup> groups, const Options& defaults,
       std::shared_ptr<Communicator> comm, ZeroOptions options = {}) {
    return make<Opt>(std::move(groups), std::move(comm), defaults, options);
  }
  /// The earlier order, kept for programs written against it.
  template <typename Opt, typename Options>
  [[deprecated(
      "use make(params, comm, defaults, options)")]] static std::unique_ptr<ZeroRedundancyOptimizer>
  make(std::vector<torch::Tensor> params, const Options& defaults,
       std::shared_ptr<Communicator> comm, ZeroOptions options = {}) {
    return make<Opt>(std::move(params), std::move(comm), defaults, options);
  }

  /// With cohort DDP (every rank passes its DistributedDataParallel model,
  /// or anything whose reducer() is a GradientReducer; the parameters are
  /// ddp.parameters(), the communicator DDP's): stage 1 reads DDP's averaged
  /// gradients, stage 2 takes over DDP's reduction. The DDP model must
  /// outlive the optimizer.
  template <
      typename Opt, typename Options, typename Model,
      std::enable_if_t<std::is_same_v<decltype(std::declval<Model&>().reducer()), GradientReducer&>,
                       int> = 0>
  static std::unique_ptr<ZeroRedundancyOptimizer> make(Model& ddp, const Options& defaults,
                                                       ZeroOptions options = {}) {
    options.reduce_gradients = false;
    auto zero = make<Opt>(ddp.parameters(), ddp.reducer().process_group(), defaults, options);
    zero->check_determinism(ddp.reducer());
    zero->name_parameters(ddp.reducer());
    if (options.stage == 2) zero->take_over_reduction(ddp.reducer());
    return zero;
  }
  /// The earlier spelling, kept for programs written against it: `comm` must
  /// be DDP's own (InvalidArgument, naming the rank, otherwise).
  template <
      typename Opt, typename Options, typename Model,
      std::enable_if_t<std::is_same_v<decltype(std::declval<Model&>().reducer()), GradientReducer&>,
                       int> = 0>
  [[deprecated("use make(ddp, defaults, options): the communicator is DDP's")]] static std::
      unique_ptr<ZeroRedundancyOptimizer>
      make(Model& ddp, const Options& defaults, std::shared_ptr<Communicator> comm,
           ZeroOptions options = {}) {
    check_is_ddps(comm, ddp.reducer());
    return make<Opt>(ddp, defaults, options);
  }

  /// Stage 2 with reduce_gradients = false: from now on `ddp` reports ready
  /// gradients to this optimizer, which reduce-scatters them, instead of
  /// all-reducing them itself (see reduction_owner.h). Every parameter DDP
  /// reduces must be one of this optimizer's (InvalidArgument otherwise,
  /// here, or on every rank at the forward where DDP takes up one unfrozen
  /// since).
  void take_over_reduction(GradientReducer& ddp);
  /// Throws InvalidArgument (naming the rank) unless `ddp` has this
  /// optimizer's determinism and leaf count, in this optimizer's parameter
  /// order. make(ddp, ...) calls it.
  void check_determinism(const GradientReducer& ddp) const;
  /// Names this optimizer's parameters in its errors as `ddp` names them
  /// (by identity). make(ddp, ...) calls it.
  void name_parameters(const GradientReducer& ddp);
  /// InvalidArgument unless `comm` is `ddp`'s communicator.
  static void check_is_ddps(const std::shared_ptr<Communicator>& comm, const GradientReducer& ddp);

  /// Collective, WorldSizeInvariant only: finishes the gradients, measures
  /// their global L2 norm in the canonical order (canonical_norm.h: the same
  /// bits at every world size and as over the whole gradient on one rank)
  /// and scales the shard's gradients by max_norm / (norm + 1e-6) when that
  /// is below 1, as torch::nn::utils::clip_grad_norm_. Returns the norm.
  double clip_grad_norm(double max_norm);

  /// Collective: reduce gradients as the stage says, step the shard,
  /// all-gather the updated parameters. InvalidArgument on every rank, before
  /// anything is stepped, when a rank's parameter no longer lives in the flat
  /// buffer (torch::load, Module::to, set_data or set_ replaced its storage
  /// after construction): the step would update the buffer, which the model
  /// no longer reads. Load values in place (copy_, dcp::set_state_dict).
  /// Also at stage 2 after a second backward outside no_sync() on any rank.
  /// A refused step drops its gradients on every rank (as zero_grad()), so
  /// training that catches the refusal goes on as if the step were skipped.
  void step();
  /// Collective: ends this step's gradient reduction (stage 2: waits for the
  /// reduce-scatters), so that the pieces' .grad (shard_pieces()) hold this
  /// step's averaged gradients, e.g. to clip them by their global norm
  /// before step(). step() calls it when the caller did not.
  void finish_gradients();
  /// Clears the gradients as the linked LibTorch's Optimizer::zero_grad()
  /// does by default (kZeroGradSetsToNone: in place in 1.13, to none in 2.x).
  void zero_grad() { zero_grad(kZeroGradSetsToNone); }
  /// set_to_none: the parameters' .grad are set to none, and a parameter
  /// steps again only once a backward gives it a gradient on some rank.
  /// false: a defined .grad is zeroed in place, and a parameter that had a
  /// gradient on some rank since the last zero_grad(true) steps at every
  /// step, with a zero gradient where it got none (as a LibTorch optimizer
  /// steps a zeroed .grad: weight decay, moment decay, step count). Stage 2
  /// keeps no .grad between steps: this call is what it goes by.
  void zero_grad(bool set_to_none);
  /// Sets the rate of every group (as setting each group's lr in LibTorch).
  void set_lr(double lr);

  /// The inner optimizer's groups, index for index the caller's groups: their
  /// options (lr, weight decay, betas, ...) can be changed as in LibTorch.
  std::vector<torch::optim::OptimizerParamGroup>& param_groups();
  /// The inner optimizer, which steps only this rank's pieces (shard_pieces()).
  torch::optim::Optimizer& shard_optimizer() { return *inner_; }
  /// This rank's pieces (what the inner optimizer steps); after
  /// finish_gradients() their .grad are this rank's averaged gradients, a
  /// disjoint part of the whole on every rank (undefined for parameters that
  /// got no gradient anywhere).
  const std::vector<torch::Tensor>& shard_pieces() const { return pieces_; }

  /// RAII, stage 2 alone: backwards in its scope accumulate into .grad
  /// locally (no communication); the first backward after it reduces the
  /// sum. With DDP use ddp.no_sync(). Other stages accumulate without it.
  using NoSync = ScopedNoSync<ZeroRedundancyOptimizer>;
  /// Opens a NoSync scope (stage 2 without DDP; elsewhere it has no effect).
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }
  /// The depth NoSync counts (stage 2 alone; other stages ignore it).
  void push_no_sync() {
    if (shard_reducer_) shard_reducer_->push_no_sync();
  }
  /// Leaves one NoSync scope (stage 2 alone).
  void pop_no_sync() {
    if (shard_reducer_) shard_reducer_->pop_no_sync();
  }
  /// The parameters it was built over, in flat order (partition().params()
  /// index for index): group by group, not the model's order. Each is the
  /// caller's tensor (its TensorImpl), now a view into the flat buffer.
  const std::vector<torch::Tensor>& params() const { return params_; }
  /// How the flat parameter buffer is cut into buckets and per-rank shards.
  const FlatPartition& partition() const { return *partition_; }
  /// The options it was built with (reduce_gradients is false when built from DDP).
  const ZeroOptions& options() const { return options_; }
  /// The communicator the shards are exchanged over.
  const std::shared_ptr<Communicator>& process_group() const { return comm_; }
  /// The same communicator, by reference.
  [[deprecated("use *process_group()")]] Communicator& communicator() { return *comm_; }
  /// The same communicator, shared.
  [[deprecated("use process_group()")]] const std::shared_ptr<Communicator>& shared_communicator()
      const {
    return comm_;
  }

  /// Bytes of optimizer state this rank holds (its shard's).
  int64_t state_bytes() const;
  /// The gradient reductions this optimizer ran (stage 1 alone: all-reduce;
  /// stage 2: reduce-scatter, during backward); not the parameter all-gather.
  const SyncStatistics& sync_statistics() const { return sync_.statistics(); }
  /// The gradient storage this optimizer keeps between steps, and its bytes:
  /// the full flat buffer at stage 1 alone, the shard at stage 2, nothing
  /// at stage 1 after DDP (DDP's buffers hold them) or at world 1 (.grad).
  std::vector<torch::Tensor> grad_buffers() const;
  /// The bytes of grad_buffers().
  int64_t grad_bytes() const;
  /// Stage 2: bytes of the buckets' staging buffers together, each in use
  /// from the first gradient staged into it to the end of its
  /// reduce-scatter and lazily freed between uses (staging_buffer.h); 0
  /// otherwise.
  int64_t staging_bytes() const { return shard_reducer_ ? shard_reducer_->staging_bytes() : 0; }
  /// Stage 2: the most staging bytes alive at once so far (during backward
  /// and the reduction); the gradient peak is this plus the shard.
  int64_t staging_peak_bytes() const {
    return shard_reducer_ ? shard_reducer_->staging_peak_bytes() : 0;
  }
  /// Stage 2: the most bytes of .grad kept at once past their hook because
  /// they (partly) belong to a bucket that does not stage yet.
  int64_t held_peak_bytes() const { return shard_reducer_ ? shard_reducer_->held_peak_bytes() : 0; }

  /// This rank's shard of the state, for sharded checkpoints: every rank
  /// saves its own archive and loads it back into an optimizer with the same
  /// world size, rank and parameter shapes (checked: MismatchError).
  void save_shard(torch::serialize::OutputArchive& archive) const;
  /// Restores an archive written by save_shard() on the same rank; throws MismatchError when world
  /// size, rank, stage or parameter shapes differ.
  void load_shard(torch::serialize::InputArchive& archive);

  /// Collective: gathers every rank's shard of each state tensor to rank
  /// `to`, which returns, per parameter, name -> full tensor shaped like the
  /// parameter ("exp_avg", "exp_avg_sq", "momentum_buffer", ...; plus "step"
  /// as a one-element int64 tensor where the state has one). Other ranks
  /// return an empty vector. Parameters never stepped have an empty map.
  std::vector<std::map<std::string, torch::Tensor>> consolidate_state_dict(int to = 0);

  /// Called by the accumulator hook of parameter i, alone at stage 2
  /// (internal).
  void on_gradient_ready(size_t i) { shard_reducer_->on_gradient_ready(i); }

 private:
  // Checks the options and takes each distinct tensor of `groups` into
  // params_ and shapes_ (with its numel and group); throws what this rank
  // refuses.
  void take_parameters(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                       std::vector<int64_t>& numels, std::vector<size_t>& group_of);
  // The inner optimizer over this rank's pieces, one group per caller group.
  void build_inner(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                   const Factory& factory);
  void finish_gradients(const std::string& op);
  void reduce_gradients(const std::string& op);
  void all_reduce_gradients(const std::string& refusal, const std::string& op);
  void step_and_all_gather();
  void reduce_scatter_gradients(const std::string& refusal, const std::string& op);
  // The first parameter that no longer lives where the constructor put it
  // (a view into flat_params_), described with what replaced it; "" if none.
  std::string replaced_storage() const;
  // InvalidArgument on every rank when replaced_storage() is not "" on
  // one: at world size 1 thrown here, else agreed in one small all-reduce
  // (an int per rank), for the paths with no other collective to ride on.
  void refuse_replaced_storage(const std::string& op);
  void take_leaf_chunk();
  // Adds this step's presence (per parameter, agreed on every rank) to
  // kept_ and returns kept_: the parameters that step.
  const std::vector<char>& keep(const std::vector<char>& has);
  std::string where(const std::string& op) const;

  std::shared_ptr<Communicator> comm_;
  ZeroOptions options_;
  std::vector<torch::Tensor> params_;  // flat order
  std::vector<std::vector<int64_t>> shapes_;  // of params_, as built
  std::vector<std::string> names_;            // DDP's, where built from DDP; else empty
  std::unique_ptr<FlatPartition> partition_;
  torch::Tensor flat_params_;  // padded; the parameters are views into it
  torch::Tensor flat_grads_;   // stage 1 with reduce_gradients: padded
  /// One leaf tensor per piece, a view into flat_params_ (what the inner
  /// optimizer steps), in partition().pieces() order.
  std::vector<torch::Tensor> pieces_;
  std::unique_ptr<torch::optim::Optimizer> inner_;

  // Stage 2 (world > 1): the gradients' staging and reduce-scatter.
  std::unique_ptr<GradientShardReducer> shard_reducer_;
  // Stage 2, WorldSizeInvariant (world > 1): receives DDP's chunk.
  std::unique_ptr<LeafChunkOwner> leaf_owner_;
  torch::Tensor leaf_shard_;  // this step's chunk (the pieces' .grad view it)
  SyncRecorder sync_;         // stage 1 and the all-gathers: SyncStatistics
  bool reduced_ = false;      // finish_gradients() ran since the last step
  // Per parameter: it had a gradient on some rank since the last
  // zero_grad(true) (agreed on every rank). Stage 2 and the leaf chunk
  // hold no .grad between steps; this tells which step with zeros.
  std::vector<char> kept_;
};

}  // namespace cohort
