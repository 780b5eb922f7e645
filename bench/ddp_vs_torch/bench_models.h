// defines: the three benchmark models (same layers as ddp_vs_torch.py):
//   mlp          784-1024-1024-10, 1.86M parameters
//   cnn          the Fashion-MNIST CNN: conv 32 and 64 channels 3x3,
//                max-pool, linear 128, 10 classes (1.2M parameters)
//   transformer  12 encoder layers, d_model 256, 4 heads, feed-forward 1024,
//                plus a 256x256 head (9.5M parameters)
// and make_batch, random inputs and targets of the right shape.
#pragma once

#include <torch/torch.h>

#include <string>
#include <utility>

namespace cohort::bench {

struct TransformerStackImpl : torch::nn::Module {
  torch::nn::TransformerEncoder encoder{nullptr};
  torch::nn::Linear head{nullptr};
  TransformerStackImpl() {
    auto layer = torch::nn::TransformerEncoderLayer(
        torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(1024).dropout(0.0));
    encoder = register_module("encoder", torch::nn::TransformerEncoder(layer, 12));
    head = register_module("head", torch::nn::Linear(256, 256));
  }
  torch::Tensor forward(torch::Tensor x) { return head(encoder(x)); }
};
TORCH_MODULE(TransformerStack);

// One forward+loss, so the benchmark loop is the same for every model.
struct BenchModel {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

inline torch::nn::Sequential make_mlp() {
  using namespace torch::nn;
  return Sequential(Flatten(), Linear(784, 1024), ReLU(), Linear(1024, 1024), ReLU(),
                    Linear(1024, 10));
}

inline torch::nn::Sequential make_cnn() {
  using namespace torch::nn;
  return Sequential(Conv2d(Conv2dOptions(1, 32, 3)), ReLU(), Conv2d(Conv2dOptions(32, 64, 3)),
                    ReLU(), MaxPool2d(2), Flatten(), Linear(9216, 128), ReLU(), Linear(128, 10));
}

// Inputs and targets: images (or a sequence of 16 tokens, seq-first) and
// class labels (or regression targets for the transformer).
inline std::pair<torch::Tensor, torch::Tensor> make_batch(const std::string& model, int64_t batch) {
  if (model == "transformer") {
    return {torch::randn({16, batch, 256}), torch::randn({16, batch, 256})};
  }
  return {torch::randn({batch, 1, 28, 28}), torch::randint(0, 10, {batch}, torch::kLong)};
}

}  // namespace cohort::bench
