// A checkpointed block whose forward leaves a parameter out in some steps
// (a branch): the recompute returns no gradient for it, yet the engine still
// runs its accumulator. DDP, the fused optimizer and ZeRO-2 (alone and under
// DDP) must leave its .grad undefined, as one process does, so AdamW skips
// it instead of stepping a zero gradient (weight decay and momentum would
// move it); and DDP without find_unused_parameters reports it missing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "cohort/activation/checkpoint_wrapper.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/thread_ranks.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::unused_parameter_test {
namespace {

using Tensors = std::vector<torch::Tensor>;

// a(x), or b(tanh(a(x))) while *use_b.
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

torch::nn::Sequential make_model(const bool* use_b, bool checkpointed) {
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

constexpr int kSteps = 3;  // b is used in step 0 only
const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);

// Step s's batch, 3 rows per rank; rank r takes rows [3r, 3r + 3).
torch::Tensor inputs(int step, int world) {
  return torch::randn({3 * world, 4}, at::detail::createCPUGenerator(10 + step));
}
torch::Tensor targets(int step, int world) {
  return torch::randn({3 * world, 2}, at::detail::createCPUGenerator(20 + step));
}

// One process, no checkpointing, the whole batch: the mean of the ranks'
// equal-sized means is the mean over all rows.
Tensors reference(int world) {
  bool use_b = true;
  auto model = make_model(&use_b, false);
  torch::optim::AdamW opt(model->parameters(), kAdamW);
  for (int s = 0; s < kSteps; ++s) {
    use_b = s == 0;
    model->zero_grad(/*set_to_none=*/true);
    torch::mse_loss(model->forward(inputs(s, world)), targets(s, world)).backward();
    opt.step();
  }
  Tensors out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

enum class Engine { Ddp, Fused, Zero2, DdpZero2 };

Tensors distributed(Engine engine, int world, const std::shared_ptr<Communicator>& comm) {
  torch::set_num_threads(1);
  const int r = comm->rank();
  bool use_b = true;
  auto model = make_model(&use_b, true);
  auto run = [&](auto&& forward, auto&& zero_grad, auto&& step) {
    for (int s = 0; s < kSteps; ++s) {
      use_b = s == 0;
      zero_grad();
      auto x = inputs(s, world).narrow(0, 3 * r, 3), y = targets(s, world).narrow(0, 3 * r, 3);
      torch::mse_loss(forward(x), y).backward();
      step();
    }
  };
  if (engine == Engine::Ddp) {
    DDPOptions options;
    options.find_unused_parameters = true;
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
    torch::optim::AdamW opt(ddp.parameters(), kAdamW);
    run([&](const torch::Tensor& x) { return ddp.forward(x); },
        [&] { ddp.zero_grad(/*set_to_none=*/true); }, [&] { opt.step(); });
  } else if (engine == Engine::Fused) {
    FusedDistributedOptimizer opt(model->parameters(), comm, kAdamW);
    run([&](const torch::Tensor& x) { return model->forward(x); }, [&] { opt.zero_grad(); },
        [&] { opt.step(); });
  } else if (engine == Engine::DdpZero2) {
    // ZeRO-2 takes over DDP's reduction: DDP reports each gradient to it.
    DDPOptions options;
    options.find_unused_parameters = true;
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
    ZeroOptions zo;
    zo.stage = 2;
    auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kAdamW, zo);
    run([&](const torch::Tensor& x) { return ddp.forward(x); }, [&] { zero->zero_grad(); },
        [&] { zero->step(); });
  } else {
    ZeroOptions zo;
    zo.stage = 2;
    auto zero =
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(model->parameters(), comm, kAdamW, zo);
    run([&](const torch::Tensor& x) { return model->forward(x); }, [&] { zero->zero_grad(); },
        [&] { zero->step(); });
  }
  Tensors out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

struct Case {
  Engine engine;
  int world;
};

class CheckpointUnusedParameter : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointUnusedParameter, StepsAsOneProcess) {
  const Engine engine = GetParam().engine;
  const int world = GetParam().world;
  const Tensors expected = reference(world);
  auto got = results_of_ranks<Tensors>(
      world, [&](std::shared_ptr<Communicator> comm) { return distributed(engine, world, comm); });
  for (const auto& [rank, params] : got) {
    ASSERT_EQ(params.size(), expected.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LT((params[i] - expected[i]).abs().max().item<double>(), 1e-6)
          << "parameter " << i << ", rank " << rank;
    }
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  static const char* const engines[] = {"ddp", "fused", "zero2", "ddp_zero2"};
  return std::string(engines[static_cast<int>(info.param.engine)]) + "_world" +
         std::to_string(info.param.world);
}

INSTANTIATE_TEST_SUITE_P(EnginesAndWorlds, CheckpointUnusedParameter,
                         ::testing::Values(Case{Engine::Ddp, 1}, Case{Engine::Ddp, 2},
                                           Case{Engine::Ddp, 3}, Case{Engine::Fused, 1},
                                           Case{Engine::Fused, 2}, Case{Engine::Fused, 3},
                                           Case{Engine::Zero2, 1}, Case{Engine::Zero2, 2},
                                           Case{Engine::Zero2, 3}, Case{Engine::DdpZero2, 1},
                                           Case{Engine::DdpZero2, 2}, Case{Engine::DdpZero2, 3}),
                         case_name);

// Without find_unused_parameters, a parameter the checkpointed block left out
// is missing as one outside the graph: the next forward fails on every rank.
class CheckpointMissingGradient : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointMissingGradient, NextForwardFailsOnEveryRank) {
  const int world = GetParam();
  auto failed = results_of_ranks<std::string>(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    bool use_b = true;
    auto model = make_model(&use_b, true);
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, DDPOptions{});
    for (int s = 0; s < 2; ++s) {
      use_b = s == 0;
      ddp.zero_grad(/*set_to_none=*/true);
      auto x = inputs(s, world).narrow(0, 3 * r, 3), y = targets(s, world).narrow(0, 3 * r, 3);
      torch::mse_loss(ddp.forward(x), y).backward();
    }
    try {
      ddp.forward(inputs(2, world).narrow(0, 3 * r, 3));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  });
  ASSERT_FALSE(failed.empty());
  for (const auto& [rank, message] : failed) {
    EXPECT_NE(message.find("did not produce gradients"), std::string::npos)
        << "rank " << rank << ": " << message;
    EXPECT_NE(message.find("b.weight"), std::string::npos) << "rank " << rank << ": " << message;
    EXPECT_NE(message.find("on rank " + std::to_string(rank)), std::string::npos) << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, CheckpointMissingGradient, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::unused_parameter_test
