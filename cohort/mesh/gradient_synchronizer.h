// defines: GradientSynchronizer, which finishes one step's gradients across
// the "tp", "pp" and "dp" dimensions of a DeviceMesh, and "ep" (expert
// parallelism) and "cp" (context parallelism) where the mesh has them, and
// its per-dimension statistics.
//
// What each dimension sends and when: cohort/mesh/README.md.
//
//   auto mesh = init_device_mesh(world, {pp, dp, tp}, {"pp", "dp", "tp"});
//   GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
//                             stage->shared_embedding_weight());
//   sync.prepare_forward();
//   auto loss = stage->loss(stage(x), y);
//   sync.after_forward({loss});
//   loss.backward();
//   sync.finish_backward();   // TP and PP reductions; DP finished in backward
//   optimizer.step();
//
// Gradient accumulation over M micro-batches: the first M - 1 inside
// no_sync() (the synchronizer's, or the DP reducer's NoSyncGuard), where
// backward adds into .grad locally and finish_backward() does nothing; the
// last outside it, whose finish_backward() reduces the accumulated sum once:
//
//   for (int m = 0; m < M; ++m) {
//     std::optional<GradientSynchronizer::NoSync> local;
//     if (m + 1 < M) local.emplace(sync.no_sync());
//     sync.prepare_forward();   // decides: this micro-batch syncs or not
//     auto loss = stage->loss(stage(x[m]), y[m]) / M;
//     sync.after_forward({loss});
//     loss.backward();
//     sync.finish_backward();   // nothing under no_sync(); the sum on the last
//   }
//   optimizer.step();
//
// With experts split over "ep" (mesh {"pp", "dp", "ep", "tp"}), name them:
//
//   GradientSynchronizerOptions o;
//   o.expert_parameters = expert_parallel::expert_parameters(*stage);
//   GradientSynchronizer sync(mesh, stage.ptr(), {}, embedding, o);
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <exception>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cohort/grad_sync/comm_hook.h"
#include "cohort/grad_sync/ddp_options.h"
#include "cohort/grad_sync/gradient_reducer.h"
#include "cohort/grad_sync/no_sync_guard.h"
#include "cohort/grad_sync/tied_copies.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/mesh/tensor_parallel_module.h"

