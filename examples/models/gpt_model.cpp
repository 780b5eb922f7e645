// The GPT stage and its transformer block. Head h of the QKV projection owns
// output features [3 hd h, 3 hd (h+1)) (q, k, v of one head side by side),
// so the column-parallel split gives each TP rank whole heads.
#include "examples/models/gpt_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "cohort/activation/checkpoint.h"
#include "cohort/context_parallel/layout.h"
#include "cohort/context_parallel/ring_attention.h"
#include "cohort/context_parallel/sequence_loss.h"
#include "cohort/core/error.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/tensor_parallel/mappings.h"
#include "cohort/tensor_parallel/random.h"

namespace cohort::tensor_parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Weight seeds: one per (layer, role), the same at any (tp, pp).
uint64_t seed_of(const GPTConfig& c, int64_t layer, int role) {
  return c.seed * 1000003ULL + static_cast<uint64_t>(layer) * 16 + static_cast<uint64_t>(role);
}
constexpr int64_t kEmbeddingLayer = 1 << 20;

bool has_dim(const DeviceMesh& mesh, const std::string& name) {
  const auto names = mesh.dim_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}
// The size of an optional dimension ("ep", "cp"): 1 when the mesh lacks it.
int size_of(const DeviceMesh& mesh, const std::string& name) {
  return has_dim(mesh, name) ? mesh.size(name) : 1;
}
// Its group; null when the mesh lacks it.
std::shared_ptr<Communicator> group_of(const DeviceMesh& mesh, const std::string& name) {
  return has_dim(mesh, name) ? mesh[name].process_group() : nullptr;
}
bool moe_layer(const GPTConfig& c, int64_t layer) { return c.experts > 0 && layer % 2 == 1; }

std::string number(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

void require(bool ok, const std::string& what, const Communicator& g) {
  if (!ok) {
    throw InvalidArgument("cohort: GPTStage (rank " + std::to_string(g.rank()) + "): " + what);
  }
}

// What the MoE blocks and ring attention do not compose with (yet), named
// before any block is built (the same on every rank).
void check_expert_and_context(const DeviceMesh& mesh, const GPTConfig& c, const Communicator& g) {
  const int ep = size_of(mesh, "ep"), cp = size_of(mesh, "cp");
  require(ep == 1 || c.experts > 0,
          "the mesh splits experts over ep " + std::to_string(ep) + " but config.experts is 0", g);
  if (c.experts > 0) {
    // Each MoE's load-balancing gradient is scaled by the gradient the loss
    // gets, which only the last stage sees (LossGradientTap).
    require(mesh.size("pp") == 1,
            "MoE blocks need pp 1 (their load-balancing gradients take the loss's, which only "
            "the last stage has)",
            g);
    // Under sequence parallelism each TP rank would route other tokens.
    require(!c.sequence_parallel, "MoE blocks do not take sequence parallelism", g);
    require(!c.checkpoint_activations, "MoE blocks do not take activation checkpointing", g);
  }
  if (cp > 1) {
    // Equal chunks only: the layouts the GPT is tested at (its loss,
    // sequence_mean_loss, would weigh unequal ones right).
    require(c.seq_len % (2 * cp) == 0,
            "seq_len " + std::to_string(c.seq_len) + " does not divide into 2 x cp " +
                std::to_string(cp) + " equal chunks",
            g);
    require(!c.sequence_parallel, "context parallelism does not take sequence parallelism", g);
    require(c.dropout == 0, "ring attention has no attention dropout; set dropout 0", g);
  }
}

// The load-balancing losses' gradient, per MoE and in its own chunk. A
// pipeline of model chunks (virtual_stages > 1) differentiates each chunk on
// its own, from its outputs down to its inputs: an auxiliary loss added to the
// last chunk's loss would send its gradient into the other chunks' graphs
// from there, where it is lost (a middle chunk's) or runs them before their
// own backward (chunk 0's, through the tied embedding). So, as Megatron-LM's
// MoEAuxLossAutoScaler, the loss holds the auxiliary losses' value only, and
// each MoE's output passes its auxiliary loss a gradient in the backward of
// its own chunk: the gradient the loss got (its scale: 1 / micro-batches in a
// pipeline, whatever the caller divided by otherwise), which the loss's
// backward, always earlier, records in the micro-batch's `scale`.
struct LossGradientTap : torch::autograd::Function<LossGradientTap> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor loss, torch::Tensor aux_value,
                               torch::Tensor scale) {
    ctx->saved_data["scale"] = scale;
    return loss + aux_value;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::NoGradGuard no_grad;
    ctx->saved_data["scale"].toTensor().copy_(grads[0].detach());
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

struct AuxLossGradient : torch::autograd::Function<AuxLossGradient> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor h, torch::Tensor aux,
                               torch::Tensor scale) {
    ctx->saved_data["scale"] = scale;
    return h;  // LibTorch wraps an input returned as is in a fresh view
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], ctx->saved_data["scale"].toTensor().clone(), torch::Tensor()};
  }
};

