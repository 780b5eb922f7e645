// ZeRO stage 2 with cohort DDP (DDP hands its reduction over: reduce-scatter
// instead of all-reduce) and gradient accumulation at stage 2, with DDP's
// no_sync() and alone with the optimizer's own no_sync(): the results equal
// DDP + AdamW with the same accumulation within 1e-6.
#include <gtest/gtest.h>

#include "cohort/optim/zero_redundancy_optimizer.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::zero_ddp_test {
namespace {

constexpr double kTinyBucketMb = 16.0 * 4 / (1024 * 1024);  // 16 floats
const auto kOpts = torch::optim::AdamWOptions(0.01).weight_decay(0.1);

ZeroOptions stage2() {
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_mb = kTinyBucketMb;
  return zo;
}

// With DDP (find_unused_parameters, a layer that never takes part): DDP's
// bucket buffers are freed, the gradients move into ZeRO's staging as they
// are ready, then only the shard is left; DDP gets its buckets back
// when the optimizer goes.
TEST(ZeroDdp, Stage2ReplacesDdpAllReduceAndHoldsOnlyTheShard) {
  torch::set_num_threads(1);
  const Problem pb(3, /*with_unused=*/true);
  const auto expected = reference_run(pb, [&](std::vector<torch::Tensor> ps) {
    return std::make_unique<torch::optim::AdamW>(ps, kOpts);
  });
  RankResults got(pb.world);
  run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel<OptimNet> ddp(net, comm, o);
    {
      auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kOpts, stage2());
      EXPECT_FALSE(zero->options().reduce_gradients);
      for (size_t b = 0; b < ddp.reducer().bucket_layout().size(); ++b) {
        EXPECT_FALSE(ddp.reducer().bucket_buffer(b).defined());
      }
      for (int s = 0; s < kSteps; ++s) {
        zero->zero_grad();
        torch::mse_loss(ddp.forward(pb.xs[s][comm->rank()]), pb.ys[s][comm->rank()]).backward();
        // Staged gradients left .grad; what is held is the shard and at
        // most two buckets' staging.
        for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
        const auto buffers = zero->grad_buffers();
        EXPECT_GE(buffers.size(), 1u);
        EXPECT_LE(buffers.size(), 3u);
        zero->step();
        EXPECT_EQ(zero->grad_bytes(), zero->partition().shard_numel() * 4);
        for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
      }
      EXPECT_EQ(ddp.stats().iterations, kSteps);
    }
    EXPECT_TRUE(ddp.reducer().bucket_buffer(0).defined());  // DDP reduces again
    got.put(comm->rank(), net->parameters());
  });
  EXPECT_TRUE(expected[2].equal(pb.init[2]));  // the unused layer did not move
  for (size_t r = 0; r < got.params.size(); ++r) {
    EXPECT_LT(max_diff(got.params[r], expected), 1e-6) << "rank " << r;
  }
}

TEST(ZeroDdp, RefusesWhatItCannotDo) {
  torch::set_num_threads(1);
  const Problem pb(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    DistributedDataParallel<OptimNet> ddp(net, comm);
    ZeroOptions zo = stage2();
    zo.reduce_gradients = false;
    // Stage 2 for DDP, but no DDP ever handed its reduction over.
    auto orphan =
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp.parameters(), comm, kOpts, zo);
    torch::mse_loss(ddp.forward(pb.xs[0][comm->rank()]), pb.ys[0][comm->rank()]).backward();
    EXPECT_THROW(orphan->step(), Error);
    // Stage 1 reads DDP's gradients; it takes nothing over.
    zo.stage = 1;
    auto one =
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp.parameters(), comm, kOpts, zo);
    EXPECT_THROW(one->take_over_reduction(ddp.reducer()), InvalidArgument);
    // Every parameter DDP reduces must be the optimizer's.
    zo.stage = 2;
    auto ps = ddp.parameters();
    ps.pop_back();
    auto part = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ps, comm, kOpts, zo);
    EXPECT_THROW(part->take_over_reduction(ddp.reducer()), InvalidArgument);
    EXPECT_TRUE(ddp.reducer().bucket_buffer(0).defined());
  });
}

