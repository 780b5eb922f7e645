// defines: GPTConfig, GPTStage, a small decoder-only transformer (GPT-2
// layout, pre-LayerNorm) built from the tensor-parallel layers; one pipeline
// stage of it per rank.
//
// Activations are sequence-first, [T, B, H] as in Megatron-LM, so that
// sequence parallelism splits dimension 0. With tp > 1 every block does
//   LayerNorm -> ColumnParallelLinear(QKV) -> attention of H/tp heads ->
//   RowParallelLinear -> residual -> LayerNorm -> ColumnParallelLinear ->
//   GELU -> RowParallelLinear -> residual,
// and under sequence parallelism the LayerNorms, residuals and dropouts run
// on [T/tp, B, H] shards (the column layers all-gather the sequence, the row
// layers reduce-scatter it).
//
// The layers are cut into pp * v model chunks of L / (pp v) layers each
// (v = config.virtual_stages); PP rank p holds chunks p, p + pp, ...,
// p + (v - 1) pp (Megatron's interleaved layout; v = 1 is one stage of
// L / pp layers per rank). Chunk 0 also holds the word and position
// embeddings, the last chunk the final LayerNorm and the output layer,
// whose weight is the word embedding (tied; with pp > 1 the last rank holds
// its own copy, kept equal by GradientSynchronizer; with pp = 1 both chunks
// use the one weight), or with tie_embeddings false a table of its own
// ("output_embeddings" at any pp, drawn from another seed). Every weight is drawn from a seed
// derived from (config.seed, layer, role), so a seed gives the same model at any (tp, pp, v, ep,
// cp).
//
// With config.experts > 0 every other block (the odd layers) has a
// mixture-of-experts feed-forward (expert_parallel::MoE) in place of the
// dense one, its experts split over the mesh's "ep" dimension and each
// expert's FFN over "tp" (w1 by rows, w2 by columns, as the dense MLP). With a "cp"
// dimension above 1 each rank holds its two zig-zag chunks of the sequence
// (local_sequence) and attention is ring attention over the "cp" group.
//
// Dropout (config.dropout) draws from the stage's RngTracker
// (cohort/tensor_parallel/random.h), never from LibTorch's default
// generator: the embeddings and the residual branches from the replicated
// stream (the same masks on every TP rank, which hold them alike), the
// attention probabilities of the rank's heads and, under sequence
// parallelism, every region split along the sequence from the
// model-parallel one. So the TP ranks' replicated parameters stay equal
// with ranks as threads or processes, however those are seeded, and a
// Trainer checkpoint continues the masks. Ring attention has no dropout:
// dropout with cp > 1 is refused.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/mesh/device_mesh.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/random.h"

namespace cohort::tensor_parallel {

/// The model's sizes. hidden, heads, vocab_size (and seq_len under sequence
/// parallelism) must divide by tp, layers by pp * virtual_stages.
struct GPTConfig {
  int64_t vocab_size = 64;  ///< tokens (characters); pad to a multiple of tp
  int64_t seq_len = 16;     ///< context length T
  int64_t hidden = 32;      ///< model width H
  int64_t heads = 4;        ///< attention heads
  int64_t layers = 2;       ///< transformer blocks
  /// Attention-probability, residual and embedding dropout (training only),
  /// drawn from the stage's RngTracker; refused with ring attention (cp > 1).
  double dropout = 0.0;
  bool sequence_parallel = false;       ///< split LayerNorm/dropout regions along the sequence
  bool checkpoint_activations = false;  ///< keep only each block's input; recompute in backward
  int virtual_stages = 1;               ///< model chunks per PP rank (interleaved schedules)
  uint64_t seed = 1234;                 ///< seed of every weight
  /// The output layer is the word embedding (tied); false: a table of its
  /// own, so no stage has a shared_embedding_weight() and the
  /// GradientSynchronizer needs GradientSynchronizerOptions::untied_embedding.
  bool tie_embeddings = true;
  /// Experts of each MoE feed-forward (every other block); 0: dense blocks only.
  int64_t experts = 0;
  int64_t top_k = 1;              ///< experts per token (1 or 2)
  double capacity_factor = 1.25;  ///< slots per expert, as MoEOptions
  double aux_loss_coef = 0.01;    ///< weight of the load-balancing loss added by loss()
  /// For tests only: the ring step whose K/V block attention leaves out
  /// (RingAttentionOptions::skip_step) under context parallelism; -1: none.
  int ring_skip_step = -1;
};

class TransformerBlockImpl;

/// One PP rank's model chunks of the GPT on one TP rank (one pipeline stage
/// when virtual_stages is 1).
class GPTStageImpl : public torch::nn::Module {
 public:
  /// Throws InvalidArgument when a size does not divide (naming it).
  GPTStageImpl(const DeviceMesh& mesh, GPTConfig config);