// GCC 14 at -O2 warns (-Warray-bounds, -Wstringop-overflow) inside
// LibTorch's Function::apply, where it reserves the std::vector<bool> of
// which inputs are tensors: a false positive of its vector<bool> analysis
// on LibTorch's code, not this file's.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
torch::Tensor pass_aux_loss_gradient(const torch::Tensor& h, const torch::Tensor& aux,
                                     const torch::Tensor& scale) {
  return AuxLossGradient::apply(h, aux, scale);
}

torch::Tensor tap_loss_gradient(const torch::Tensor& loss, const torch::Tensor& aux_value,
                                const torch::Tensor& scale) {
  return LossGradientTap::apply(loss, aux_value, scale);
}
#pragma GCC diagnostic pop

}  // namespace

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(const DeviceMesh& tp, std::shared_ptr<Communicator> ep,
                       std::shared_ptr<Communicator> cp, const GPTConfig& c, int64_t layer,
                       RngTracker rng)
      : tp_(tp.process_group()), cp_(cp), c_(c), rng_(std::move(rng)) {
    const bool sp = c.sequence_parallel;
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    ColumnParallelLinearOptions col;
    col.sequence_parallel = sp;
    RowParallelLinearOptions row;
    row.sequence_parallel = sp;
    col.seed = seed_of(c, layer, 0);
    qkv = register_module("qkv", ColumnParallelLinear(tp, c.hidden, 3 * c.hidden, col));
    row.seed = seed_of(c, layer, 1);
    proj = register_module("proj", RowParallelLinear(tp, c.hidden, c.hidden, row));
    if (moe_layer(c, layer)) {
      // The router replicated over TP (each TP rank routes the same tokens
      // alike), the experts split over ep and each expert's FFN over tp as
      // the dense one is. Experts as wide as the dense feed-forward.
      expert_parallel::MoEOptions o;
      o.hidden = c.hidden;
      o.ffn = 4 * c.hidden;
      o.experts = c.experts;
      o.top_k = c.top_k;
      o.capacity_factor = c.capacity_factor;
      o.aux_loss_coef = c.aux_loss_coef;
      o.seed = seed_of(c, layer, 4);
      o.ep_group = ep;
      o.tp_group = tp_;
      // Under context parallelism the load-balancing loss is the whole
      // sequences', as the cross-entropy is.
      o.sequence_group = cp;
      moe = register_module("moe", expert_parallel::MoE(o));
      return;
    }
    col.seed = seed_of(c, layer, 2);
    fc1 = register_module("fc1", ColumnParallelLinear(tp, c.hidden, 4 * c.hidden, col));
    row.seed = seed_of(c, layer, 3);
    fc2 = register_module("fc2", RowParallelLinear(tp, 4 * c.hidden, c.hidden, row));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    // The residual stream: replicated over tp, or each rank's slice of the
    // sequence under sequence parallelism.
    const bool sharded = c_.sequence_parallel;
    auto h = x + dropout(proj(attention(qkv(ln1(x)))), sharded);
    if (!moe.is_empty()) return h + dropout(moe(ln2(h)), sharded);
    return h + dropout(fc2(torch::gelu(fc1(ln2(h)))), sharded);
  }

  // qkv: [T, B, 3 H/tp] -> causal self-attention of this rank's heads, [T, B, H/tp].
  torch::Tensor attention(const torch::Tensor& qkv_out) {
    const auto T = qkv_out.size(0), B = qkv_out.size(1);
    const auto hd = c_.hidden / c_.heads, heads = c_.heads / tp_->size();
    auto parts = qkv_out.view({T, B, heads, 3, hd}).permute({1, 2, 3, 0, 4});  // B, h, 3, T, hd
    auto q = parts.select(2, 0), k = parts.select(2, 1), v = parts.select(2, 2);
    if (cp_ && cp_->size() > 1) {
      // This rank's rows are its zig-zag chunks; the mask is by global position.
      context_parallel::RingAttentionOptions o;
      o.skip_step = c_.ring_skip_step;
      auto out =
          context_parallel::ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), cp_, o);
      return out.permute({2, 0, 1, 3}).reshape({T, B, heads * hd});
    }
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    auto future = torch::ones({T, T}, scores.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    auto probs = dropout(torch::softmax(scores, -1), /*sharded=*/true);  // this rank's heads
    return torch::matmul(probs, v).permute({2, 0, 1, 3}).reshape({T, B, heads * hd});
  }

  // Dropout of a region every TP rank holds alike (the tracker's replicated
  // stream, the same masks on each) or one each rank holds its own part of
  // (`sharded`: the model-parallel stream, other masks on each).
  torch::Tensor dropout(const torch::Tensor& x, bool sharded) {
    if (c_.dropout == 0 || !is_training()) return x;
    return tensor_parallel::dropout(
        x, c_.dropout, true,
        sharded ? rng_->model_parallel(x.device()) : rng_->replicated(x.device()));
  }

  std::vector<torch::Tensor> sequence_parallel_parameters() const {
    return {ln1->weight, ln1->bias, ln2->weight, ln2->bias, proj->bias, fc2->bias};
  }

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ColumnParallelLinear qkv{nullptr}, fc1{nullptr};
  RowParallelLinear proj{nullptr}, fc2{nullptr};
  expert_parallel::MoE moe{nullptr};  // in place of fc1, fc2 in a MoE block

 private:
  std::shared_ptr<Communicator> tp_, cp_;
  GPTConfig c_;
  RngTracker rng_;  // the stage's
};

