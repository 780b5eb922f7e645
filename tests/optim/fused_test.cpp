// FusedDistributedOptimizer ends 20 steps at the parameters of DDP +
// torch::optim::AdamW within 1e-6: several buckets (a 100-byte cap), a
// layer that never gets a gradient (skipped, as AdamW skips it), an lr
// change mid-run, with and without amsgrad, at world sizes 1-3.
#include <gtest/gtest.h>

#include "cohort/optim/fused_distributed_optimizer.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::fused_test {
namespace {

class FusedEquivalence : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(FusedEquivalence, MatchesDdpAdamW) {
  const auto [world, amsgrad] = GetParam();
  torch::set_num_threads(1);
  const Problem pb(world, /*with_unused=*/true);
  const auto opts = torch::optim::AdamWOptions(0.01).weight_decay(0.1).amsgrad(amsgrad);
  const int lr_step = 10;
  RankResults ref(world);
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel<OptimNet> ddp(net, comm, o);
    torch::optim::AdamW opt(ddp.parameters(), opts);
    for (int s = 0; s < kSteps; ++s) {
      if (s == lr_step) opt.param_groups()[0].options().set_lr(0.002);
      opt.zero_grad();
      torch::mse_loss(ddp.forward(pb.xs[s][comm->rank()]), pb.ys[s][comm->rank()]).backward();
      opt.step();
    }
    ref.put(comm->rank(), net->parameters());
  });
  RankResults got(world);
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    FusedOptions fo;
    fo.bucket_cap_mb = 100.0 / (1024 * 1024);
    FusedDistributedOptimizer opt(net->parameters(), comm, opts, fo);
    EXPECT_GE(opt.bucket_count(), 4u);
    for (int s = 0; s < kSteps; ++s) {
      if (s == lr_step) opt.set_lr(0.002);
      opt.zero_grad();
      pb.loss(net, s, comm->rank()).backward();
      opt.step();
    }
    EXPECT_EQ(opt.timestep(), kSteps);
    got.put(comm->rank(), net->parameters());
  });
  const auto& expected = ref.params[0];
  EXPECT_GT(max_diff(expected, pb.init), 1e-3);
  // The unused layer (parameters 2 and 3) kept its initial values.
  EXPECT_TRUE(expected[2].equal(pb.init[2]));
  for (int r = 0; r < world; ++r) {
    EXPECT_LT(max_diff(got.params[r], expected), 1e-6) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Fused, FusedEquivalence,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Bool()));

// save/load of the (replicated) state: resume at step 10 equals straight.
// Every rank must pass the same shapes: a difference is refused on every
// rank (not a hang or mixed elements in the all-reduce).
TEST(Fused, RefusesMismatchedParameters) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    std::vector<torch::Tensor> params{torch::zeros({4, 6}, torch::requires_grad())};
    if (comm->rank() == 1) params.push_back(torch::zeros({2}, torch::requires_grad()));
    try {
      FusedDistributedOptimizer opt(params, comm, torch::optim::AdamWOptions());
      ADD_FAILURE() << "no error on rank " << comm->rank();
    } catch (const MismatchError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("FusedDistributedOptimizer"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 0 has 1 parameters but rank 1 has 2"), std::string::npos) << m;
    }
  });
}

TEST(Fused, SaveLoadResumes) {
  torch::set_num_threads(1);
  const int world = 2;
  const Problem pb(world);
  const auto opts = torch::optim::AdamWOptions(0.01);
  RankResults straight(world), resumed(world);
  std::vector<std::string> saved(world);
  auto job = [&](int from, int to, RankResults* out, bool save, bool load) {
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      auto net = pb.make_net();
      FusedOptions fo;
      fo.bucket_cap_mb = 100.0 / (1024 * 1024);
      FusedDistributedOptimizer opt(net->parameters(), comm, opts, fo);
      if (load) {
        torch::serialize::InputArchive in;
        in.load_from(saved[comm->rank()].data(), saved[comm->rank()].size());
        opt.load(in);
        read_parameters(in, *net);
        EXPECT_EQ(opt.timestep(), from);
      }
      for (int s = from; s < to; ++s) {
        opt.zero_grad();
        pb.loss(net, s, comm->rank()).backward();
        opt.step();
      }
      if (save) {
        torch::serialize::OutputArchive ar;
        opt.save(ar);
        write_parameters(ar, *net);
        std::ostringstream os;
        ar.save_to(os);
        saved[comm->rank()] = os.str();
      }
      if (out) out->put(comm->rank(), net->parameters());
    });
  };
  job(0, kSteps, &straight, false, false);
  job(0, kSteps / 2, nullptr, true, false);
  job(kSteps / 2, kSteps, &resumed, false, true);
  for (int r = 0; r < world; ++r) {
    EXPECT_LT(max_diff(resumed.params[r], straight.params[r]), 1e-6);
  }
}

}  // namespace
}  // namespace cohort::testing::fused_test