namespace cohort {

/// Counters of one dimension, summed over the steps since construction.
struct DimensionStats {
  int64_t ops = 0;     ///< collectives issued (DP: buckets reduced)
  int64_t bytes = 0;   ///< bytes of gradient reduced
  double seconds = 0;  ///< time in the collectives (DP: with a bucket in flight)
};

/// Per-dimension statistics of a GradientSynchronizer.
struct GradientSyncStats {
  DimensionStats tp;       ///< sequence-parallel gradients over the TP group
  DimensionStats pp;       ///< the shared embedding over the embedding group
  DimensionStats dp;       ///< every non-expert gradient over the dense group (dp x ep x cp)
  DimensionStats experts;  ///< expert gradients over the ranks holding the same experts
  int64_t steps = 0;       ///< finish_backward calls that reduced (not those under no_sync)
};

/// How each dimension reduces.
struct GradientSynchronizerOptions {
  /// TP all-reduce: a few small tensors each step, latency-bound; the TP
  /// group's own choice (CommunicatorOptions::algorithm) by default.
  Algorithm tp_algorithm = Algorithm::Default;
  /// The embedding all-reduce between the first and the last stage.
  Algorithm embedding_algorithm = Algorithm::Default;
  /// With pp > 1: the model's output layer has weights of its own instead of
  /// the word embedding's (Megatron's untie_embeddings_and_output_weights),
  /// so no stage passes a shared_embedding and nothing is broadcast or
  /// reduced between the first and the last stage. False (a tied model): the
  /// first and the last stage must each pass theirs. A synchronizer cannot
  /// tell an untied model from a tied one whose tie was left out (either way
  /// two tensors on two ranks), so it does not guess: with pp > 1 an end
  /// stage that passes none is refused unless this says so. Ignored at pp 1.
  bool untied_embedding = false;
  /// DP bucket all-reduce (ignored when dp_comm_hook is set).
  Algorithm dp_algorithm = Algorithm::Default;
  /// A DDP communication hook for the DP buckets (e.g. a compressor).
  std::shared_ptr<CommHook> dp_comm_hook;
  /// Bucketing and overlap of the DP reduction.
  DDPOptions ddp;
  /// Parameters sharded over the mesh's "ep" dimension (each rank holds its
  /// own experts: expert_parallel::expert_parameters(stage)). Their gradients
  /// are summed over the ranks that hold the same experts ("dp" x "cp") and
  /// divided by the dense group's size, never reduced over "ep"; every other
  /// parameter is averaged over the dense group. Empty: every parameter is
  /// replicated over the dense group.
  std::vector<torch::Tensor> expert_parameters;
  /// Over a "tp" above 1, compare over TP digests (sum and sum of
  /// magnitudes) of the parameters that are whole on every TP rank (every
  /// parameter, frozen ones too, but those a TensorParallelModule splits, the
  /// experts and those marked rank-local): at construction their values must
  /// be equal (they are not when each rank drew them from its own seed); at
  /// the first reducing step their reduced gradients must agree (they do not
  /// when a parameter that sees sequence-split activations is missing from
  /// sequence_parallel_parameters), and before the TP sum no
  /// sequence-parallel parameter may have the same non-zero gradient on
  /// every TP rank (one that sees whole activations, which the sum would
  /// multiply by tp). Each check is one all-gather of two numbers per
  /// parameter over TP and one of a word over PP; a mismatch is an
  /// InvalidArgument on every rank of every stage. Turn it off only for a
  /// stage whose own layers split parameters over TP without implementing
  /// TensorParallelModule.
  bool verify_tp_replicas = true;
};

/// Finishes each step's gradients over TP, PP and DP (file comment).
class GradientSynchronizer {
 public:
  /// Collective over the whole mesh: builds the embedding group (the first
  /// and the last stage of this rank's "pp" group), broadcasts the shared
  /// embedding from the first to the last stage (TiedCopies: copies of
  /// different shapes or dtypes are an InvalidArgument on every rank of the
  /// "pp" group), and builds the DP reducer (which broadcasts the stage from
  /// DP rank 0). With pp > 1 the first and the last stage pass
  /// `shared_embedding` unless options.untied_embedding, when no stage does;
  /// otherwise InvalidArgument on every rank of the mesh naming a rank that
  /// broke the rule (one all-gather of a word over the mesh at
  /// construction). `mesh` has the dimensions
  /// "pp", "dp" and "tp" (any order), optionally "ep" and "cp" (others only
  /// of size 1: InvalidArgument naming them otherwise). The dense group is
  /// "dp" with "ep" and "cp" where they are above 1: ranks that see
  /// different tokens, over which the non-expert gradients are averaged.
  /// options.expert_parameters must be parameters of `stage`; with "ep" above
  /// 1 they must not be empty (InvalidArgument: the experts would be
  /// averaged with other ranks' experts). `sequence_parallel_parameters` and
  /// `shared_embedding` (ignored on middle stages) must be parameters of
  /// `stage` (InvalidArgument otherwise: a tensor of another module would be
  /// reduced while the stage's own stays partial), and none may be split by
  /// a TensorParallelModule or be an expert. The gradients summed over
  /// TP are `sequence_parallel_parameters` together with those every
  /// TensorParallelModule in `stage` names (a RowParallelLinear bias under
  /// sequence parallelism), each once, experts excepted; the caller lists
  /// only the others (a LayerNorm that sees sequence-split activations). One
  /// left out is found at the first step (options.verify_tp_replicas).
  GradientSynchronizer(DeviceMesh mesh, std::shared_ptr<torch::nn::Module> stage,
                       std::vector<torch::Tensor> sequence_parallel_parameters,
                       torch::Tensor shared_embedding, GradientSynchronizerOptions options = {});
  ~GradientSynchronizer();

  /// The scope of no_sync(): movable, ends the scope when destroyed.
  using NoSync = ScopedNoSync<GradientSynchronizer>;

  /// Before each forward (the DP reducer's bookkeeping). Decides, as the DP
  /// reducer does, whether this micro-batch synchronizes: not while a
  /// no_sync() scope (this synchronizer's or the DP reducer's) is open.
  void prepare_forward();
  /// After each forward, with the tensors it returned (unused-parameter search).
  void after_forward(const std::vector<torch::Tensor>& outputs);
  /// After backward: the TP, embedding and expert all-reduces (the DP
  /// reduction finished in backward). After a micro-batch whose
  /// prepare_forward() ran under no_sync() it does nothing: its gradients
  /// stay local partial sums, and the next synchronizing micro-batch's
  /// finish_backward() reduces the accumulated sum once (each of these
  /// reductions is a sum, so reducing the sum is reducing each term).
  void finish_backward();

  /// Backwards from here until the scope ends accumulate locally: the DP
  /// reducer's too (no DP communication), and finish_backward() defers to
  /// the first micro-batch prepared outside every scope. Scopes nest.
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }
  /// Enters a no_sync() scope (NoSync calls it).
  void push_no_sync();
  /// Leaves a no_sync() scope (NoSync calls it).
  void pop_no_sync();