GPTStageImpl::GPTStageImpl(const DeviceMesh& mesh, GPTConfig c)
    : config_(c),
      tp_(mesh["tp"].process_group()),
      cp_(group_of(mesh, "cp")),
      pp_(mesh.size("pp")),
      pp_rank_(mesh.local_rank("pp")),
      first_(pp_rank_ == 0),
      last_(pp_rank_ == pp_ - 1) {
  const int tp = mesh.size("tp"), pp = mesh.size("pp"), v = c.virtual_stages;
  const auto& g = *tp_;
  require(
      c.hidden % c.heads == 0,
      "hidden " + std::to_string(c.hidden) + " does not divide by heads " + std::to_string(c.heads),
      g);
  require(c.heads % tp == 0,
          "heads " + std::to_string(c.heads) + " does not divide by the tensor-parallel size " +
              std::to_string(tp),
          g);
  require(v >= 1, "virtual_stages " + std::to_string(v) + " is not positive", g);
  require(c.layers % (int64_t{pp} * v) == 0,
          "layers " + std::to_string(c.layers) + " do not divide into pp " + std::to_string(pp) +
              " x virtual_stages " + std::to_string(v) + " = " + std::to_string(pp * v) +
              " model chunks",
          g);
  require(!c.sequence_parallel || c.seq_len % tp == 0,
          "seq_len " + std::to_string(c.seq_len) + " does not divide by the tensor-parallel size " +
              std::to_string(tp) + " (sequence parallelism)",
          g);
  require(c.dropout >= 0 && c.dropout <= 1, "dropout " + number(c.dropout) + " is not in [0, 1]",
          g);
  check_expert_and_context(mesh, c, g);
  // Every dropout draws from the stage's tracker, never from LibTorch's
  // default generator (random.h).
  rng_ = register_module("rng", RngTracker(mesh, c.seed));
  VocabParallelEmbeddingOptions emb;
  emb.init_std = 0.02;
  emb.seed = seed_of(c, kEmbeddingLayer, 0);
  if (first_) {
    word_embeddings_ = register_module(
        "word_embeddings", VocabParallelEmbedding(mesh["tp"], c.vocab_size, c.hidden, emb));
    auto gen = at::detail::createCPUGenerator(seed_of(c, kEmbeddingLayer, 1));
    position_embeddings_ = register_parameter(
        "position_embeddings", torch::empty({c.seq_len, c.hidden}).normal_(0.0, 0.02, gen));
  }
  // Registered in layer order, so that names and order match the unsplit model.
  const auto per_chunk = c.layers / (int64_t{pp} * v);
  chunks_.resize(v);
  for (int k = 0; k < v; ++k) {
    for (int64_t i = 0; i < per_chunk; ++i) {
      const auto layer = chunk_index(k) * per_chunk + i;
      chunks_[k].push_back(
          register_module("block" + std::to_string(layer),
                          std::make_shared<TransformerBlockImpl>(mesh["tp"], group_of(mesh, "ep"),
                                                                 cp_, c, layer, rng_)));
    }
  }
  if (last_) {
    final_layernorm_ = register_module(
        "final_layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    if (!first_ || !c.tie_embeddings) {
      auto out = emb;
      if (!c.tie_embeddings) out.seed = seed_of(c, kEmbeddingLayer, 2);
      output_embeddings_ = register_module(
          "output_embeddings", VocabParallelEmbedding(mesh["tp"], c.vocab_size, c.hidden, out));
    }
  }
}

