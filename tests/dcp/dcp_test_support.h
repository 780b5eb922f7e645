// defines: the model, training and whole-state snapshots the distributed
// checkpoint tests share.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <map>
#include <string>

#include "cohort/core/torch_compat.h"
#include "cohort/dcp/dcp.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/optim/optimizer_state.h"

namespace cohort::testing::dcp_test {

using Named = std::map<std::string, torch::Tensor>;

// Parameters of 35, 21, 3, 3, 1 elements (neither 7 nor 3 rows divide by 2
// or 4), a buffer, and optionally a parameter of no elements.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  torch::Tensor scale, empty;
  NetImpl(uint64_t seed, bool with_empty) {
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
    c = register_module("c", torch::nn::Linear(3, 1));
    scale = register_buffer("scale", torch::zeros({3}));
    if (with_empty) empty = register_parameter("empty", torch::zeros({0, 4}));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(torch::randn(p.sizes(), gen));
    scale.copy_(torch::rand({3}, gen) + 0.5);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = c(torch::tanh(b(torch::tanh(a(x)))) * scale);
    return empty.defined() ? y + empty.sum() : y;
  }
};
TORCH_MODULE(Net);

inline torch::Tensor batch(uint64_t seed, int64_t rows = 6) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn({rows, 5}, gen);
}

// `steps` steps of the same batch on every rank: replicated state, as DDP.
template <typename Step>
void train(Net& net, int steps, Step&& step) {
  for (int s = 0; s < steps; ++s) {
    net->zero_grad();
    net->forward(batch(100 + s)).pow(2).mean().backward();
    step();
  }
}

// Every parameter, buffer and optimizer state tensor of a model that holds
// its parameters whole, by checkpoint name, cloned.
inline Named snapshot(torch::nn::Module& net, torch::optim::Optimizer* opt) {
  Named out;
  for (const auto& p : net.named_parameters()) out["model." + p.key()] = p.value().detach().clone();
  for (const auto& b : net.named_buffers()) out["model." + b.key()] = b.value().clone();
  if (!opt) return out;
  for (const auto& p : net.named_parameters()) {
    auto it = opt->state().find(cohort::optimizer_state_key(p.value()));
    if (it == opt->state().end()) continue;
    for (const auto& [name, t] : state_tensors(*it->second)) {
      out["optim." + p.key() + "." + name] = t.clone();
    }
    if (auto step = state_step(*it->second))
      out["optim." + p.key() + ".step"] = torch::tensor(*step);
  }
  return out;
}

inline void expect_equal(const Named& got, const Named& expected, const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (const auto& [name, t] : expected) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": " << name << " missing";
    EXPECT_TRUE(torch::equal(it->second, t)) << what << ": " << name << " differs";
  }
}

// A small Sequential with nested unnamed modules, its weights drawn from `seed`.
inline torch::nn::Sequential make_seq(uint64_t seed) {
  torch::nn::Sequential seq(torch::nn::Linear(5, 7), torch::nn::Tanh(), torch::nn::Linear(7, 3),
                            torch::nn::Tanh(), torch::nn::Linear(3, 1));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : seq->parameters()) p.copy_(torch::randn(p.sizes(), gen));
  return seq;
}

// make_seq(seed) under FSDP, one unit per Linear.
inline FullyShard make_fsdp(uint64_t seed, std::shared_ptr<Communicator> comm) {
  return fully_shard(shard_blocks(make_seq(seed), comm), comm);
}

// `before_step` runs between each backward and optimizer step.
inline void train_fsdp(FullyShard& model, torch::optim::Optimizer& opt, int steps,
                       const std::function<void()>& before_step = {}) {
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    model->forward(batch(100 + s, 12)).pow(2).mean().backward();
    if (before_step) before_step();
    opt.step();
  }
}

inline std::filesystem::path temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("cohort_dcp_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(0.01).weight_decay(0.1);

}  // namespace cohort::testing::dcp_test