// The earlier make(ddp, defaults, comm, options) still compiles (deprecated)
// and takes DDP's own communicator only; another one, even over the same
// ranks, is refused on every rank rather than used beside DDP's.
TEST(ZeroDdp, TheEarlierSpellingTakesOnlyDdpsCommunicator) {
  torch::set_num_threads(1);
  const Problem pb(2);
  std::vector<std::string> errors(2), mixed(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    DistributedDataParallel<OptimNet> ddp(pb.make_net(), comm);
    auto other = comm->new_group({0, 1});
    const auto make = [&](std::shared_ptr<Communicator> given, std::string& error) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
      try {
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kOpts, given, stage2());
      } catch (const InvalidArgument& e) {
        error = e.what();
      }
#pragma GCC diagnostic pop
    };
    std::string none;
    make(comm, none);
    EXPECT_EQ(none, "");
    make(other, errors[comm->rank()]);
    // Only rank 1 passes another: both ranks fail, neither waits.
    make(comm->rank() == 1 ? other : comm, mixed[comm->rank()]);
  });
  for (int r = 0; r < 2; ++r) {
    const std::string rank = "on rank " + std::to_string(r) + ": ";
    EXPECT_NE(errors[r].find(rank + "the communicator given is not DDP's"), std::string::npos)
        << errors[r];
    EXPECT_NE(mixed[r].find(rank + "ranks disagree on whether the communicator given is DDP's"),
              std::string::npos)
        << mixed[r];
  }
}

// k micro-batches per step: DDP + AdamW with no_sync() around all but the
// last backward is the reference.
constexpr int kMicro = 3;

std::vector<torch::Tensor> accumulated_reference(const Problem& pb) {
  RankResults out(pb.world);
  run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    DistributedDataParallel<OptimNet> ddp(net, comm);
    torch::optim::AdamW opt(ddp.parameters(), kOpts);
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      for (int m = 0; m < kMicro; ++m) {
        auto loss = [&] {
          return torch::mse_loss(ddp.forward(pb.xs[s * kMicro + m][comm->rank()]),
                                 pb.ys[s * kMicro + m][comm->rank()]) /
                 kMicro;
        };
        if (m + 1 < kMicro) {
          auto guard = ddp.no_sync();
          loss().backward();
        } else {
          loss().backward();
        }
      }
      opt.step();
    }
    out.put(comm->rank(), net->parameters());
  });
  return out.params[0];
}

class ZeroAccumulation : public ::testing::TestWithParam<int> {};

TEST_P(ZeroAccumulation, Stage2WithAndWithoutDdpMatchesDdpNoSync) {
  torch::set_num_threads(1);
  const Problem pb(GetParam(), false, kSteps * kMicro);
  const auto expected = accumulated_reference(pb);
  ASSERT_GT(max_diff(expected, pb.init), 1e-3);
  for (bool with_ddp : {true, false}) {
    RankResults got(pb.world);
    run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
      auto net = pb.make_net();
      std::unique_ptr<DistributedDataParallel<OptimNet>> ddp;
      std::unique_ptr<ZeroRedundancyOptimizer> zero;
      if (with_ddp) {
        ddp = std::make_unique<DistributedDataParallel<OptimNet>>(net, comm);
        zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(*ddp, kOpts, stage2());
      } else {
        zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kOpts,
                                                                  stage2());
      }
      for (int s = 0; s < kSteps; ++s) {
        zero->zero_grad();
        for (int m = 0; m < kMicro; ++m) {
          auto loss = [&] {
            auto x = pb.xs[s * kMicro + m][comm->rank()];
            return torch::mse_loss(ddp ? ddp->forward(x) : net->forward(x),
                                   pb.ys[s * kMicro + m][comm->rank()]) /
                   kMicro;
          };
          if (m + 1 == kMicro) {
            loss().backward();
          } else if (ddp) {
            auto guard = ddp->no_sync();
            loss().backward();
          } else {
            auto guard = zero->no_sync();
            loss().backward();
          }
        }
        zero->step();
      }
      zero.reset();  // before DDP, whose reduction it holds
      got.put(comm->rank(), net->parameters());
    });
    for (size_t r = 0; r < got.params.size(); ++r) {
      EXPECT_LT(max_diff(got.params[r], expected), 1e-6)
          << "rank " << r << (with_ddp ? " with DDP" : " alone");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroAccumulation, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

// Every backward under no_sync(): step() reduces the accumulated .grad.
TEST(ZeroAccumulationEdge, Stage2StepAfterOnlyNoSyncBackwards) {
  torch::set_num_threads(1);
  const Problem pb(2, false, kSteps * kMicro);
  RankResults got(pb.world);
  run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kOpts,
                                                                   stage2());
    for (int s = 0; s < kSteps; ++s) {
      zero->zero_grad();
      {
        auto guard = zero->no_sync();
        for (int m = 0; m < kMicro; ++m) {
          (torch::mse_loss(net->forward(pb.xs[s * kMicro + m][comm->rank()]),
                           pb.ys[s * kMicro + m][comm->rank()]) /
           kMicro)
              .backward();
        }
      }
      zero->step();
    }
    got.put(comm->rank(), net->parameters());
  });
  const auto expected = accumulated_reference(pb);
  for (size_t r = 0; r < got.params.size(); ++r) {
    EXPECT_LT(max_diff(got.params[r], expected), 1e-6) << "rank " << r;
  }
}

}  // namespace
}  // namespace cohort::testing::zero_ddp_test