torch::Tensor GPTStageImpl::forward(const torch::Tensor& input) {
  require(pp_ == 1 || num_chunks() == 1,
          "forward() runs the chunks of one rank in turn, which is not the model at pp " +
              std::to_string(pp_) + " x virtual_stages " + std::to_string(num_chunks()) +
              "; run each chunk (forward_chunk) as its own pipeline stage",
          *tp_);
  auto h = input;
  for (int k = 0; k < num_chunks(); ++k) h = forward_chunk(k, h);
  return h;
}

torch::Tensor GPTStageImpl::forward_chunk(int k, const torch::Tensor& input) {
  require(
      k >= 0 && k < num_chunks(),
      "chunk " + std::to_string(k) + " is not one of this rank's " + std::to_string(num_chunks()),
      *tp_);
  auto h = chunk_index(k) == 0 ? embed(input) : input;
  // With experts: chunk 0 starts a micro-batch, a later chunk continues the
  // one its input came from (pp is 1, so that is this rank's earlier chunk).
  MicroBatch mb;
  if (config_.experts > 0) {
    const auto zero = [&] { return torch::zeros({}, h.options().requires_grad(false)); };
    mb = chunk_index(k) == 0 ? MicroBatch{zero(), zero()}
                             : micro_batch_of(input, "forward_chunk(" + std::to_string(k) + ")");
  }
  for (auto& block : chunks_[k]) {
    if (!config_.checkpoint_activations) {
      h = block->forward(h);
      if (!block->moe.is_empty() && block->moe->aux_loss().defined()) {
        h = pass_aux_loss_gradient(h, block->moe->aux_loss(), mb.scale);
        mb.aux = mb.aux + block->moe->aux_loss().detach();
      }
      continue;
    }
    // The recompute re-runs the block's TP collectives inside backward. Every
    // TP rank runs the same backward graph in the same order, so each block's
    // recompute (its forward collectives, then its backward ones) pairs up
    // across the group as the forward did.
    // The recompute draws the forward's masks: the tracker's generators
    // are restored with the default ones.
    CheckpointOptions options;
    if (config_.dropout > 0) options.generators = rng_->generators(h.device());
    h = checkpoint([block](const torch::Tensor& x) { return block->forward(x); }, h,
                   block->parameters(), options);
  }
  auto out = chunk_index(k) == pp_ * num_chunks() - 1 ? head(h) : h;
  if (config_.experts > 0) remember(out, std::move(mb));
  return out;
}

void GPTStageImpl::remember(const torch::Tensor& out, MicroBatch mb) {
  // Micro-batches whose outputs are gone can no longer be asked for.
  micro_batches_.erase(std::remove_if(micro_batches_.begin(), micro_batches_.end(),
                                      [](const auto& held) { return held.first.expired(); }),
                       micro_batches_.end());
  micro_batches_.emplace_back(out.storage().getWeakStorageImpl(), std::move(mb));
}

GPTStageImpl::MicroBatch GPTStageImpl::micro_batch_of(const torch::Tensor& t,
                                                      const std::string& op) const {
  // By storage: the pipeline hands a chunk's output on detached.
  const auto* storage =
      t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  for (const auto& [held, mb] : micro_batches_) {
    if (!held.expired() && held._unsafe_get_target() == storage) return mb;
  }
  require(false,
          op + ": the tensor is not (a view of) an output of this stage's forward, which its "
               "micro-batch's load-balancing losses travel with; pass that output itself",
          *tp_);
  return {};
}

torch::Tensor GPTStageImpl::embed(const torch::Tensor& input) {
  const auto T = input.size(1);
  auto ids = input.t();  // [T, B]
  auto positions = position_embeddings_.narrow(0, 0, T);
  if (cp_ && cp_->size() > 1) {
    // The rank's rows are its two zig-zag chunks of the seq_len positions.
    const context_parallel::ZigZagLayout layout(config_.seq_len, cp_->size());
    require(T == layout.local_length(cp_->rank()),
            "input of " + std::to_string(T) + " positions is not this cp rank's " +
                std::to_string(layout.local_length(cp_->rank())) + " of seq_len " +
                std::to_string(config_.seq_len) + " (local_sequence)",
            *tp_);
    positions = position_embeddings_.index_select(0, layout.positions(cp_->rank()));
  }
  auto h = word_embeddings_(ids) + positions.unsqueeze(1);
  if (config_.sequence_parallel) h = scatter_to_sequence_parallel_region(h, *tp_);
  if (config_.dropout == 0 || !is_training()) return h;
  // Replicated over tp, or this rank's slice of the sequence.
  return tensor_parallel::dropout(
      h, config_.dropout, true,
      config_.sequence_parallel ? rng_->model_parallel(h.device()) : rng_->replicated(h.device()));
}

