// The GPT stage and its transformer block. Head h of the QKV projection owns
// output features [3 hd h, 3 hd (h+1)) (q, k, v of one head side by side),
// so the column-parallel split gives each TP rank whole heads.
#include "examples/models/gpt_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>

#include "cohort/activation/checkpoint.h"
#include "cohort/core/error.h"
#include "cohort/tensor_parallel/mappings.h"

namespace cohort::tensor_parallel {

namespace {

// Weight seeds: one per (layer, role), the same at any (tp, pp).
uint64_t seed_of(const GPTConfig& c, int64_t layer, int role) {
  return c.seed * 1000003ULL + static_cast<uint64_t>(layer) * 16 + static_cast<uint64_t>(role);
}
constexpr int64_t kEmbeddingLayer = 1 << 20;

void require(bool ok, const std::string& what, const Communicator& g) {
  if (!ok) {
    throw InvalidArgument("cohort: GPTStage (rank " + std::to_string(g.rank()) + "): " + what);
  }
}

}  // namespace

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(std::shared_ptr<Communicator> tp, const GPTConfig& c, int64_t layer)
      : tp_(tp), c_(c) {
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
    col.seed = seed_of(c, layer, 2);
    fc1 = register_module("fc1", ColumnParallelLinear(tp, c.hidden, 4 * c.hidden, col));
    row.seed = seed_of(c, layer, 3);
    fc2 = register_module("fc2", RowParallelLinear(tp, 4 * c.hidden, c.hidden, row));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + dropout(proj(attention(qkv(ln1(x)))));
    return h + dropout(fc2(torch::gelu(fc1(ln2(h)))));
  }

  // qkv: [T, B, 3 H/tp] -> causal self-attention of this rank's heads, [T, B, H/tp].
  torch::Tensor attention(const torch::Tensor& qkv_out) {
    const auto T = qkv_out.size(0), B = qkv_out.size(1);
    const auto hd = c_.hidden / c_.heads, heads = c_.heads / tp_->size();
    auto parts = qkv_out.view({T, B, heads, 3, hd}).permute({1, 2, 3, 0, 4});  // B, h, 3, T, hd
    auto q = parts.select(2, 0), k = parts.select(2, 1), v = parts.select(2, 2);
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    auto future = torch::ones({T, T}, torch::kBool).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    auto probs = dropout(torch::softmax(scores, -1));
    return torch::matmul(probs, v).permute({2, 0, 1, 3}).reshape({T, B, heads * hd});
  }

  torch::Tensor dropout(const torch::Tensor& x) {
    return c_.dropout > 0 ? torch::dropout(x, c_.dropout, is_training()) : x;
  }

  std::vector<torch::Tensor> sequence_parallel_parameters() const {
    return {ln1->weight, ln1->bias, ln2->weight, ln2->bias, proj->bias, fc2->bias};
  }

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ColumnParallelLinear qkv{nullptr}, fc1{nullptr};
  RowParallelLinear proj{nullptr}, fc2{nullptr};

 private:
  std::shared_ptr<Communicator> tp_;
  GPTConfig c_;
};