  /// For gradients accumulated past the DP reducer's backward hooks (a
  /// PipelineRuntime step, which computes them with torch::autograd::grad):
  /// averages every gradient over DP now, then the TP, embedding and expert
  /// all-reduces, whatever no_sync() scopes are open. Collective over the
  /// mesh; once per step, instead of prepare_forward/after_forward/finish_backward.
  /// In every reduction a parameter without a .grad on some ranks takes part
  /// as zeros there, and one without on every rank of the group (unused, or
  /// frozen) keeps an undefined .grad, as in one process.
  /// `failed`: the exception that ended this rank's share of the step (a
  /// pipeline replica's failed step), null where it ran. The DP reducer's
  /// first all-reduce carries it (GradientReducer::synchronize): when some
  /// rank of the dense group failed, nothing is reduced, every rank drops
  /// its gradients and throws (that exception where it was thrown, one of
  /// its kind naming it on the others). The same at a dense group of one:
  /// it rethrows `failed`.
  void synchronize(const std::exception_ptr& failed = nullptr);
  /// Per-dimension counters.
  const GradientSyncStats& stats() const { return stats_; }
  /// The parameters whose gradients are summed over TP: those passed and
  /// those the stage's TensorParallelModules name, each once.
  const std::vector<torch::Tensor>& sequence_parallel_parameters() const { return sp_params_; }
  /// options.expert_parameters: the tensors reduced as experts.
  const std::vector<torch::Tensor>& expert_parameters() const { return options_.expert_parameters; }
  /// The word embedding (first stage) or the last stage's copy of it; undefined on middle
  /// stages and when not passed.
  const torch::Tensor& shared_embedding() const { return shared_embedding_; }
  /// The DP reducer over the dense group (nullptr when it is one rank).
  GradientReducer* dp_reducer() { return reducer_.get(); }
  /// The ranks that see different tokens: "dp", with "ep" and "cp" where the
  /// mesh has them above size 1. Non-expert gradients are averaged over it.
  const std::shared_ptr<Communicator>& dense_group() const { return dense_; }
  /// The ranks that hold this rank's experts: "dp", with "cp" where the mesh
  /// has it above size 1. Expert gradients are reduced over it.
  const std::shared_ptr<Communicator>& expert_replica_group() const { return replicas_; }
  /// The first and the last stage of this rank's "pp" group (this rank alone
  /// when pp == 1 and the embedding was passed), where the tied embedding's
  /// gradients are summed; nullptr on middle stages and, with
  /// options.untied_embedding at pp > 1, on every stage.
  const std::shared_ptr<Communicator>& embedding_group() const { return embedding_group_; }

 private:
  void all_reduce_grads(Communicator& group, const std::vector<torch::Tensor>& params,
                        Algorithm algo, DimensionStats& stats);
  void check_dimensions(const std::string& who) const;
  // With pp > 1: every end stage passed a shared embedding, or (untied) none
  // did; agreed over the whole mesh, so that every rank refuses together.
  void check_embedding_tie(bool end_stage, const std::string& who) const;
  void collect_sequence_parallel(const torch::nn::Module& stage, const std::string& who);
  void collect_tp_replicas(const torch::nn::Module& stage);
  // options.verify_tp_replicas at construction: the TP-replicated
  // parameters' values agree over TP (InvalidArgument on every rank of every
  // stage otherwise).
  void check_tp_replica_values(const std::string& who);
  // Before the first TP sum: the first sequence-parallel parameter whose
  // gradient is the same non-zero tensor on every TP rank (empty if none).
  std::string sequence_parallel_already_whole();
  // options.verify_tp_replicas, at the first reducing step without inf or
  // NaN: InvalidArgument on every rank of every stage (`before_sum`, this
  // stage's refusal found before the TP sum, if any).
  void verify_tp_replicas(const std::string& before_sum);
  // This stage's part: the first TP-replicated parameter whose reduced
  // gradient differs across TP (empty if none, or if the step overflowed:
  // then `deferred`).
  std::string tp_replica_mismatch(bool& deferred);
  void build_groups();
  void reduce_experts();
  // The TP, embedding and expert all-reduces of the gradients now.
  void reduce_now();

  DeviceMesh mesh_;
  std::unique_ptr<TiedCopies> embedding_;  // the shared embedding's copies
  std::shared_ptr<Communicator> embedding_group_;
  std::vector<torch::Tensor> sp_params_;
  // The parameters whole on every TP rank, by name in the stage, and the
  // layers' TP-split parameters (verify_tp_replicas).
  std::vector<std::pair<std::string, torch::Tensor>> tp_replicas_;
  std::unordered_set<const void*> tp_split_;
  bool tp_verified_ = false;
  torch::Tensor shared_embedding_;
  GradientSynchronizerOptions options_;
  std::shared_ptr<Communicator> dense_, replicas_;
  std::shared_ptr<torch::nn::Module> dense_module_;  // the non-expert parameters, with experts
  std::unique_ptr<GradientReducer> reducer_;
  GradientSyncStats stats_;
  int no_sync_depth_ = 0;
  bool deferred_ = false;  // the last prepare_forward() ran under no_sync()
};

}  // namespace cohort

namespace cohort::tensor_parallel {
using DimensionStats [[deprecated("use cohort::DimensionStats")]] = cohort::DimensionStats;
using GradientSyncStats [[deprecated("use cohort::GradientSyncStats")]] = cohort::GradientSyncStats;
using GradientSynchronizerOptions [[deprecated("use cohort::GradientSynchronizerOptions")]] =
    cohort::GradientSynchronizerOptions;
using GradientSynchronizer [[deprecated("use cohort::GradientSynchronizer")]] =
    cohort::GradientSynchronizer;
}  // namespace cohort::tensor_parallel