  /// Every chunk of this rank in turn: the model's pipeline stage when v is
  /// 1, the whole model when pp is 1. Throws InvalidArgument when pp and v
  /// are both above 1 (the chunks are not consecutive; use forward_chunk).
  torch::Tensor forward(const torch::Tensor& input);
  /// Local chunk k (global chunk k pp + pp_rank). Chunk 0: ids [B, T] int64
  /// -> hidden; other chunks: hidden -> hidden; the last chunk returns
  /// vocab-parallel logits [T, B, V/tp]. Hidden states are [T, B, H], or
  /// [T/tp, B, H] under sequence parallelism. With experts (pp 1) a chunk
  /// after the first takes the previous chunk's output itself, or a view or
  /// detached alias of it (its micro-batch's load-balancing losses travel
  /// with it), else InvalidArgument.
  torch::Tensor forward_chunk(int k, const torch::Tensor& input);
  /// Last stage: the mean cross-entropy of `logits` (from forward) against
  /// targets [B, T], the same value on every TP rank; targets equal to -100
  /// are ignored (left out of the mean), as in LibTorch. With experts, plus
  /// every MoE's load-balancing loss of the forward that returned `logits`
  /// (whatever forwards ran since): pass forward's output itself (or a view
  /// of it), else InvalidArgument.
  /// Under context parallelism targets are this rank's columns
  /// (local_sequence) and the mean is over the counted targets of every cp
  /// rank (context_parallel::sequence_mean_loss): the same value on each,
  /// the gradient weighted for the GradientSynchronizer's average over cp.
  /// Data-parallel ranks stay a mean of their means (as DDP). The experts'
  /// load-balancing losses count here by value only: each MoE passes its own
  /// the gradient this loss gets, in the backward of its block (of its own
  /// model chunk, where a pipeline differentiates the chunks apart). Under
  /// context parallelism the load-balancing losses are the whole sequences'
  /// too (MoEOptions::sequence_group).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets);
  /// The sum of this stage's MoE load-balancing losses from the last forward
  /// (a zero scalar without experts).
  torch::Tensor aux_loss() const;
  /// The experts' parameters (split over "ep"): GradientSynchronizerOptions::
  /// expert_parameters. Empty without experts.
  std::vector<torch::Tensor> expert_parameters() const;
  /// This rank's columns of a [B, T] batch of ids or targets under context
  /// parallelism (its two zig-zag chunks of the sequence); `full` itself at
  /// cp 1.
  torch::Tensor local_sequence(const torch::Tensor& full) const;

  /// Parameters replicated over TP whose gradients are partial under
  /// sequence parallelism (LayerNorms, row-parallel biases); empty without it.
  std::vector<torch::Tensor> sequence_parallel_parameters() const;
  /// The word embedding (first stage) or the output layer's copy of it (last
  /// stage); undefined on middle stages and when the embeddings are untied.
  torch::Tensor shared_embedding_weight() const;

  /// The parameters local chunk k uses (the tied weight in both the first
  /// and the last chunk when one rank holds both).
  std::vector<torch::Tensor> chunk_parameters(int k) const;
  /// The global index (pipeline stage) of local chunk k: k pp + pp_rank.
  int chunk_index(int k) const { return k * pp_ + pp_rank_; }
  int num_chunks() const { return config_.virtual_stages; }  ///< local chunks (v)

  const GPTConfig& config() const { return config_; }  ///< the sizes
  /// The random streams every dropout of this stage draws from: the
  /// replicated one on the residual stream and the embeddings (without
  /// sequence parallelism), the model-parallel one on the attention
  /// probabilities and on every region split along the sequence. Seeded by
  /// config.seed; registered as the module "rng", so the Trainer
  /// checkpoints it.
  const RngTracker& rng_tracker() const { return rng_; }
  bool is_first() const { return first_; }  ///< holds the embeddings
  bool is_last() const { return last_; }    ///< holds the output layer

 private:
  torch::Tensor embed(const torch::Tensor& ids);
  torch::Tensor head(torch::Tensor h);

  GPTConfig config_;
  std::shared_ptr<Communicator> tp_, cp_;
  int pp_, pp_rank_;
  bool first_, last_;
  VocabParallelEmbedding word_embeddings_{nullptr};
  torch::Tensor position_embeddings_;
  RngTracker rng_{nullptr};
  std::vector<std::vector<std::shared_ptr<TransformerBlockImpl>>> chunks_;  // local chunk -> blocks
  torch::nn::LayerNorm final_layernorm_{nullptr};
  // The last stage's copy of the word embedding (tied, pp > 1), or its own
  // output table (untied).
  VocabParallelEmbedding output_embeddings_{nullptr};
  // With experts, one forward's: `scale`, the gradient its loss gets (written
  // by the loss's backward, read by its MoEs' load-balancing gradients), and
  // `aux`, the value of its MoEs' load-balancing losses so far.
  struct MicroBatch {
    torch::Tensor scale, aux;
  };
  // Kept with the outputs they belong to (chunk outputs and logits, by
  // storage), so that a forward in between (an evaluation, another
  // micro-batch) leaves them alone; dropped once an output is freed.
  std::vector<std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, MicroBatch>> micro_batches_;
  void remember(const torch::Tensor& out, MicroBatch mb);
  // The micro-batch of an output of forward; InvalidArgument naming `op` if
  // `t` is none.
  MicroBatch micro_batch_of(const torch::Tensor& t, const std::string& op) const;
};
TORCH_MODULE(GPTStage);

/// The one place where a stage's parameter names differ from the unsplit
/// (pp = 1) model's: with pp > 1 the last stage holds a copy of the tied word
/// embedding as "output_embeddings.weight"; in a checkpoint it is
/// "word_embeddings.weight" (written once, from the first stage; loaded into
/// both). Every other name is the same at any (tp, pp), since blocks are
/// named by their global layer ("block<l>"). Pass it as the `tied` names of
/// dcp::get_state_dict with its mesh (none when the embeddings are untied).
std::map<std::string, std::string> gpt_tied_parameters();

}  // namespace cohort::tensor_parallel
