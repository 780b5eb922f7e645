// defines: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
// Megatron-LM's tensor-parallel layers as torch::nn modules.
//
// A linear layer y = x A^T + b with A of shape [out, in] is split either by
// output rows (column parallel: each rank computes out/tp features of y) or
// by input columns (row parallel: each rank holds in/tp inputs and a partial
// sum, all-reduced). A column-parallel layer followed by a row-parallel one
// (an MLP, or attention's QKV and output projection) needs one all-reduce in
// forward and one in backward.
//
// Initialization: every layer draws its full (tp = 1) weights from a CPU
// generator seeded with its seed and keeps its slice, so a shard equals the
// matching slice of the same layer at tp = 1, and one seed gives one model at
// any tp size. (This costs one full weight per rank at construction; fine for
// the model sizes of the tests and the example.)
//
// The seed is the `seed` option where set. Without it the layer draws one,
// as torch::nn::Linear draws its weights: every rank of its TP group draws
// 64 bits from LibTorch's default CPU generator (one draw per layer on every
// rank, so generators that agreed before the layer still agree after it),
// the group all-gathers the draws (8 bytes a rank) and every rank takes the
// smallest. So torch::manual_seed(s) before the model draws the same model
// again, two layers of one shape differ, and the shards of every TP rank
// are slices of one full weight whatever each rank drew: ranks as processes
// seeded alike (LibTorch's default seed, or one manual_seed) all draw the
// same value, and the model does not depend on tp; ranks seeded apart
// agree on the smallest; ranks as threads, which share the default
// generator, each draw one value of the layer's round, and the smallest
// does not depend on which thread drew which (the all-gather ends a round
// on every rank only after every rank drew, so rounds do not mix). Without
// a seed, construction is therefore collective over the TP group: every
// rank builds the group's unseeded layers in the same order, as it issues
// their collectives. The data-parallel replicas of a layer (the other TP
// groups of a mesh) draw on their own: alike where their generators agree,
// and otherwise made equal by DDP, FSDP and the mesh's synchronizer (which
// broadcast rank 0's values) or refused by ZeRO and the fused optimizer
// (which compare them); a mesh-wide agreement would pair a pipeline
// stage's layers with another stage's. seed() is the seed a layer used.
//
// Each layer is a torch::nn::Cloneable: its reset() draws its parameters
// from seed() and marks them (mark_tensor_parallel_split), and clone() runs
// reset() on the copy before it copies the values in, so a clone's parts
// carry the original's marks and the modes that replicate parameters refuse
// a group across TP for it as for the original. reset() neither draws from
// the default generator nor communicates: a clone copies the original's
// values on one rank alone.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <optional>

#include "cohort/comm/communicator.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/mesh/tensor_parallel_module.h"