GPTStageImpl::GPTStageImpl(const DeviceMesh& mesh, GPTConfig c)
    : config_(c), tp_(mesh.tp_group()), first_(mesh.is_pp_first()), last_(mesh.is_pp_last()) {
  const int tp = mesh.tp_size(), pp = mesh.pp_size();
  const auto& g = *tp_;
  require(
      c.hidden % c.heads == 0,
      "hidden " + std::to_string(c.hidden) + " does not divide by heads " + std::to_string(c.heads),
      g);
  require(c.heads % tp == 0,
          "heads " + std::to_string(c.heads) + " does not divide by the tensor-parallel size " +
              std::to_string(tp),
          g);
  require(c.layers % pp == 0,
          "layers " + std::to_string(c.layers) + " does not divide by the pipeline-parallel size " +
              std::to_string(pp),
          g);
  require(!c.sequence_parallel || c.seq_len % tp == 0,
          "seq_len " + std::to_string(c.seq_len) + " does not divide by the tensor-parallel size " +
              std::to_string(tp) + " (sequence parallelism)",
          g);
  VocabParallelEmbeddingOptions emb;
  emb.init_std = 0.02;
  emb.seed = seed_of(c, kEmbeddingLayer, 0);
  if (first_) {
    word_embeddings_ = register_module("word_embeddings",
                                       VocabParallelEmbedding(tp_, c.vocab_size, c.hidden, emb));
    auto gen = at::detail::createCPUGenerator(seed_of(c, kEmbeddingLayer, 1));
    position_embeddings_ = register_parameter(
        "position_embeddings", torch::empty({c.seq_len, c.hidden}).normal_(0.0, 0.02, gen));
  }
  const auto per_stage = c.layers / pp;
  for (int64_t i = 0; i < per_stage; ++i) {
    const auto layer = mesh.pp_rank() * per_stage + i;
    blocks_.push_back(register_module("block" + std::to_string(layer),
                                      std::make_shared<TransformerBlockImpl>(tp_, c, layer)));
  }
  if (last_) {
    final_layernorm_ = register_module(
        "final_layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    if (!first_) {
      output_embeddings_ = register_module(
          "output_embeddings", VocabParallelEmbedding(tp_, c.vocab_size, c.hidden, emb));
    }
  }
}

torch::Tensor GPTStageImpl::forward(const torch::Tensor& input) {
  auto h = input;
  if (first_) {
    const auto T = input.size(1);
    auto ids = input.t();  // [T, B]
    h = word_embeddings_(ids) + position_embeddings_.narrow(0, 0, T).unsqueeze(1);
    if (config_.sequence_parallel) h = scatter_to_sequence_parallel_region(h, *tp_);
    if (config_.dropout > 0) h = torch::dropout(h, config_.dropout, is_training());
  }
  for (auto& block : blocks_) {
    if (!config_.checkpoint_activations) {
      h = block->forward(h);
      continue;
    }
    // The recompute re-runs the block's TP collectives inside backward. Every
    // TP rank runs the same backward graph in the same order, so each block's
    // recompute (its forward collectives, then its backward ones) pairs up
    // across the group as the forward did.
    h = checkpoint([block](const torch::Tensor& x) { return block->forward(x); }, h,
                   block->parameters());
  }
  if (!last_) return h;
  h = final_layernorm_(h);
  h = config_.sequence_parallel ? gather_from_sequence_parallel_region(h, *tp_)
                                : copy_to_tensor_parallel_region(h, *tp_);
  return torch::matmul(h, shared_embedding_weight().t());  // [T, B, V/tp]
}

torch::Tensor GPTStageImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  VocabParallelCrossEntropyOptions o;
  o.reduction = CrossEntropyReduction::Mean;
  return vocab_parallel_cross_entropy(logits, targets.t(), *tp_, o);
}

std::vector<torch::Tensor> GPTStageImpl::sequence_parallel_parameters() const {
  if (!config_.sequence_parallel) return {};
  std::vector<torch::Tensor> out;
  for (const auto& b : blocks_) {
    auto p = b->sequence_parallel_parameters();
    out.insert(out.end(), p.begin(), p.end());
  }
  if (last_) {
    out.push_back(final_layernorm_->weight);
    out.push_back(final_layernorm_->bias);
  }
  return out;
}

torch::Tensor GPTStageImpl::shared_embedding_weight() const {
  if (first_) return word_embeddings_->weight;
  if (last_) return output_embeddings_->weight;
  return {};
}

std::map<std::string, std::string> gpt_tied_parameters() {
  return {{"output_embeddings.weight", "word_embeddings.weight"}};
}

}  // namespace cohort::tensor_parallel
