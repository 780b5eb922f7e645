// defines: MoE, a mixture-of-experts feed-forward layer whose E experts are
// split over an expert-parallel ("ep") group, and the parameter split that
// data parallelism needs around it.
//
// Every rank of the ep group routes its own tokens with a replicated router
// (routing.h), sends each kept assignment's row to the rank holding its
// expert (E / ep experts per rank, expert e on rank e / (E / ep)), runs its
// experts on what it received, and sends the results back, where they are
// weighted by the gates and summed per token. Both exchanges are
// all_to_all_single with the per-expert counts exchanged first; backward runs
// them in reverse (all_to_all.h).
//
// Initialization: every rank draws the full (ep = 1, tp = 1) router and
// experts from a CPU generator seeded with the layer's seed and keeps its
// experts (and, over tp, its slice of each), so one seed is one model at
// every ep and tp size (as the tensor-parallel layers do). The seed is the
// `seed` option where set (the weights are then that seed's, whatever else
// the program drew). Unset, the layer draws one as the tensor-parallel
// layers do: every rank of its ep, tp and sequence groups draws 64 bits from
// LibTorch's default CPU generator (one draw per layer on every rank), and
// the smallest is taken over the ep group, then over tp, then over the
// sequence group. Over groups of one mesh (MoE(mesh, options)) that is the
// smallest draw of the ranks that hold parts of this one layer, so two
// layers of one shape differ, torch::manual_seed(s) before the model draws
// it again, and every rank's experts are slices of one full set; the seed
// is then compared over the three groups like every option (MismatchError
// where groups not of one mesh left ranks apart). Construction without a
// seed is therefore collective over the three groups in every rank's order
// of unseeded layers. Built over a mesh, the layer agrees over its other
// dimensions (the data-parallel replicas; "pp" excepted) too; built over
// groups it cannot see its replicas, which then draw on their own: alike
// where their generators agree (processes seeded alike), else unequal, and
// nothing broadcasts experts over dp, so pass a seed there when the ranks'
// generators differ (a manual_seed per rank, ranks as threads). seed() is
// the seed used.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/expert_parallel/routing.h"
#include "cohort/mesh/device_mesh.h"

namespace cohort::expert_parallel {

/// Options of MoE.
struct MoEOptions {
  int64_t hidden = 0;             ///< H, the token width (input and output)
  int64_t ffn = 0;                ///< F, each expert's inner width (H -> F -> GELU -> H)
  int64_t experts = 0;            ///< E, experts in total over the ep group
  int64_t top_k = 1;              ///< k, experts per token: 1 (Switch) or 2 (GShard)
  double capacity_factor = 1.25;  ///< C = ceil(capacity_factor * T * k / E) per expert
  double aux_loss_coef = 0.01;    ///< weight of the load-balancing loss in aux_loss()
  /// Seed of the full weights; unset: drawn from LibTorch's default CPU
  /// generator, alike on the ep, tp and sequence groups (file comment).
  std::optional<uint64_t> seed;
  /// The expert-parallel group (a mesh's "ep" dimension); null: one process
  /// holding all experts, no communication.
  std::shared_ptr<Communicator> ep_group;
  /// The tensor-parallel group (a mesh's "tp" dimension) that splits each
  /// expert's FFN as the dense MLP is split (expert tensor parallelism): w1
  /// and b1 by rows, w2 by columns, F / tp each; the input's gradient and
  /// the output are all-reduced over it. Its ranks must route the same
  /// tokens alike (the same input and router). Null: whole experts.
  std::shared_ptr<Communicator> tp_group;
  /// The context-parallel group (a mesh's "cp" dimension): the ranks that
  /// hold other tokens of the same sequences. The load-balancing loss is
  /// then the whole sequences' (load_balancing_loss over the group), the
  /// same value on each of its ranks, its gradient weighted for the average
  /// over it. Routing and capacity stay per rank's tokens. Null: this rank's
  /// tokens only.
  std::shared_ptr<Communicator> sequence_group;
};

/// y = sum over a token's kept assignments of gate * expert(x). Dropped
/// assignments add nothing: the residual connection is the caller's.
class MoEImpl : public torch::nn::Module {
 public:
  /// Collective over ep_group, tp_group and sequence_group: one all-gather over each that
  /// checks E, k, H, F, the capacity factor, the aux loss coefficient and
  /// the seed (or that it is unset) agree; without a seed, then the
  /// seed's draw and agreement (file comment). Throws on every rank:
  /// MismatchError naming the group, two ranks and their values,
  /// InvalidArgument when E does not divide by the ep size or an option is
  /// out of range.
  explicit MoEImpl(MoEOptions options);
  /// Over a mesh: its "ep" dimension splits the experts and its "tp"
  /// dimension, when it has one, each expert's FFN; its "cp" dimension is
  /// the sequence group (the groups options' ep_group, tp_group and
  /// sequence_group name, which must then be unset: InvalidArgument); other
  /// dimensions hold replicas. A mesh without "ep" holds every expert.
  /// Collective over every dimension but "pp" (a pipeline's stages build
  /// different layers): the agreement covers the replicas' dimensions too,
  /// and an unseeded layer takes the smallest draw over them as well, so
  /// its data-parallel replicas are equal however the ranks' generators
  /// were seeded.
  MoEImpl(const DeviceMesh& mesh, MoEOptions options);

