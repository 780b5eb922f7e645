// ZeRO over cohort DDP with the first layer's weight frozen when DDP was
// built, unfrozen before step kUnfreeze's forward and frozen again before
// step kRefreeze's. DDP reduces the parameters that require grad at each
// forward, so from kUnfreeze on it reduces that weight: stage 1 reads its
// average, stage 2 gets it reported and stages it during backward like the
// others (ZeRO hooks only what DDP does not reduce); under ddp.no_sync() it
// accumulates in .grad. Two micro-batches per step, the first under
// ddp.no_sync(), AdamW with weight decay: every rank's parameters equal,
// within 1e-6, one process's on the ranks' rows together with the same
// freezing, ranks as threads over Gloo and UCX at worlds 1 and 3 (world 1
// has no reduction to take over). Stage 2 used to refuse the unfrozen weight
// at every step as 'a parameter got a second gradient'; stage 1 stepped it
// with each rank's own gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::zero_ddp_unfrozen_test {
namespace {

constexpr int kMicro = 2;
constexpr int kUnfreeze = 3, kRefreeze = 14;
const auto kOpts = torch::optim::AdamWOptions(0.01).weight_decay(0.1);

bool trainable_at(int step) { return step >= kUnfreeze && step < kRefreeze; }

template <typename Net>
torch::Tensor micro_loss(Net& net, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::mse_loss(net.forward(x), y) / kMicro;
}

// One process on every rank's rows of each micro-batch. The gradients are
// set to none before each step, as ZeRO's zero_grad(true) (zeroed in
// place, AdamW would go on stepping a frozen weight's zeros).
std::vector<torch::Tensor> reference(const Problem& pb) {
  auto net = pb.make_net();
  torch::optim::AdamW opt(net->parameters(), kOpts);
  for (int s = 0; s < kSteps; ++s) {
    net->a->weight.set_requires_grad(trainable_at(s));
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    for (int m = 0; m < kMicro; ++m) {
      const int i = s * kMicro + m;
      micro_loss(*net, pb.xs[i].reshape({-1, 7}), pb.ys[i].reshape({-1, 1})).backward();
    }
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<std::string> thrown;  // "step s: what"
};

// One step of two micro-batches; whether a.weight's gradient was staged
// (left .grad) before the input's gradient, which comes after every
// parameter's, in the synchronizing backward.
bool micro_batches(DistributedDataParallel<OptimNet>& ddp, OptimNet& net, const Problem& pb, int s,
                   int r) {
  {
    auto guard = ddp.no_sync();
    micro_loss(ddp, pb.xs[s * kMicro][r], pb.ys[s * kMicro][r]).backward();
  }
  // Accumulated locally, not staged, under no_sync().
  EXPECT_EQ(net->a->weight.grad().defined(), trainable_at(s)) << "step " << s;
  auto in = pb.xs[s * kMicro + 1][r].clone().requires_grad_() * 1;
  bool staged = false;
  in.register_hook([&](const torch::Tensor&) { staged = !net->a->weight.grad().defined(); });
  micro_loss(ddp, in, pb.ys[s * kMicro + 1][r]).backward();
  return staged;
}

Trained train(const Problem& pb, int stage, const std::shared_ptr<Communicator>& comm) {
  auto net = pb.make_net();
  net->a->weight.set_requires_grad(false);
  DistributedDataParallel<OptimNet> ddp(net, comm);
  ZeroOptions zo;
  zo.stage = stage;
  zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);
  auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kOpts, zo);
  Trained out;
  for (int s = 0; s < kSteps; ++s) {
    net->a->weight.set_requires_grad(trainable_at(s));
    try {
      zero->zero_grad(/*set_to_none=*/true);
      const bool staged = micro_batches(ddp, net, pb, s, comm->rank());
      // Reduced during backward from the first step after unfreezing.
      if (stage == 2 && comm->size() > 1 && trainable_at(s)) {
        EXPECT_TRUE(staged) << "step " << s;
      }
      zero->step();
    } catch (const std::exception& e) {
      out.thrown.push_back("step " + std::to_string(s) + ": " + e.what());
    }
  }
  zero.reset();  // before DDP, whose reduction it holds
  for (const auto& p : net->parameters()) out.params.push_back(p.detach().clone());
  return out;
}

class ZeroDdpUnfrozen : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(ZeroDdpUnfrozen, AParameterFrozenWhenDdpWasBuiltTrainsOnceUnfrozen) {
  const auto c = GetParam();
  const Problem pb(c.world, false, kSteps * kMicro);
  const auto want = reference(pb);
  // a.weight moved while it was trainable.
  ASSERT_GT((want[0] - pb.init[0]).abs().max().item<double>(), 1e-3);
  for (const int stage : {1, 2}) {
    auto got = results_of_ranks<Trained>(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          return train(pb, stage, comm);
        },
        options_for(c));
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world));
    for (const auto& [rank, trained] : got) {
      const std::string where = "stage " + std::to_string(stage) + ", rank " + std::to_string(rank);
      EXPECT_TRUE(trained.thrown.empty()) << where << ", " << trained.thrown.size()
                                          << " steps refused, first " << trained.thrown.front();
      EXPECT_LT(max_diff(trained.params, want), 1e-6) << where;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroDdpUnfrozen, ::testing::ValuesIn(engine_worlds({1, 3})),
                         engine_world_name);

// Stage 2 made by hand over DDP's parameters but the frozen weight: once
// unfrozen, DDP takes it up and no one would average its gradient, an
// InvalidArgument on every rank at that forward.
class ZeroDdpUnfrozenForeign : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(ZeroDdpUnfrozenForeign, AParameterTheOptimizerDoesNotHoldIsRefusedOnEveryRank) {
  const auto c = GetParam();
  const Problem pb(c.world, false, 2);
  const auto seen = errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto net = pb.make_net();
        net->a->weight.set_requires_grad(false);
        DistributedDataParallel<OptimNet> ddp(net, comm);
        std::vector<torch::Tensor> held;
        for (const auto& p : ddp.parameters()) {
          if (!p.is_same(net->a->weight)) held.push_back(p);
        }
        ZeroOptions zo;
        zo.stage = 2;
        zo.reduce_gradients = false;
        auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(held, comm, kOpts, zo);
        zero->take_over_reduction(ddp.reducer());
        for (int s = 0; s < 2; ++s) {
          net->a->weight.set_requires_grad(s == 1);
          zero->zero_grad();
          torch::mse_loss(ddp.forward(pb.xs[s][comm->rank()]), pb.ys[s][comm->rank()]).backward();
          zero->step();
        }
      },
      [&] {
        auto o = options_for(c);
        o.timeout = std::chrono::seconds(5);
        return o;
      }());
  for (size_t r = 0; r < seen.size(); ++r) {
    EXPECT_NE(seen[r].find("DDP now reduces 'a.weight' (its requires_grad changed), which is not "
                           "one of this optimizer's"),
              std::string::npos)
        << "rank " << r << ": " << seen[r];
  }
}

// World 1 has no reduction to take over.
INSTANTIATE_TEST_SUITE_P(Zero, ZeroDdpUnfrozenForeign, ::testing::ValuesIn(engine_worlds({3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::zero_ddp_unfrozen_test
