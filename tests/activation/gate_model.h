// defines: the model of the unused-parameter tests, a checkpointed block
// that takes a branch with parameters of its own or not (Gate), its
// batches, and the data-parallel engines the tests run it under.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "cohort/activation/checkpoint_wrapper.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::gate {

using Tensors = std::vector<torch::Tensor>;

// a(x), or b(tanh(a(x))) while *use_b (read again by the recompute).
struct GateImpl : torch::nn::Module {
  explicit GateImpl(const bool* use_b_flag) : use_b(use_b_flag) {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return *use_b ? b(torch::tanh(a(x))) : a(x); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  const bool* use_b;
};
TORCH_MODULE(Gate);

// Gate -> Linear(4, 2), the gate checkpointed or not; the same values on
// every call.
inline torch::nn::Sequential make_model(const bool* use_b, bool checkpointed) {
  torch::nn::Sequential seq;
  Gate gate(use_b);
  if (checkpointed) {
    seq->push_back(checkpoint_wrapper(torch::nn::AnyModule(gate)));
  } else {
    seq->push_back(gate);
  }
  seq->push_back(torch::nn::Linear(4, 2));
  init_parameters(*seq, 7);
  return seq;
}

// Weight decay and momentum move a parameter stepped with a zero gradient.
inline const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);

// Batch k, 3 rows per rank; rank r takes rows [3r, 3r + 3) (rows()).
inline torch::Tensor inputs(int k, int world) {
  return torch::randn({3 * world, 4}, at::detail::createCPUGenerator(10 + k));
}
inline torch::Tensor targets(int k, int world) {
  return torch::randn({3 * world, 2}, at::detail::createCPUGenerator(20 + k));
}
inline torch::Tensor rows(const torch::Tensor& t, int rank) { return t.narrow(0, 3 * rank, 3); }

inline Tensors values(const std::vector<torch::Tensor>& params) {
  Tensors out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Every rank's parameters (results_of_ranks's map) against the one-process
// run's, each element within 1e-6.
inline void expect_ranks_match(const std::map<int, Tensors>& got, const Tensors& expected) {
  for (const auto& [rank, params] : got) {
    ASSERT_EQ(params.size(), expected.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LT((params[i] - expected[i]).abs().max().item<double>(), 1e-6)
          << "parameter " << i << ", rank " << rank;
    }
  }
}

// DDP (find_unused_parameters), the fused optimizer, ZeRO-1 and ZeRO-2
// alone, ZeRO-2 under DDP, AllReduceGradientSync with AdamW, fully_shard
// with each layer a unit checkpointed around it (the recompute runs the
// unit in backward) and with the root alone around the checkpointed model,
// and the units over a (world x 1) HSDP mesh (replicas only).
enum class Engine { Ddp, Fused, Zero1, Zero2, DdpZero2, AllReduce, FsdpUnits, FsdpRoot, Hsdp };
constexpr int kEngines = static_cast<int>(Engine::Hsdp) + 1;

inline bool sharded_engine(Engine e) {
  return e == Engine::FsdpUnits || e == Engine::FsdpRoot || e == Engine::Hsdp;
}

inline std::string engine_name(Engine e) {
  static const char* const names[] = {"ddp",        "fused",      "zero1",     "zero2", "ddp_zero2",
                                      "all_reduce", "fsdp_units", "fsdp_root", "hsdp"};
  return names[static_cast<int>(e)];
}

}  // namespace cohort::testing::gate