  /// x: [..., H], this rank's tokens, of the parameters' dtype; returns
  /// [..., H]. Collective over the tp, sequence and ep groups (forward and
  /// backward). Sets aux_loss() and dropped(). Throws InvalidArgument on
  /// every rank of the three, naming the rank and why, when one rank's input
  /// has another width or dtype, when the TP ranks' inputs or routers differ
  /// (they must hold the same tokens), or when one rank runs without grad
  /// mode while another records the backward (README, Input agreement).
  /// Where any rank records, every rank's exchanges are in the graph, even
  /// with every parameter frozen: call backward() on every rank.
  torch::Tensor forward(const torch::Tensor& x);
  /// The router's decisions for x (sets aux_loss() and dropped()). An input
  /// of another width or dtype: InvalidArgument on this rank and, with a
  /// sequence group, every rank of it.
  Routing route(const torch::Tensor& x);
  /// Runs x through the experts as `routing` says (forward is
  /// forward_routed(x, route(x))). Collective and checked as forward, but
  /// over the tp and ep groups only.
  torch::Tensor forward_routed(const torch::Tensor& x, const Routing& routing);

  /// aux_loss_coef * load_balancing_loss of the last route(): add it to the
  /// loss. It covers this rank's tokens, and with a sequence_group those of
  /// every rank of it.
  const torch::Tensor& aux_loss() const { return aux_loss_; }
  /// Assignments of this rank's tokens that the last route() dropped.
  int64_t dropped() const { return dropped_; }
  /// E / ep, the experts this rank holds.
  int64_t local_experts() const { return local_; }
  /// The global id of this rank's first expert (ep rank * E / ep).
  int64_t first_expert() const { return first_; }
  /// What it was built with (the seed unset if it was).
  const MoEOptions& options() const { return options_; }
  /// The seed its weights are drawn from: options().seed, or the one drawn.
  uint64_t seed() const { return seed_; }

  torch::Tensor router;  ///< [E, H], replicated
  torch::Tensor w1;      ///< [E / ep, F / tp, H], this rank's experts
  torch::Tensor b1;      ///< [E / ep, F / tp]
  torch::Tensor w2;      ///< [E / ep, H, F / tp]
  torch::Tensor b2;      ///< [E / ep, H], replicated over tp

 private:
  void agree() const;
  /// 0, or why x cannot be routed as one word (input_agreement.h).
  int64_t input_refusal(const torch::Tensor& x) const;
  /// This rank's backward flags for x (input_agreement.h's Backward).
  int64_t backward_flags(const torch::Tensor& x) const;
  /// Over the tp group (one all-gather): every TP rank's refusal and flags,
  /// merged into `word` (a peer's relayed, or the group's own when the TP
  /// ranks' inputs or routers differ) and `flags`.
  void agree_over_tp(const torch::Tensor& x, int64_t& word, int64_t& flags) const;
  /// route(x), except where `word` is nonzero (this rank's refusal, or one
  /// relayed; it still joins the sequence group's all-reduce); relays the
  /// sequence group's refusals and flags into `word` and `flags`.
  Routing route_or_refuse(const torch::Tensor& x, int64_t& word, int64_t& flags);
  /// Throws InvalidArgument naming the rank that refused its input: this
  /// one, or the one `word`'s relays and `ep_from` (the ep rank it came
  /// from, -1 for none) lead to.
  [[noreturn]] void refuse(const torch::Tensor& x, int64_t word, int ep_from) const;
  /// Throws InvalidArgument on every rank when one records the backward and
  /// another cannot (no grad mode); `own`: this rank's flags, `flags` every
  /// rank's merged, `ep_words` the count exchange's (empty without one).
  void check_backward(int64_t own, int64_t flags, const std::vector<int64_t>& ep_words) const;
  /// Of no elements, in the graph wherever `records`: what keeps the
  /// exchanges in the graph on a rank whose rows need no gradient.
  torch::Tensor anchor(bool records) const;
  /// forward_routed, or with `word` nonzero the refusal carried through the
  /// count exchange and thrown on every rank; `own` and `flags` as
  /// check_backward's.
  torch::Tensor dispatch(const torch::Tensor& x, const Routing& routing, int64_t word, int64_t own,
                         int64_t flags);
  /// Marks the tensors that differ across ranks (core/rank_local.h), so that
  /// DDP, FSDP, ZeRO, the fused optimizer, the all-reduce sync and a
  /// checkpoint without a mesh refuse them.
  void mark_split_parameters() const;
  /// Rows grouped by local expert (counts[j] each) through the experts.
  torch::Tensor run_experts(const torch::Tensor& rows, const std::vector<int64_t>& counts);

