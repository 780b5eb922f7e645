// The trainer's comm_seconds and comm_bytes for every way of reducing
// gradients: DDP, ZeRO-2 inside DDP (the reduction owner), ZeRO-1 alone and
// the fused optimizer. Each reduces a known number of gradient bytes, so
// comm_bytes has a lower bound; comm_seconds is positive and within the step.
#include <gtest/gtest.h>

#include <optional>

#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "tests/train/train_fixtures.h"

namespace cohort::trainer_comm_test {
namespace {

enum class Mode { Ddp, Zero2Ddp, Zero1Alone, Fused };

const char* name(Mode m) {
  switch (m) {
    case Mode::Ddp:
      return "DDP";
    case Mode::Zero2Ddp:
      return "ZeRO-2 in DDP";
    case Mode::Zero1Alone:
      return "ZeRO-1 alone";
    case Mode::Fused:
      return "fused";
  }
  return "";
}

void check_mode(Mode mode, int world) {
  const auto data = testing::make_data(64);
  const auto opts = torch::optim::AdamWOptions(1e-2);
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto net = testing::make_mlp();
    int64_t grad_bytes = 0;
    for (auto& p : net->parameters()) grad_bytes += p.numel() * 4;
    std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
    if (mode == Mode::Ddp || mode == Mode::Zero2Ddp) {
      ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(net, comm);
    }
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::unique_ptr<ZeroRedundancyOptimizer> zero;
    std::unique_ptr<FusedDistributedOptimizer> fused;
    std::optional<TrainerWiring> wiring;
    ZeroOptions zo;
    switch (mode) {
      case Mode::Ddp:
        adamw = std::make_unique<torch::optim::AdamW>(ddp->parameters(), opts);
        wiring.emplace(TrainerWiring::ddp(*ddp, *adamw));
        break;
      case Mode::Zero2Ddp:
        zo.stage = 2;
        zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(*ddp, opts, zo);
        wiring.emplace(TrainerWiring::ddp(*ddp, *zero));
        break;
      case Mode::Zero1Alone:
        zo.stage = 1;
        zero =
            ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, opts, zo);
        wiring.emplace(TrainerWiring::zero(net.ptr(), *zero));
        break;
      case Mode::Fused:
        fused = std::make_unique<FusedDistributedOptimizer>(net->parameters(), comm, opts);
        wiring.emplace(TrainerWiring::fused(net.ptr(), *fused));
        break;
    }
    TrainerOptions config;
    config.progress = false;
    LossFn loss = [&](const torch::data::Example<>& b) {
      auto y = ddp ? ddp->forward(b.data) : net->forward(b.data);
      return torch::nn::functional::cross_entropy(y, b.target);
    };
    Trainer trainer(std::move(*wiring), loss, config);
    for (int64_t s = 0; s < 3; ++s) {
      const int64_t start = (s * world + comm->rank()) * 4;
      auto m = trainer.train_step({{data.x.narrow(0, start, 4), data.y.narrow(0, start, 4)}});
      if (world == 1) {
        EXPECT_EQ(m.comm_bytes, 0) << name(mode);
        continue;
      }
      EXPECT_GT(m.comm_seconds, 0.0) << name(mode) << " step " << s;
      EXPECT_LE(m.comm_seconds, m.step_seconds) << name(mode) << " step " << s;
      // A reduce-scatter (ZeRO-2) sends (p-1)/p of the gradients; every
      // other way sends at least that (an all-reduce twice as much).
      EXPECT_GE(m.comm_bytes, grad_bytes * (world - 1) / world) << name(mode) << " step " << s;
    }
    if (mode == Mode::Fused && world > 1) {
      const auto& st = fused->sync_statistics();
      EXPECT_EQ(st.syncs, 3);
      EXPECT_GE(st.buckets_synced, 3);
      EXPECT_GE(st.communication_efficiency(), 0.0);
      EXPECT_LE(st.communication_efficiency(), 1.0);
    }
    zero.reset();  // before DDP, whose reduction it may hold
  });
}

class TrainerComm : public ::testing::TestWithParam<int> {};

TEST_P(TrainerComm, CommSecondsAndBytesForEveryReduction) {
  for (Mode m : {Mode::Ddp, Mode::Zero2Ddp, Mode::Zero1Alone, Mode::Fused}) {
    check_mode(m, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(World, TrainerComm, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::trainer_comm_test
