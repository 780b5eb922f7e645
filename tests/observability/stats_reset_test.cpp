// Communicator::reset_stats() in the middle of a step (the LossFn before
// the model's forward, or a gradient hook during DDP's backward) leaves the
// step's own counts whole: the Trainer's comm_bytes and DDP's per-iteration
// bytes_sent equal those of the step before, which ran the same collectives
// without a reset, instead of a difference wrapped below zero. TrainerWiring
// over DDP, ranks as threads, Gloo and UCX, worlds 1 to 3.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "tests/train/train_fixtures.h"

namespace cohort::stats_reset_test {
namespace {

enum class Reset { None, InForward, InBackward };

using Case = testing::EngineWorld;

class StatsReset : public ::testing::TestWithParam<Case> {};

TEST_P(StatsReset, AResetInTheStepLeavesItsBytesWhole) {
  const Case c = GetParam();
  const auto data = testing::make_data(64);
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto net = testing::make_mlp();
        DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
        torch::optim::SGD sgd(ddp.parameters(), 0.1);
        Reset reset = Reset::None;
        // The first layer's weight is the backward's last gradient: DDP's
        // iteration has begun, its bucket not yet reduced.
        net->parameters()[0].register_hook([&](torch::Tensor g) {
          if (reset == Reset::InBackward) comm->reset_stats();
          return g;
        });
        TrainerOptions config;
        config.progress = false;
        LossFn loss = [&](const torch::data::Example<>& b) {
          // After the step's agreement all-gather, before DDP's forward.
          if (reset == Reset::InForward) comm->reset_stats();
          return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
        };
        Trainer trainer(TrainerWiring::ddp(ddp, sgd), loss, config);
        int64_t step_bytes = -1, ddp_bytes = -1;
        for (const Reset r :
             {Reset::None, Reset::None, Reset::None, Reset::InForward, Reset::InBackward}) {
          reset = r;
          const int64_t s = trainer.position().step;
          const int64_t start = (s * c.world + comm->rank()) * 4;
          const auto m =
              trainer.train_step({{data.x.narrow(0, start, 4), data.y.narrow(0, start, 4)}});
          const int64_t iteration = ddp.stats().bytes_sent;
          // DDP rebuilds its buckets after the first iteration, and rank 0 sends
          // their order in the second.
          if (s < 2) continue;
          if (r == Reset::None) {
            step_bytes = m.comm_bytes;
            ddp_bytes = iteration;
            EXPECT_EQ(step_bytes > 0, c.world > 1);
            EXPECT_EQ(ddp_bytes > 0, c.world > 1);
            continue;
          }
          const char* where = r == Reset::InForward ? "forward" : "backward";
          EXPECT_EQ(m.comm_bytes, step_bytes)
              << "reset in the " << where << ", rank " << comm->rank();
          EXPECT_EQ(iteration, ddp_bytes) << "reset in the " << where << ", rank " << comm->rank();
          EXPECT_EQ(comm->stats().resets, r == Reset::InForward ? 1u : 2u);
        }
      },
      testing::options_for(c));
}

INSTANTIATE_TEST_SUITE_P(Trainer, StatsReset,
                         ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

}  // namespace
}  // namespace cohort::stats_reset_test
