// ZeroRedundancyOptimizer (stages 1 and 2, alone and after cohort DDP) ends
// 20 steps at the parameters of DDP + the same LibTorch optimizer, within
// 1e-6, at world sizes 1-4 with 61 parameters (divisible by none of 2, 3,
// 4) and buckets of 16 elements, so parameters straddle chunks and ranks.
// With COHORT_TEST_DEVICE=cuda the equivalence cases (ZeroEquivalence,
// Zero.AdamAndSgdMomentumMatchDdp) put the models, the data and the DDP
// reference on the GPU.
#include <gtest/gtest.h>

#include "cohort/optim/optimizer_state.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/test_device.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::zero_test {
namespace {

constexpr double kTinyBucketMb = 16.0 * 4 / (1024 * 1024);  // 16 floats

// Stage 2 over buckets of 16 floats: enough buckets for per-bucket bounds.
ZeroOptions tiny_stage2(int max_staged_buckets = 1) {
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_mb = kTinyBucketMb;
  zo.max_staged_buckets = max_staged_buckets;
  return zo;
}

// Bytes of the largest (padded, float32) bucket of a ZeRO partition.
int64_t largest_bucket_bytes(const ZeroRedundancyOptimizer& zero) {
  int64_t largest = 0;
  for (const auto& b : zero.partition().buckets()) largest = std::max(largest, b.padded * 4);
  return largest;
}

using Groups = std::vector<torch::optim::OptimizerParamGroup>;

// Runs `steps` ZeRO steps; with_ddp: the model is wrapped in cohort DDP:
// at stage 1 DDP all-reduces in backward and ZeRO takes the averaged
// gradients, at stage 2 ZeRO takes over DDP's reduction. make builds the ZeRO optimizer
// from the model's parameters; between(step, zero) runs before each step.
std::vector<std::vector<torch::Tensor>> zero_run(
    const Problem& pb, bool with_ddp,
    const std::function<std::unique_ptr<ZeroRedundancyOptimizer>(
        std::vector<torch::Tensor>, std::shared_ptr<Communicator>)>& make,
    const std::function<void(int, ZeroRedundancyOptimizer&)>& between = {}) {
  RankResults out(pb.world);
  run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    std::unique_ptr<DistributedDataParallel<OptimNet>> ddp;
    if (with_ddp) ddp = std::make_unique<DistributedDataParallel<OptimNet>>(net, comm);
    auto zero = make(net->parameters(), comm);
    // Stage 2 takes over DDP's reduction (reduce-scatter instead of DDP's
    // all-reduce).
    if (ddp && zero->options().stage == 2) zero->take_over_reduction(ddp->reducer());
    for (int s = 0; s < kSteps; ++s) {
      if (between) between(s, *zero);
      zero->zero_grad();
      auto x = pb.xs[s][comm->rank()];
      auto y = ddp ? ddp->forward(x) : net->forward(x);
      torch::mse_loss(y, pb.ys[s][comm->rank()]).backward();
      zero->step();
    }
    out.put(comm->rank(), net->parameters());
  });
  return out.params;
}

void expect_all_ranks_equal(const std::vector<std::vector<torch::Tensor>>& got,
                            const std::vector<torch::Tensor>& expected,
                            const std::vector<torch::Tensor>& init) {
  // Only meaningful if training moved the parameters.
  ASSERT_GT(max_diff(expected, init), 1e-3);
  for (size_t r = 0; r < got.size(); ++r) {
    EXPECT_LT(max_diff(got[r], expected), 1e-6) << "rank " << r;
  }
}

struct Case {
  int world;
  int stage;
  bool with_ddp;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return "world" + std::to_string(info.param.world) + "_stage" + std::to_string(info.param.stage) +
         (info.param.with_ddp ? "_ddp" : "_alone");
}

class ZeroEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroEquivalence, AdamWTwentyStepsMatchDdp) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const Problem pb(c.world, false, kSteps, test_device());
  const auto opts = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
  const auto expected = reference_run(pb, [&](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::AdamW>(ps, opts);
  });
  ZeroOptions zo;
  zo.stage = c.stage;
  zo.reduce_gradients = !c.with_ddp;
  zo.bucket_cap_mb = kTinyBucketMb;
  const auto got = zero_run(pb, c.with_ddp, [&](auto ps, auto comm) {
    auto z = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ps, comm, opts, zo);
    // Balanced: every rank's shard is the padded total over the world.
    EXPECT_EQ(z->partition().shard_numel() * c.world, z->partition().padded_numel());
    EXPECT_GT(z->partition().buckets().size(), 2u);
    return z;
  });
  expect_all_ranks_equal(got, expected, pb.init);
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroEquivalence,
                         ::testing::Values(Case{1, 1, false}, Case{1, 2, false}, Case{1, 2, true},
                                           Case{2, 1, false}, Case{2, 1, true}, Case{2, 2, false},
                                           Case{2, 2, true}, Case{3, 1, false}, Case{3, 1, true},
                                           Case{3, 2, false}, Case{3, 2, true}, Case{4, 1, false},
                                           Case{4, 1, true}, Case{4, 2, false}, Case{4, 2, true}),
                         case_name);

TEST(Zero, AdamAndSgdMomentumMatchDdp) {
  torch::set_num_threads(1);
  const Problem pb(3, false, kSteps, test_device());
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_mb = kTinyBucketMb;
  const auto adam = torch::optim::AdamOptions(0.01).weight_decay(0.05).amsgrad(true);
  auto expected = reference_run(pb, [&](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::Adam>(ps, adam);
  });
  auto got = zero_run(pb, false, [&](auto ps, auto comm) {
    return ZeroRedundancyOptimizer::make<torch::optim::Adam>(ps, comm, adam, zo);
  });
  expect_all_ranks_equal(got, expected, pb.init);

  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true);
  expected = reference_run(pb, [&](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::SGD>(ps, sgd);
  });
  got = zero_run(pb, false, [&](auto ps, auto comm) {
    return ZeroRedundancyOptimizer::make<torch::optim::SGD>(ps, comm, sgd, zo);
  });
  expect_all_ranks_equal(got, expected, pb.init);
}

// Per-group options are kept, and set_lr / a group's lr change mid-run act
// as they do on the LibTorch optimizer.
TEST(Zero, ParamGroupsAndLrChangesMatchDdp) {
  torch::set_num_threads(1);
  const Problem pb(2);
  auto groups_of = [](const std::vector<torch::Tensor>& ps) {
    Groups g;
    g.emplace_back(std::vector<torch::Tensor>(ps.begin(), ps.begin() + 2),
                   std::make_unique<torch::optim::AdamWOptions>(
                       torch::optim::AdamWOptions(0.02).weight_decay(0.0)));
    g.emplace_back(std::vector<torch::Tensor>(ps.begin() + 2, ps.end()),
                   std::make_unique<torch::optim::AdamWOptions>(
                       torch::optim::AdamWOptions(0.005).betas({0.8, 0.99}).weight_decay(0.3)));
    return g;
  };
  auto schedule = [](int s, std::vector<torch::optim::OptimizerParamGroup>& groups,
                     const std::function<void(double)>& set_lr) {
    if (s == 8) set_lr(0.003);
    if (s == 14) groups[1].options().set_lr(0.05);
  };
  // The reference applies the same changes to torch::optim::AdamW.
  RankResults ref(pb.world);
  run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    DistributedDataParallel<OptimNet> ddp(net, comm);
    torch::optim::AdamW opt(groups_of(ddp.parameters()));
    for (int s = 0; s < kSteps; ++s) {
      schedule(s, opt.param_groups(), [&](double lr) {
        for (auto& g : opt.param_groups()) g.options().set_lr(lr);
      });
      opt.zero_grad();
      torch::mse_loss(ddp.forward(pb.xs[s][comm->rank()]), pb.ys[s][comm->rank()]).backward();
      opt.step();
    }
    ref.put(comm->rank(), net->parameters());
  });
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_mb = kTinyBucketMb;
  const auto got = zero_run(
      pb, false,
      [&](auto ps, auto comm) {
        return ZeroRedundancyOptimizer::make<torch::optim::AdamW>(groups_of(ps), comm,
                                                                  torch::optim::AdamWOptions(), zo);
      },
      [&](int s, ZeroRedundancyOptimizer& z) {
        schedule(s, z.param_groups(), [&](double lr) { z.set_lr(lr); });
      });
  expect_all_ranks_equal(got, ref.params[0], pb.init);
}

