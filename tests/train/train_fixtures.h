// defines: small deterministic models and data for the trainer tests.
//
// Ranks run as threads and share LibTorch's global generator, so nothing
// here draws from it: weights and data come from private generators, and
// every rank (and the single-process reference) builds the same values.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/subprocess.h"

namespace cohort::testing {

inline torch::Generator make_generator(uint64_t seed) {
  return at::detail::createCPUGenerator(seed);
}

// Linear(8, 16) tanh Linear(16, 4): small, but with a nonlinearity so that
// accumulation order errors would show.
// Sets every parameter of `module` to values drawn from `seed`, so that
// ranks as threads, which share LibTorch's default generator, hold equal
// replicas (the wirings that broadcast nothing refuse unequal ones).
inline void fill_alike(torch::nn::Module& module, uint64_t seed = 3) {
  auto gen = make_generator(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) p.copy_(torch::randn(p.sizes(), gen, p.scalar_type()) * 0.3);
}

inline torch::nn::Sequential make_mlp(uint64_t seed = 7) {
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                            torch::nn::Linear(16, 4));
  auto gen = make_generator(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) {
    p.copy_(torch::randn(p.sizes(), gen, torch::kFloat32) * 0.3);
  }
  return net;
}

struct Synthetic {
  torch::Tensor x;  // [n, 8]
  torch::Tensor y;  // [n] classes 0..3
};

inline Synthetic make_data(int64_t n, uint64_t seed = 11) {
  auto gen = make_generator(seed);
  auto x = torch::randn({n, 8}, gen, torch::kFloat32);
  // Learnable labels: the argmax of a fixed projection.
  auto w = torch::randn({8, 4}, gen, torch::kFloat32);
  return {x, x.matmul(w).argmax(1)};
}

// One regression batch per step, the same on every rank and in the
// one-process reference (which each rank's share is cut from).
struct StepBatches {
  std::vector<torch::Tensor> x;  // [batch, in] per step
  std::vector<torch::Tensor> y;  // [batch, out] per step
};

inline StepBatches make_step_batches(int steps, int64_t batch, int64_t in, int64_t out) {
  auto gen = make_generator(3);
  StepBatches d;
  for (int s = 0; s < steps; ++s) {
    d.x.push_back(torch::randn({batch, in}, gen));
    d.y.push_back(torch::randn({batch, out}, gen));
  }
  return d;
}

}  // namespace cohort::testing
