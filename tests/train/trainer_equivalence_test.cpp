// The trainer on several ranks must take the same optimizer steps as plain
// single-process LibTorch on the concatenated global batch: with gradient
// accumulation (k micro-batches == one k-times batch) and with clipping by
// global norm (== torch::nn::utils::clip_grad_norm_ on the whole batch).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>

#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::trainer_equivalence_test {
namespace {

using cohort::testing::make_data;
using cohort::testing::make_mlp;

constexpr int64_t kMicro = 4;   // samples per micro-batch
constexpr int64_t kSteps = 3;   // optimizer steps compared
constexpr double kLr = 0.1;

struct Case {
  int world;
  int64_t accumulation;
  double max_norm;  // 0: no clipping
  bool ddp;         // DDP's no_sync path, else the all-reduce fallback
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  return "world" + std::to_string(c.world) + "_k" + std::to_string(c.accumulation) +
         (c.max_norm > 0 ? "_clip" : "") + (c.ddp ? "_ddp" : "_allreduce");
}

// Single process: one SGD step per global batch, mean loss over all of it.
struct Reference {
  std::vector<torch::Tensor> params;
  std::vector<double> norms;
};

Reference reference_run(const Case& c, const testing::Synthetic& data) {
  auto net = make_mlp();
  torch::optim::SGD opt(net->parameters(), kLr);
  const int64_t global = c.world * c.accumulation * kMicro;
  Reference ref;
  for (int64_t s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto x = data.x.narrow(0, s * global, global);
    auto y = data.y.narrow(0, s * global, global);
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    ref.norms.push_back(torch::nn::utils::clip_grad_norm_(
        net->parameters(), c.max_norm > 0 ? c.max_norm : 1e30));
    opt.step();
  }
  for (auto& p : net->parameters()) ref.params.push_back(p.detach().clone());
  return ref;
}

// Rank r's micro-batch i of step s: a contiguous slice of the global batch.
torch::data::Example<> micro_batch(const Case& c, const testing::Synthetic& data, int rank,
                                   int64_t step, int64_t i) {
  const int64_t global = c.world * c.accumulation * kMicro;
  const int64_t start = step * global + (rank * c.accumulation + i) * kMicro;
  return {data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)};
}

class TrainerEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerEquivalence, MatchesSingleProcessStepsOnTheGlobalBatch) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * c.world * c.accumulation * kMicro);
  const Reference ref = reference_run(c, data);

  testing::run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = make_mlp();
    torch::optim::SGD opt(net->parameters(), kLr);
    TrainerOptions config;
    config.accumulation_steps = c.accumulation;
    config.max_grad_norm = c.max_norm;
    config.schedule.base_lr = kLr;
    config.progress = false;

    std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
    std::optional<TrainerWiring> wiring;
    LossFn loss;
    if (c.ddp) {
      ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(net, comm);
      wiring.emplace(TrainerWiring::ddp(*ddp, opt));
      loss = [&](const torch::data::Example<>& b) {
        return torch::nn::functional::cross_entropy(ddp->forward(b.data), b.target);
      };
    } else {
      wiring.emplace(TrainerWiring::all_reduce(net.ptr(), opt, comm));
      loss = [&](const torch::data::Example<>& b) {
        return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
      };
    }
    Trainer trainer(std::move(*wiring), loss, config);
    for (int64_t s = 0; s < kSteps; ++s) {
      std::vector<torch::data::Example<>> batches;
      for (int64_t i = 0; i < c.accumulation; ++i) {
        batches.push_back(micro_batch(c, data, comm->rank(), s, i));
      }
      const auto m = trainer.train_step(batches);
      EXPECT_EQ(m.step, s + 1);
      EXPECT_EQ(m.samples, c.world * c.accumulation * kMicro);
      EXPECT_NEAR(m.grad_norm, ref.norms[static_cast<size_t>(s)], 1e-5 * ref.norms[0]);
      if (c.max_norm > 0) {
        EXPECT_TRUE(m.clipped) << "the test must exercise clipping";
      }
    }
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::allclose(params[i], ref.params[i], 1e-5, 1e-6))
          << "parameter " << i << " on rank " << comm->rank() << " differs by "
          << (params[i] - ref.params[i]).abs().max().item<float>();
    }
    if (ddp && c.world > 1) {
      // Only the final micro-batch of each step may communicate.
      EXPECT_EQ(ddp->stats().iterations, kSteps);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Trainer, TrainerEquivalence,
    ::testing::Values(Case{1, 1, 0, true}, Case{2, 1, 0, true}, Case{2, 4, 0, true},
                      Case{3, 2, 0, true}, Case{2, 4, 0, false}, Case{2, 2, 0.05, true},
                      Case{3, 1, 0.05, false}, Case{1, 3, 0.05, true}),
    name_of);

// The norm is summed on the gradients' device and read once; its value must
// be the host loop's, addition for addition, and a parameter without a
// gradient counts as zero.
TEST(ReplicatedGradNorm, IsTheHostLoopOfFloat64SquaresInParameterOrder) {
  auto net = make_mlp();
  net->to(testing::test_device());
  auto data = make_data(16);
  auto out = net->forward(data.x.to(testing::test_device()));
  torch::nn::functional::cross_entropy(out, data.y.to(testing::test_device())).backward();
  auto params = net->parameters();
  auto idle = torch::zeros({3}, params.front().options().requires_grad(true));
  params.insert(params.begin() + 1, idle);  // no gradient: counts as zero
  double host = 0.0;
  for (const auto& p : params) {
    if (p.grad().defined()) host += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
  }
  ASSERT_GT(host, 0.0);
  EXPECT_EQ(std::sqrt(host), ReplicatedGradNorm().global_norm(params));
  EXPECT_EQ(0.0, ReplicatedGradNorm().global_norm({idle}));
}

// ZeRO's layout: each rank holds the gradients of a disjoint subset of the
// parameters; the all-reduced squared partial norms give the full norm.
TEST(ShardedGradNorm, EqualsTheNormOfAllGradients) {
  auto net = make_mlp();
  auto data = make_data(16);
  torch::nn::functional::cross_entropy(net->forward(data.x), data.y).backward();
  const auto all = net->parameters();
  const double full = ReplicatedGradNorm().global_norm(all);
  for (int world : {1, 2, 3}) {
    testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      std::vector<torch::Tensor> mine;
      for (size_t i = 0; i < all.size(); ++i) {
        if (static_cast<int>(i) % comm->size() == comm->rank()) mine.push_back(all[i]);
      }
      ShardedGradNorm sharded(comm);
      EXPECT_NEAR(sharded.global_norm(mine), full, 1e-12 * full) << "world " << world;
    });
  }
}

}  // namespace
}  // namespace cohort::trainer_equivalence_test