  /// The options constructor's work, `replicas` the groups of the mesh's
  /// replica dimensions (none for the options form).
  MoEImpl(MoEOptions options, std::vector<std::shared_ptr<Communicator>> replicas);
  /// The seed agree() compares: options_.seed, else the one drawn once
  /// drawn, else none.
  std::optional<uint64_t> compared_seed() const;

  MoEOptions options_;
  std::vector<std::shared_ptr<Communicator>> replicas_;
  uint64_t seed_ = 0;
  bool drawn_ = false;
  int64_t local_ = 0, first_ = 0;
  torch::Tensor aux_loss_;
  int64_t dropped_ = 0;
};
TORCH_MODULE(MoE);

/// The parameters of every MoE's experts inside `model` (itself included).
/// Their gradients are reduced over the ranks that hold the same experts
/// (same ep rank), not over ep.
std::vector<torch::Tensor> expert_parameters(const torch::nn::Module& model);
/// The expert parameters split over a tensor-parallel group of more than
/// one rank (MoEOptions::tp_group), each with the dimension it splits (w1
/// and b1: 1, w2: 2), keyed by TensorImpl, as tensor_parallel::split_dims.
std::map<const void*, int64_t> expert_tensor_split_dims(const torch::nn::Module& model);
/// Every other parameter of `model` (routers included): replicated over ep,
/// reduced over all ranks that see different tokens (dp x ep x cp).
std::vector<torch::Tensor> non_expert_parameters(const torch::nn::Module& model);

/// Why the MoE layers inside `model` are not split as `mesh` says, or empty:
/// each must split its experts over the mesh's "ep" dimension, each
/// expert's FFN over its "tp" and count its load-balancing loss over its
/// "cp", as MoE(mesh, options) does (groups of the
/// same sizes, this rank at the same rank in each; a dimension the mesh
/// lacks counts as one rank). The mesh's gradient sync, norm and checkpoint
/// place the experts by the mesh's dimensions. Local: the caller agrees on
/// the outcome over the mesh.
std::string mesh_mismatch(const torch::nn::Module& model, const DeviceMesh& mesh);

/// Averages `model`'s gradients after backward, for a loss that is the mean
/// of every rank's loss over `dense` (the ranks that see different tokens:
/// dp x ep x cp, cp being each MoE's sequence group): non-expert parameters
/// over `dense`; expert parameters summed over `expert_replicas` (the ranks
/// holding the same experts and TP part, dp x cp) and divided by
/// dense.size(), since each rank's expert gradient already sums over its ep
/// group's tokens. On a mesh pass mesh[{"dp", "ep", "cp"}] and
/// mesh[{"dp", "cp"}] (dimensions the mesh lacks left out). Collective over
/// both groups; first one all-gather over each that checks that
/// dense.size() is expert_replicas.size() times every MoE's ep size, that
/// the replicas hold the same experts at the same TP rank and each rank of
/// every MoE's sequence group equally often, and that `dense` holds one TP
/// rank and each (ep rank, cp rank) placement equally often
/// (InvalidArgument on every rank of `dense` if not: the ep group passed as
/// `expert_replicas`, the replicas passed as `dense`, a one-rank
/// `expert_replicas` while dp is above one, the whole world of a dp x ep x
/// tp mesh as `dense` with dp x tp as `expert_replicas`, dp x tp as
/// `dense`, dp x ep and dp while cp is above one).
void average_moe_gradients(const torch::nn::Module& model, Communicator& dense,
                           Communicator& expert_replicas);

}  // namespace cohort::expert_parallel
