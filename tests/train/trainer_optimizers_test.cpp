// The trainer with the distributed optimizers (ZeRO-2 taking over DDP's
// reduction, ZeRO-2 alone, the fused optimizer) takes the same steps as the
// trainer with DDP + torch::optim::AdamW: gradient accumulation over
// micro-batches, clipping by the global norm (sharded for ZeRO), and the
// same reported norms.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::trainer_optimizers_test {
namespace {

using cohort::testing::make_data;
using cohort::testing::make_mlp;

constexpr int64_t kMicro = 4;  // samples per micro-batch
constexpr int64_t kAccumulation = 2;
constexpr int64_t kSteps = 5;
constexpr double kMaxNorm = 0.05;  // below every step's norm: clipping is exercised
constexpr double kTinyBucketMb = 64.0 * 4 / (1024 * 1024);  // 64 floats: several buckets
const auto kAdamW = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);

enum class Mode { DdpAdamW, Zero2Ddp, Zero2Alone, Fused };

struct TrainRun {
  std::vector<torch::Tensor> params;  // rank 0's, after the last step
  std::vector<double> norms;          // per step
  std::vector<bool> clipped;
};

TrainRun train_run(Mode mode, int world, const testing::Synthetic& data) {
  TrainRun out;
  std::mutex mu;
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = make_mlp();
    std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
    if (mode == Mode::DdpAdamW || mode == Mode::Zero2Ddp) {
      ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(net, comm);
    }
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::unique_ptr<ZeroRedundancyOptimizer> zero;
    std::unique_ptr<FusedDistributedOptimizer> fused;
    std::optional<TrainerWiring> wiring;
    ZeroOptions zo;
    zo.stage = 2;
    zo.bucket_cap_mb = kTinyBucketMb;
    switch (mode) {
      case Mode::DdpAdamW:
        adamw = std::make_unique<torch::optim::AdamW>(ddp->parameters(), kAdamW);
        wiring.emplace(TrainerWiring::ddp(*ddp, *adamw));
        break;
      case Mode::Zero2Ddp:
        zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(*ddp, kAdamW, zo);
        wiring.emplace(TrainerWiring::ddp(*ddp, *zero));
        break;
      case Mode::Zero2Alone:
        zero =
            ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kAdamW, zo);
        wiring.emplace(TrainerWiring::zero(net.ptr(), *zero));
        break;
      case Mode::Fused: {
        FusedOptions fo;
        fo.bucket_cap_mb = kTinyBucketMb;
        fused = std::make_unique<FusedDistributedOptimizer>(net->parameters(), comm, kAdamW, fo);
        wiring.emplace(TrainerWiring::fused(net.ptr(), *fused));
        break;
      }
    }
    TrainerOptions config;
    config.accumulation_steps = kAccumulation;
    config.max_grad_norm = kMaxNorm;
    config.schedule.base_lr = 1e-2;
    config.progress = false;
    LossFn loss = [&](const torch::data::Example<>& b) {
      auto y = ddp ? ddp->forward(b.data) : net->forward(b.data);
      return torch::nn::functional::cross_entropy(y, b.target);
    };
    Trainer trainer(std::move(*wiring), loss, config);
    std::vector<double> norms;
    std::vector<bool> clipped;
    const int64_t global = world * kAccumulation * kMicro;
    for (int64_t s = 0; s < kSteps; ++s) {
      std::vector<torch::data::Example<>> batches;
      for (int64_t i = 0; i < kAccumulation; ++i) {
        const int64_t start = s * global + (comm->rank() * kAccumulation + i) * kMicro;
        batches.push_back({data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)});
      }
      const auto m = trainer.train_step(batches);
      norms.push_back(m.grad_norm);
      clipped.push_back(m.clipped);
    }
    if (ddp && mode == Mode::Zero2Ddp && world > 1) {
      // Only the final micro-batch of each step reduced (through ZeRO).
      EXPECT_EQ(ddp->stats().iterations, kSteps);
    }
    zero.reset();  // before DDP, whose reduction it holds
    std::lock_guard<std::mutex> lock(mu);
    if (comm->rank() == 0) {
      for (const auto& p : net->parameters()) out.params.push_back(p.detach().clone());
      out.norms = norms;
      out.clipped = clipped;
    }
  });
  return out;
}

