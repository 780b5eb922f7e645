// defines: DDP's golden case against one process, written once for ranks as
// threads (equivalence_test.cpp) and as processes (world_test.cpp): the
// problem (the one-process reference on the whole batch, on test_device())
// and one rank's DDP training on its rows of it.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "tests/ddp/ddp_test_models.h"
#include "tests/support/test_device.h"

namespace cohort::testing {

constexpr int kEquivalenceSteps = 20;
constexpr int64_t kRowsPerRank = 4;

inline std::unique_ptr<torch::optim::Optimizer> make_equivalence_optimizer(
    const std::string& name, std::vector<torch::Tensor> params) {
  if (name == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.5));
}

struct EquivalenceProblem {
  std::vector<torch::Tensor> init, expected;  // the reference's parameters, before and after
  torch::Tensor xs, ys;                       // [steps, world * rows, features]
};

// Drawn from the global generator (seed 11): call it before ranks as threads start.
inline EquivalenceProblem make_equivalence_problem(int world, const std::string& optimizer) {
  torch::manual_seed(11);
  EquivalenceProblem p;
  auto reference = make_ddp_mlp();
  reference->to(test_device());
  p.init = clone_all(reference->parameters());
  p.xs = torch::randn({kEquivalenceSteps, world * kRowsPerRank, 8}).to(test_device());
  p.ys = torch::randn({kEquivalenceSteps, world * kRowsPerRank, 4}).to(test_device());
  auto opt = make_equivalence_optimizer(optimizer, reference->parameters());
  for (int s = 0; s < kEquivalenceSteps; ++s) {
    opt->zero_grad();
    torch::mse_loss(reference->forward(p.xs[s]), p.ys[s]).backward();
    opt->step();
  }
  p.expected = clone_all(reference->parameters());
  return p;
}

struct EquivalenceRank {
  std::vector<torch::Tensor> params;
  int64_t buckets = 0, iterations = 0;
};

// This rank's DDP over its rows of every step, from rank 0's starting
// parameters (the others start elsewhere: DDP broadcasts rank 0's).
inline EquivalenceRank train_equivalence_rank(const std::shared_ptr<Communicator>& comm,
                                              const EquivalenceProblem& p,
                                              const std::string& optimizer, SyncStrategy strategy,
                                              bool bucket_view) {
  const int r = comm->rank();
  auto model = make_ddp_mlp();
  model->to(test_device());
  if (r == 0) copy_parameters(*model, p.init);
  DDPOptions options;
  options.bucket_cap_mb = 0.0005;  // ~130 floats: several buckets
  options.first_bucket_mb = 0.0002;
  options.strategy = strategy;
  options.gradient_as_bucket_view = bucket_view;
  DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
  auto opt = make_equivalence_optimizer(optimizer, ddp.parameters());
  for (int s = 0; s < kEquivalenceSteps; ++s) {
    opt->zero_grad();
    auto x = p.xs[s].narrow(0, r * kRowsPerRank, kRowsPerRank);
    auto y = p.ys[s].narrow(0, r * kRowsPerRank, kRowsPerRank);
    torch::mse_loss(ddp.forward(x), y).backward();
    opt->step();
  }
  return {clone_all(ddp.parameters()), ddp.stats().buckets, ddp.stats().iterations};
}

}  // namespace cohort::testing