namespace cohort::tensor_parallel {

/// Options of ColumnParallelLinear.
struct ColumnParallelLinearOptions {
  bool bias = true;            ///< add a bias (sharded like the outputs)
  bool gather_output = false;  ///< all-gather the output features (else each rank keeps its shard)
  bool sequence_parallel =
      false;  ///< the input is split along dim 0 (the sequence): all-gather it first
  /// Seed of the full weights; unset: drawn from LibTorch's default CPU
  /// generator, alike on the TP group (see the file comment).
  std::optional<uint64_t> seed;
};

/// y = x A^T + b with A split by output features: A_i is [out/tp, in].
class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl>,
                                 public TensorParallelModule {
 public:
  /// Over `tp`, a 1-D mesh (`mesh["tp"]`). Throws InvalidArgument when tp is
  /// not 1-D or out_features does not divide by its size. Collective over
  /// tp without a seed (file comment).
  ColumnParallelLinearImpl(const DeviceMesh& tp, int64_t in_features, int64_t out_features,
                           ColumnParallelLinearOptions options = {});
  /// The same over a bare group.
  [[deprecated(
      "use the DeviceMesh form: ColumnParallelLinear(DeviceMesh::from_group(group, \"tp\"), "
      "...)")]] ColumnParallelLinearImpl(std::shared_ptr<Communicator> tp_group,
                                         int64_t in_features, int64_t out_features,
                                         ColumnParallelLinearOptions options = {});
  /// x: [..., in] (under sequence parallelism [s/tp, ..., in]); returns
  /// [..., out/tp], or [..., out] with gather_output.
  torch::Tensor forward(const torch::Tensor& x);
  /// The TP group the layer's collectives run over.
  const std::shared_ptr<Communicator>& process_group() const { return group_; }
  /// The options it was built with (the seed unset if it was).
  const ColumnParallelLinearOptions& options() const { return options_; }
  /// The seed its weights are drawn from: options().seed, or the one drawn.
  uint64_t seed() const { return seed_; }

  /// Registers this rank's part of the weights drawn from seed() and marks
  /// it (file comment); the constructor and clone() call it.
  void reset() override;
  /// {weight, bias}: both split by output features (dimension 0).
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override;
  /// process_group().
  std::shared_ptr<Communicator> tensor_parallel_group() const override { return group_; }
  /// options().sequence_parallel.
  bool sequence_parallel() const override { return options_.sequence_parallel; }

  torch::Tensor weight;  ///< [out/tp, in]
  torch::Tensor bias;    ///< [out/tp], undefined without bias

 private:
  std::shared_ptr<Communicator> group_;
  ColumnParallelLinearOptions options_;
  uint64_t seed_ = 0;
  int64_t in_ = 0, out_ = 0;
};
TORCH_MODULE(ColumnParallelLinear);

/// Options of RowParallelLinear.
struct RowParallelLinearOptions {
  bool bias = true;  ///< add a bias (replicated on every TP rank, added after the reduction)
  bool input_is_parallel = true;  ///< the input is already split by features (else it is scattered)
  bool sequence_parallel =
      false;  ///< reduce-scatter the output along dim 0 instead of all-reducing
  /// Seed of the full weights; unset: drawn from LibTorch's default CPU
  /// generator, alike on the TP group (see the file comment).
  std::optional<uint64_t> seed;
};

/// y = x A^T + b with A split by input features: A_i is [out, in/tp].
/// Under sequence parallelism each TP rank adds the bias to its own part of
/// the sequence, so the bias gradient is a partial sum per rank: the layer
/// names it (TensorParallelModule), and a GradientSynchronizer over a stage
/// that holds the layer sums it over TP.
class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl>,
                              public TensorParallelModule {
 public:
  /// Over `tp`, a 1-D mesh (`mesh["tp"]`). Throws InvalidArgument when tp is
  /// not 1-D or in_features does not divide by its size. Collective over
  /// tp without a seed (file comment).
  RowParallelLinearImpl(const DeviceMesh& tp, int64_t in_features, int64_t out_features,
                        RowParallelLinearOptions options = {});
  /// The same over a bare group.
  [[deprecated(
      "use the DeviceMesh form: RowParallelLinear(DeviceMesh::from_group(group, \"tp\"), "
      "...)")]] RowParallelLinearImpl(std::shared_ptr<Communicator> tp_group, int64_t in_features,
                                      int64_t out_features, RowParallelLinearOptions options = {});
  /// x: [..., in/tp] (or [..., in] without input_is_parallel); returns
  /// [..., out] (under sequence parallelism [s/tp, ..., out]).
  torch::Tensor forward(const torch::Tensor& x);
  /// The TP group the layer's collectives run over.
  const std::shared_ptr<Communicator>& process_group() const { return group_; }
  /// The options it was built with (the seed unset if it was).
  const RowParallelLinearOptions& options() const { return options_; }
  /// The seed its weights are drawn from: options().seed, or the one drawn.
  uint64_t seed() const { return seed_; }

  /// Registers this rank's part of the weights drawn from seed() and marks
  /// it (file comment); the constructor and clone() call it.
  void reset() override;
  /// {weight}, split by input features (dimension 1): the bias is whole on
  /// every TP rank.
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override;
  /// process_group().
  std::shared_ptr<Communicator> tensor_parallel_group() const override { return group_; }
  /// options().sequence_parallel.
  bool sequence_parallel() const override { return options_.sequence_parallel; }
  /// {bias} under sequence parallelism with a bias, else empty.
  std::vector<torch::Tensor> sequence_parallel_parameters() const override;

  torch::Tensor weight;  ///< [out, in/tp]
  torch::Tensor bias;    ///< [out], replicated; under sequence parallelism its
                         ///< gradient is a partial sum per TP rank

 private:
  std::shared_ptr<Communicator> group_;
  RowParallelLinearOptions options_;
  uint64_t seed_ = 0;
  int64_t in_ = 0, out_ = 0;
};
TORCH_MODULE(RowParallelLinear);

/// Options of VocabParallelEmbedding.
struct VocabParallelEmbeddingOptions {
  double init_std = 1.0;  ///< weights ~ N(0, init_std^2), as torch::nn::Embedding for 1.0
  /// Seed of the full table; unset: drawn from LibTorch's default CPU
  /// generator, alike on the TP group (see the file comment).
  std::optional<uint64_t> seed;
};

/// An embedding table split by vocabulary rows: rank i holds the ids
/// [i * V/tp, (i + 1) * V/tp); ids elsewhere look up zeros, and an
/// all-reduce over TP adds the rows together, so every id in [0, V) is found
/// on exactly one rank.
class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl>,
                                   public TensorParallelModule {
 public:
  /// Over `tp`, a 1-D mesh (`mesh["tp"]`). Throws InvalidArgument when tp is
  /// not 1-D or num_embeddings does not divide by its size (pad the
  /// vocabulary to a multiple of tp). Collective over tp without a seed
  /// (file comment).
  VocabParallelEmbeddingImpl(const DeviceMesh& tp, int64_t num_embeddings, int64_t embedding_dim,
                             VocabParallelEmbeddingOptions options = {});
  /// The same over a bare group.
  [[deprecated(
      "use the DeviceMesh form: VocabParallelEmbedding(DeviceMesh::from_group(group, \"tp\"), "
      "...)")]] VocabParallelEmbeddingImpl(std::shared_ptr<Communicator> tp_group,
                                           int64_t num_embeddings, int64_t embedding_dim,
                                           VocabParallelEmbeddingOptions options = {});
  /// ids: int64 of any shape, the same on every TP rank; returns [ids...,
  /// embedding_dim] on every TP rank. Throws InvalidArgument on every TP rank,
  /// before the all-reduce, for an id outside [0, num_embeddings), naming it
  /// and its (flat) index.
  torch::Tensor forward(const torch::Tensor& ids);

  int64_t vocab_start_index() const { return start_; }  ///< first id of this rank's rows
  int64_t vocab_end_index() const { return end_; }      ///< one past the last
  /// The seed its table is drawn from: the option, or the one drawn.
  uint64_t seed() const { return seed_; }
  /// The TP group the layer's collectives run over.
  const std::shared_ptr<Communicator>& process_group() const { return group_; }

  /// Registers this rank's part of the weights drawn from seed() and marks
  /// it (file comment); the constructor and clone() call it.
  void reset() override;
  /// {weight}: split by vocabulary rows (dimension 0).
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override;
  /// process_group().
  std::shared_ptr<Communicator> tensor_parallel_group() const override { return group_; }
  /// false: its ids and output are whole on every TP rank.
  bool sequence_parallel() const override { return false; }

  torch::Tensor weight;  ///< [num_embeddings/tp, embedding_dim]

 private:
  void check_ids(const torch::Tensor& ids) const;
  std::shared_ptr<Communicator> group_;
  int64_t num_embeddings_ = 0, embedding_dim_ = 0, start_ = 0, end_ = 0;
  VocabParallelEmbeddingOptions options_;
  uint64_t seed_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

/// How vocab_parallel_cross_entropy reduces the per-token losses.
enum class CrossEntropyReduction {
  None,  ///< the loss per token, [...]
  Mean,  ///< their mean over the targets that are not ignored (NaN when all are)
  Sum,   ///< their sum
};

/// Options of vocab_parallel_cross_entropy, as
/// torch::nn::functional::CrossEntropyFuncOptions (but per token by default).
struct VocabParallelCrossEntropyOptions {
  /// A target equal to it adds 0 to the loss and to the gradient; -100 as in
  /// LibTorch (may also be a class in [0, V), which is then ignored).
  int64_t ignore_index = -100;
  /// Per token (the default), mean or sum.
  CrossEntropyReduction reduction = CrossEntropyReduction::None;
};

/// Cross-entropy of logits split by vocabulary over `tp_group` (rank i holds
/// columns [i * V/tp, (i + 1) * V/tp)) without gathering them: a max, a
/// target logit and a sum of exponentials are all-reduced (three small
/// all-reduces of one value per token). logits: floating point
/// [..., V/tp], target: int64 [...], the same on every TP rank; returns the
/// loss per token, [...] (or reduced, see the options), in the logits'
/// dtype. Half-precision logits (bfloat16, float16) are computed, reduced
/// and all-reduced in float32 and the loss and gradient cast back, as
/// Megatron-LM does. Backward is local. Throws InvalidArgument on every TP
/// rank, before any all-reduce, for a target outside [0, V) that is not
/// ignore_index, naming the target and its (flat) index, and for integer
/// logits.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                           Communicator& tp_group,
                                           const VocabParallelCrossEntropyOptions& options = {});

/// The parameters of `module` (itself and every descendant) that a
/// TensorParallelModule splits over a group of two or more ranks, each with
/// the dimension it is split along (TensorParallelModule::tensor_parallel_splits),
/// keyed by its TensorImpl: for the layers above a column-parallel weight
/// and bias and a vocab-parallel table along 0, a row-parallel weight along
/// 1; a layer of one's own names its own. Every other parameter (a
/// row-parallel bias, and every parameter of a layer over a group of one
/// rank, included) is whole on every TP rank. The gradient norms, dcp's
/// checkpoints and the Trainer's wirings cut by it. Throws InvalidArgument
/// naming the module for a TensorParallelModule without a group, or one that
/// splits a parameter along a dimension it does not have.
std::map<const void*, int64_t> split_dims(torch::nn::Module& module);

/// 64 bits drawn from LibTorch's default CPU generator (under its mutex):
/// the seed a layer built without one starts from (file comment).
uint64_t draw_seed();
/// Collective over `g` (one all-gather of a word; none at size 1): the
/// smallest of every rank's `mine`, so that ranks whose draws differ (ranks
/// as threads share the default generator) agree on one seed.
uint64_t smallest_over(uint64_t mine, Communicator& g);

/// The full (tp = 1) weights a layer with `seed` draws, as ColumnParallelLinear
/// and RowParallelLinear do: {weight [out, in], bias [out]}, uniform in
/// ±1/sqrt(in) as torch::nn::Linear. For tests and references.
std::pair<torch::Tensor, torch::Tensor> master_linear_weights(int64_t in_features,
                                                              int64_t out_features, uint64_t seed);
/// The full table VocabParallelEmbedding with `options` draws (pass a layer
/// built without a seed its seed(): options.seed). Throws InvalidArgument
/// when options.seed is unset.
torch::Tensor master_embedding_weight(int64_t num_embeddings, int64_t embedding_dim,
                                      const VocabParallelEmbeddingOptions& options);

}  // namespace cohort::tensor_parallel
