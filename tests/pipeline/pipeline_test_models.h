// defines: the small models the pipeline tests run, with deterministic
// (thread-safe, seed-free) parameters, and their one-process reference.
#pragma once

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <vector>

#include "cohort/pipeline/pipeline_stage.h"

namespace cohort::pipeline::testing {

constexpr int64_t kWidth = 6;

// A deterministic tensor: sin over a scaled range (no random generator, so
// that ranks on threads build identical models without a global seed).
inline torch::Tensor det(std::vector<int64_t> shape, double phase) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return torch::sin(torch::arange(n, torch::kFloat32) * 0.37 + phase).reshape(shape) * 0.5;
}

// `stages` blocks of (Linear, Tanh): two layers per stage, on `device`.
inline torch::nn::Sequential make_mlp(int stages, torch::Device device = torch::kCPU) {
  torch::nn::Sequential seq;
  torch::NoGradGuard no_grad;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Linear lin(kWidth, kWidth);
    lin->weight.copy_(det({kWidth, kWidth}, s));
    lin->bias.copy_(det({kWidth}, 10 + s));
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
  }
  seq->to(device);
  return seq;
}

inline std::vector<int64_t> mlp_boundaries(int stages) {
  std::vector<int64_t> b;
  for (int s = 1; s < stages; ++s) b.push_back(2 * s);
  return b;
}

inline torch::Tensor mse(const Tensors& out, const Tensors& target) {
  return torch::nn::functional::mse_loss(out[0], target[0]);
}

struct Reference {
  std::vector<double> losses;        // per micro-batch
  std::vector<torch::Tensor> grads;  // model->parameters() order
};

// The whole batch in one process, on x's device: the mean loss, its
// gradients, and each micro-batch's loss.
inline Reference reference_run(int stages, const torch::Tensor& x, const torch::Tensor& y, int m) {
  auto model = make_mlp(stages, x.device());
  auto loss = torch::nn::functional::mse_loss(model->forward(x), y);
  loss.backward();
  Reference r;
  for (const auto& p : model->parameters()) r.grads.push_back(p.grad().clone());
  torch::NoGradGuard no_grad;
  auto xs = x.chunk(m), ys = y.chunk(m);
  for (int i = 0; i < m; ++i)
    r.losses.push_back(
        torch::nn::functional::mse_loss(model->forward(xs[i]), ys[i]).item<double>());
  return r;
}

}  // namespace cohort::pipeline::testing