// Stage 1 holds 1/N of the state; stage 2 also 1/N of the gradients and
// releases the parameters' .grad during the step.
TEST(Zero, ShardsStateAndGradients) {
  torch::set_num_threads(1);
  const Problem pb(4);
  for (int stage : {1, 2}) {
    run_ranks_shared(4, [&](std::shared_ptr<Communicator> comm) {
      auto net = pb.make_net();
      ZeroOptions zo;
      zo.stage = stage;
      auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
          net->parameters(), comm, torch::optim::AdamWOptions(0.01), zo);
      torch::mse_loss(net->forward(pb.xs[0][comm->rank()]), pb.ys[0][comm->rank()]).backward();
      zero->step();
      const int64_t shard = zero->partition().shard_numel();  // ceil(61 / 4) = 16
      EXPECT_EQ(shard, 16);
      int64_t state_elems = 0;
      for (const auto& p : zero->partition().pieces()) state_elems += p.numel;
      EXPECT_EQ(zero->state_bytes(), 2 * state_elems * 4);  // exp_avg, exp_avg_sq
      EXPECT_LE(zero->state_bytes(), 2 * shard * 4);
      if (stage == 2) {
        EXPECT_EQ(zero->grad_bytes(), shard * 4);
        for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
      } else {
        EXPECT_EQ(zero->grad_bytes(), 64 * 4);  // the full padded buffer
      }
    });
  }
}

// Stage 2 stages gradients bucket by bucket during backward: a staged
// gradient leaves .grad (autograd's copy is freed), no staging buffer is
// larger than a bucket, a layer that gets no gradient anywhere is skipped as
// AdamW skips it, and only the shard is left after the step.
TEST(Zero, Stage2StagesBucketByBucketAndSkipsUnusedParameters) {
  torch::set_num_threads(1);
  const Problem pb(3, /*with_unused=*/true);
  const auto opts = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
  const auto expected = reference_run(pb, [&](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::AdamW>(ps, opts);
  });
  RankResults got(pb.world);
  run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, opts,
                                                                   tiny_stage2());
    // enough buckets for the bound to mean something
    ASSERT_GE(zero->partition().buckets().size(), 4u);
    const int64_t largest = largest_bucket_bytes(*zero);
    const int64_t shard_bytes = zero->partition().shard_numel() * 4;
    for (int s = 0; s < kSteps; ++s) {
      zero->zero_grad();
      pb.loss(net, s, comm->rank()).backward();
      for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
      const auto buffers = zero->grad_buffers();
      ASSERT_GE(buffers.size(), 1u);
      EXPECT_EQ(buffers[0].nbytes(), shard_bytes);
      for (size_t k = 1; k < buffers.size(); ++k)
        EXPECT_LE(static_cast<int64_t>(buffers[k].nbytes()), largest);
      zero->step();
      EXPECT_EQ(zero->grad_buffers().size(), 1u);
      EXPECT_EQ(zero->grad_bytes(), shard_bytes);
    }
    got.put(comm->rank(), net->parameters());
  });
  EXPECT_TRUE(expected[2].equal(pb.init[2]));  // the unused layer did not move
  expect_all_ranks_equal(got.params, expected, pb.init);
}

// The gradient peak: only the current bucket stages, and it opens once at
// most max_staged_buckets - 1 buckets are still on the wire, so the staging
// alive at once is at most that many buckets (here of four, with one
// parameter spanning two buckets) and the result still equals the
// unsharded optimizer's.
TEST(Zero, Stage2StagingPeakIsAtMostTheStagedBuckets) {
  torch::set_num_threads(1);
  const Problem pb(3);
  const auto opts = torch::optim::AdamWOptions(0.01);
  const auto expected = reference_run(pb, [&](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::AdamW>(ps, opts);
  });
  for (int staged : {1, 2}) {
    SCOPED_TRACE("max_staged_buckets " + std::to_string(staged));
    RankResults got(pb.world);
    run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
      auto net = pb.make_net();
      auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, opts,
                                                                     tiny_stage2(staged));
      ASSERT_EQ(zero->partition().buckets().size(), 4u);
      const int64_t largest = largest_bucket_bytes(*zero);
      for (int s = 0; s < kSteps; ++s) {
        zero->zero_grad();
        pb.loss(net, s, comm->rank()).backward();
        zero->step();
      }
      EXPECT_GT(zero->staging_peak_bytes(), 0);
      EXPECT_LE(zero->staging_peak_bytes(), staged * largest);
      got.put(comm->rank(), net->parameters());
    });
    expect_all_ranks_equal(got.params, expected, pb.init);
  }
}

