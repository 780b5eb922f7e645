// defines: what the determinism tests share: their two models (a CNN with
// BatchNorm, a small transformer) and how FSDP wraps them, the per-leaf
// data, a state's bytes compared, and the checkpoint a run starts from.
#pragma once

#include <torch/torch.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::determinism_test {

constexpr int kSteps = 20;

// 2 images of 1 x 6 x 6 per leaf -> conv 3x3 -> BatchNorm -> ReLU -> linear.
struct DetCnnImpl : torch::nn::Module {
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d norm{nullptr};
  torch::nn::Linear head{nullptr};
  DetCnnImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    norm = register_module("norm", torch::nn::BatchNorm2d(4));
    head = register_module("head", torch::nn::Linear(4 * 6 * 6, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(norm(conv(x))).flatten(1)); }
};
TORCH_MODULE(DetCnn);

// One encoder layer (d 8, 2 heads, no dropout) over 4 tokens, mean-pooled.
struct DetTransformerImpl : torch::nn::Module {
  torch::nn::TransformerEncoderLayer layer{nullptr};
  torch::nn::Linear head{nullptr};
  DetTransformerImpl() {
    layer = register_module(
        "layer",
        torch::nn::TransformerEncoderLayer(
            torch::nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(0)));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(layer(x).mean(0)); }
};
TORCH_MODULE(DetTransformer);

// FSDP: the CNN's layers as three units (conv, norm, head) of a root
// without parameters; the transformer as one unit.
inline FullyShard wrap(DetCnn& m, std::shared_ptr<Communicator> comm, const FullyShardOptions& o) {
  torch::nn::Sequential seq;
  seq->push_back("conv", m->conv);
  seq->push_back("norm", m->norm);
  seq->push_back(torch::nn::Functional([](torch::Tensor x) { return torch::relu(x).flatten(1); }));
  seq->push_back("head", m->head);
  return fully_shard(shard_blocks(seq, comm, o), comm, o);
}
inline FullyShard wrap(DetTransformer& m, std::shared_ptr<Communicator> comm,
                       const FullyShardOptions& o) {
  return fully_shard(torch::nn::AnyModule(m), comm, o);
}

// Per step and leaf: the leaf's input and target (the global batch, leaf by leaf).
struct Data {
  torch::Tensor xs, ys;
};

inline Data make_data(bool cnn, int64_t leaves) {
  torch::manual_seed(7);  // before the rank threads start
  auto xs = cnn ? torch::randn({kSteps, leaves, 2, 1, 6, 6})
                : torch::randn({kSteps, leaves, 4, 2, 8});  // (seq, batch, d)
  return {xs, torch::randn({kSteps, leaves, 2, 3})};
}

// Parameters then buffers, cloned.
inline std::vector<torch::Tensor> all_state(torch::nn::Module& m) {
  auto out = clone_all(m.parameters());
  for (const auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

inline bool same_bytes(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].defined() || !b[i].defined()) {
      if (a[i].defined() != b[i].defined()) return false;
      continue;
    }
    auto x = a[i].contiguous();
    auto y = b[i].contiguous();
    if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type()) return false;
    if (std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) != 0) return false;
  }
  return true;
}

// Where a run starts or stops: parameters then buffers, and the optimizer's
// state as LibTorch serializes it (empty: a fresh optimizer).
struct Checkpoint {
  std::vector<torch::Tensor> state;
  std::string optimizer;                                   // DDP: LibTorch's AdamW archive
  std::vector<std::map<std::string, torch::Tensor>> zero;  // ZeRO: consolidated, per parameter
};

// Starts a model from a checkpoint's parameters and buffers.
inline void load_model(torch::nn::Module& model, const Checkpoint& from) {
  torch::NoGradGuard no_grad;
  auto state = model.parameters();
  for (const auto& b : model.buffers()) state.push_back(b);
  for (size_t i = 0; i < state.size(); ++i) state[i].copy_(from.state[i]);
}

}  // namespace cohort::testing::determinism_test