torch::Tensor GPTStageImpl::head(torch::Tensor h) {
  h = final_layernorm_(h);
  h = config_.sequence_parallel ? gather_from_sequence_parallel_region(h, *tp_)
                                : copy_to_tensor_parallel_region(h, *tp_);
  const auto& w = config_.tie_embeddings ? shared_embedding_weight() : output_embeddings_->weight;
  return torch::matmul(h, w.t());  // [T, B, V/tp]
}

torch::Tensor GPTStageImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  VocabParallelCrossEntropyOptions o;
  torch::Tensor loss;
  if (cp_ && cp_->size() > 1) {
    // The cp ranks hold parts of the same sequences: the mean over all
    // their counted tokens, not the mean of the ranks' means (which differ
    // in count where targets are ignored).
    const auto t = targets.t();
    loss = context_parallel::sequence_mean_loss(vocab_parallel_cross_entropy(logits, t, *tp_, o),
                                                t.ne(o.ignore_index), *cp_);
  } else {
    o.reduction = CrossEntropyReduction::Mean;
    loss = vocab_parallel_cross_entropy(logits, targets.t(), *tp_, o);
  }
  if (config_.experts == 0) return loss;
  // The value of every MoE's auxiliary loss of the logits' own forward
  // (another forward may have run since); their gradients come from the
  // blocks (AuxLossGradient), scaled by what this loss gets.
  const auto mb = micro_batch_of(logits, "loss");
  return tap_loss_gradient(loss, mb.aux.to(loss.options()), mb.scale);
}

torch::Tensor GPTStageImpl::aux_loss() const {
  auto sum = torch::zeros({});
  for (const auto& chunk : chunks_) {
    for (const auto& b : chunk) {
      if (!b->moe.is_empty() && b->moe->aux_loss().defined()) sum = sum + b->moe->aux_loss();
    }
  }
  return sum;
}

std::vector<torch::Tensor> GPTStageImpl::expert_parameters() const {
  return expert_parallel::expert_parameters(*this);
}

torch::Tensor GPTStageImpl::local_sequence(const torch::Tensor& full) const {
  if (!cp_ || cp_->size() == 1) return full;
  return context_parallel::shard_sequence(full, cp_->rank(), cp_->size(), /*dim=*/1);
}

std::vector<torch::Tensor> GPTStageImpl::sequence_parallel_parameters() const {
  if (!config_.sequence_parallel) return {};
  std::vector<torch::Tensor> out;
  for (const auto& chunk : chunks_) {
    for (const auto& b : chunk) {
      auto p = b->sequence_parallel_parameters();
      out.insert(out.end(), p.begin(), p.end());
    }
  }
  if (last_) {
    out.push_back(final_layernorm_->weight);
    out.push_back(final_layernorm_->bias);
  }
  return out;
}

std::vector<torch::Tensor> GPTStageImpl::chunk_parameters(int k) const {
  std::vector<torch::Tensor> out;
  if (chunk_index(k) == 0) {
    out.push_back(word_embeddings_->weight);
    out.push_back(position_embeddings_);
  }
  for (const auto& block : chunks_.at(k)) {
    auto p = block->parameters();
    out.insert(out.end(), p.begin(), p.end());
  }
  if (chunk_index(k) == pp_ * num_chunks() - 1) {
    auto p = final_layernorm_->parameters();
    out.insert(out.end(), p.begin(), p.end());
    if (!config_.tie_embeddings) {
      out.push_back(output_embeddings_->weight);
    } else if (chunk_index(k) != 0) {
      out.push_back(shared_embedding_weight());  // else listed above
    }
  }
  return out;
}

torch::Tensor GPTStageImpl::shared_embedding_weight() const {
  if (!config_.tie_embeddings) return {};
  if (first_) return word_embeddings_->weight;
  if (last_) return output_embeddings_->weight;
  return {};
}

std::map<std::string, std::string> gpt_tied_parameters() {
  return {{"output_embeddings.weight", "word_embeddings.weight"}};
}

}  // namespace cohort::tensor_parallel