// The wiring's pairings, checked by the compiler: a pairing without a
// factory does not compile, and the trainer takes nothing but a wiring.
template <typename D, typename O, typename = void>
struct WiresWithDdp : std::false_type {};
template <typename D, typename O>
struct WiresWithDdp<
    D, O, std::void_t<decltype(TrainerWiring::ddp(std::declval<D&>(), std::declval<O&>()))>>
    : std::true_type {};
template <typename M, typename O, typename = void>
struct WiresFused : std::false_type {};
template <typename M, typename O>
struct WiresFused<
    M, O, std::void_t<decltype(TrainerWiring::fused(std::declval<M>(), std::declval<O&>()))>>
    : std::true_type {};
using Ddp = DistributedDataParallel<torch::nn::Sequential>;
using Module = std::shared_ptr<torch::nn::Module>;
static_assert(WiresWithDdp<Ddp, torch::optim::AdamW>::value, "DDP + a LibTorch optimizer");
static_assert(WiresWithDdp<Ddp, ZeroRedundancyOptimizer>::value, "DDP + ZeRO");
static_assert(!WiresWithDdp<Ddp, FusedDistributedOptimizer>::value,
              "the fused optimizer all-reduces itself: not under DDP");
static_assert(WiresFused<Module, FusedDistributedOptimizer>::value, "the fused optimizer alone");
static_assert(!WiresFused<Ddp&, FusedDistributedOptimizer>::value, "nor with a DDP as its model");
static_assert(!WiresFused<Module, torch::optim::AdamW>::value, "a LibTorch optimizer is not fused");
static_assert(!std::is_constructible_v<Trainer, Communicator&, Module, TrainerOptimizer&,
                                       GradientSync&, LossFn, TrainerOptions>,
              "no Trainer from loose parts");
static_assert(
    !std::is_constructible_v<TrainerWiring, std::shared_ptr<Communicator>, Module,
                             std::unique_ptr<TrainerOptimizer>, std::unique_ptr<GradientSync>>,
    "no wiring but through its factories");

class TrainerOptimizers : public ::testing::TestWithParam<int> {};

TEST_P(TrainerOptimizers, Zero2AndFusedMatchDdpAdamW) {
  torch::set_num_threads(1);
  const int world = GetParam();
  const auto data = make_data(kSteps * world * kAccumulation * kMicro);
  const TrainRun expected = train_run(Mode::DdpAdamW, world, data);
  for (bool c : expected.clipped) ASSERT_TRUE(c) << "the test must exercise clipping";
  const auto init = make_mlp()->parameters();
  double moved = 0;
  for (size_t i = 0; i < init.size(); ++i) {
    moved = std::max(moved, (expected.params[i] - init[i]).abs().max().item<double>());
  }
  ASSERT_GT(moved, 1e-3);
  for (Mode mode : {Mode::Zero2Ddp, Mode::Zero2Alone, Mode::Fused}) {
    const TrainRun got = train_run(mode, world, data);
    const auto name = mode == Mode::Zero2Ddp     ? "ZeRO-2 with DDP"
                      : mode == Mode::Zero2Alone ? "ZeRO-2 alone"
                                                 : "fused";
    ASSERT_EQ(got.norms.size(), expected.norms.size());
    for (size_t s = 0; s < got.norms.size(); ++s) {
      EXPECT_NEAR(got.norms[s], expected.norms[s], 1e-6 * expected.norms[s])
          << name << ", step " << s;
      EXPECT_EQ(got.clipped[s], expected.clipped[s]) << name << ", step " << s;
    }
    for (size_t i = 0; i < got.params.size(); ++i) {
      EXPECT_LT((got.params[i] - expected.params[i]).abs().max().item<double>(), 1e-6)
          << name << ", parameter " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, TrainerOptimizers, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

// What the types cannot say: the ZeRO of ddp(ddp, zero) must be built from
// that DDP, and the ZeRO of zero(model, zero) must reduce alone.
TEST(TrainerWiring, RefusesAZeroBuiltForTheOtherPairing) {
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto net = make_mlp();
    Ddp ddp(net, comm);
    auto alone =
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kAdamW);
    EXPECT_THROW(TrainerWiring::ddp(ddp, *alone), InvalidArgument);
    auto for_ddp = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kAdamW);
    EXPECT_THROW(TrainerWiring::zero(net.ptr(), *for_ddp), InvalidArgument);
    EXPECT_NO_THROW(TrainerWiring::ddp(ddp, *for_ddp));
  });
}

}  // namespace
}  // namespace cohort::trainer_optimizers_test
