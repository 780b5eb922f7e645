// defines: the model and data of the tests of a DDP step that throws: an
// MLP with an identity before its last Linear that, while armed, throws in
// its forward or in its gradient's hook (after the last Linear's
// gradients, so after their buckets launched), and a hook on the loss that
// throws before any parameter's gradient.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

namespace cohort::testing::failing_mlp {

constexpr int kSteps = 10;
constexpr int kFailStep = 3;
constexpr int64_t kBatch = 12;  // divides by 1, 2, 3 and 6

// What the failing layer throws: a type of its own, so that a test
// catching it sees that it was not replaced on the way out.
struct LayerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where the failing layer throws while armed.
enum class Fail {
  kNot,
  kInBackward,  // in the layer's gradient hook, after some buckets launched
  kInForward,   // in the layer's forward
  kOnLoss,      // in a hook on the loss: before any parameter's gradient
};

// The identity; armed, it throws in its forward or in its gradient's hook.
struct FailingImpl : torch::nn::Module {
  std::shared_ptr<Fail> fail;
  explicit FailingImpl(std::shared_ptr<Fail> f) : fail(std::move(f)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (*fail == Fail::kInForward) throw LayerError("the layer refused");
    auto h = x.view_as(x);
    auto flag = fail;
    h.register_hook([flag](const torch::Tensor& g) {
      if (*flag == Fail::kInBackward) throw LayerError("the layer refused");
      return g;
    });
    return h;
  }
};
TORCH_MODULE(Failing);

// 8 -> 16 -> 16 -> 4, tanh, the failing identity before the last Linear
// (parameters 4 and 5); the same parameters on every call (from a
// generator of its own: ranks are threads).
inline torch::nn::Sequential make_model(const std::shared_ptr<Fail>& fail) {
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 16), torch::nn::Tanh(), Failing(fail),
                              torch::nn::Linear(16, 4));
  auto g = at::detail::createCPUGenerator(3);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.copy_(torch::randn(p.sizes(), g) * 0.3);
  return model;
}

struct Batches {
  torch::Tensor x, y;  // [kSteps, kBatch, ...]
};

inline Batches make_batches() {
  auto g = at::detail::createCPUGenerator(11);
  return {torch::randn({kSteps, kBatch, 8}, g), torch::randn({kSteps, kBatch, 4}, g)};
}

inline torch::optim::SGD make_sgd(const std::vector<torch::Tensor>& params) {
  return torch::optim::SGD(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Rows [from, from + n) of step s's batch.
inline torch::Tensor rows(const torch::Tensor& t, int s, int64_t from, int64_t n) {
  return t[s].narrow(0, from, n);
}

// The backward of one forward; throws what the failing layer (or, for
// kOnLoss, the hook on the loss) threw.
inline void backward_of(torch::Tensor loss, Fail fail) {
  if (fail == Fail::kOnLoss) {
    loss.register_hook(
        [](const torch::Tensor&) -> torch::Tensor { throw LayerError("the layer refused"); });
  }
  loss.backward();
}

// One process, the whole batch, step `skipped` left out.
inline std::vector<torch::Tensor> reference_skipping(const Batches& b, int skipped) {
  auto model = make_model(std::make_shared<Fail>(Fail::kNot));
  auto opt = make_sgd(model->parameters());
  for (int s = 0; s < kSteps; ++s) {
    if (s == skipped) continue;
    opt.zero_grad();
    torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace cohort::testing::failing_mlp