TEST(Zero, RefusesMaxStagedBucketsOtherThanOneOrTwo) {
  const Problem pb(1);
  ZeroOptions zo;
  zo.stage = 2;
  zo.max_staged_buckets = 3;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    EXPECT_THROW(ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
                     net->parameters(), comm, torch::optim::AdamWOptions(0.01), zo),
                 InvalidArgument);
  });
}

TEST(Zero, Stage2RefusesTwoBackwardsPerStep) {
  torch::set_num_threads(1);
  const Problem pb(2);
  ZeroOptions zo;
  zo.stage = 2;
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
        net->parameters(), comm, torch::optim::AdamWOptions(0.01), zo);
    pb.loss(net, 0, comm->rank()).backward();
    pb.loss(net, 1, comm->rank()).backward();
    EXPECT_THROW(zero->step(), Error);
    // The optimizer is usable again after the refusal.
    zero->zero_grad();
    pb.loss(net, 2, comm->rank()).backward();
    zero->step();
  });
}

// Stage 2 alone with the first layer's weight frozen when the optimizer is
// made and unfrozen before step kUnfreeze's forward (progressive
// unfreezing): from then on its gradient is reduced like the others', staged
// during backward from the next step on (its accumulator hooked at the
// step), and every rank's parameters equal one process's on the ranks' rows
// together (DDP's average) within 1e-6, at worlds 2 and 3 (world 1 has no
// reducer).
TEST(Zero, Stage2TakesUpAParameterUnfrozenAfterItWasMade) {
  torch::set_num_threads(1);
  constexpr int kUnfreeze = 3;
  const auto opts = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const Problem pb(world);
    auto ref = pb.make_net();
    ref->a->weight.set_requires_grad(false);
    torch::optim::AdamW ref_opt(ref->parameters(), opts);
    for (int s = 0; s < kSteps; ++s) {
      if (s == kUnfreeze) ref->a->weight.set_requires_grad(true);
      ref_opt.zero_grad();
      torch::mse_loss(ref->forward(pb.xs[s].reshape({-1, 7})), pb.ys[s].reshape({-1, 1}))
          .backward();
      ref_opt.step();
    }
    RankResults got(world);
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      auto net = pb.make_net();
      net->a->weight.set_requires_grad(false);
      auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, opts,
                                                                     tiny_stage2());
      for (int s = 0; s < kSteps; ++s) {
        if (s == kUnfreeze) net->a->weight.set_requires_grad(true);
        zero->zero_grad();
        // The input's gradient comes after every parameter's: by then a
        // hooked a.weight was staged (its .grad dropped) during backward.
        auto x = pb.xs[s][comm->rank()].clone().requires_grad_();
        auto in = x * 1;
        bool staged = false;
        in.register_hook([&](const torch::Tensor&) { staged = !net->a->weight.grad().defined(); });
        torch::mse_loss(net->forward(in), pb.ys[s][comm->rank()]).backward();
        if (s > kUnfreeze) {
          EXPECT_TRUE(staged) << "step " << s;
        }
        zero->step();
      }
      got.put(comm->rank(), net->parameters());
    });
    expect_all_ranks_equal(got.params, ref->parameters(), pb.init);
  }
}

// Same count and element total, different shapes: a check of counts alone
// would let this through and mix unrelated elements.
TEST(Zero, RefusesTransposedShapesNamingTheParameter) {
  for (int stage : {1, 2}) {
    run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
      std::vector<torch::Tensor> params{torch::zeros({3}, torch::requires_grad()),
                                        comm->rank() == 2
                                            ? torch::zeros({6, 4}, torch::requires_grad())
                                            : torch::zeros({4, 6}, torch::requires_grad())};
      ZeroOptions zo;
      zo.stage = stage;
      try {
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(params, comm,
                                                           torch::optim::AdamWOptions(), zo);
        ADD_FAILURE() << "no error on rank " << comm->rank();
      } catch (const MismatchError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("ZeroRedundancyOptimizer"), std::string::npos) << m;
        EXPECT_NE(m.find("parameter 1 is Float [4, 6] on rank 0 but Float [6, 4] on rank 2"),
                  std::string::npos)
            << m;
      }
    });
  }
}

TEST(Zero, RefusesMismatchedModels) {
  torch::set_num_threads(1);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    OptimNet net(comm->rank() == 1);  // rank 1 has an extra layer
    EXPECT_THROW(ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm,
                                                                    torch::optim::AdamWOptions()),
                 MismatchError);
  });
}

}  // namespace
}  // namespace cohort::testing::zero_test
