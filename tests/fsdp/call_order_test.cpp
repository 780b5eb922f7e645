// Units called in another order than they were registered in (a model that
// registers its blocks first to last and calls them last to first): each
// unit is resharded and its gradients reduce-scattered as soon as its
// backward is over, the forward gathers each unit once, and training
// equals one process. Ranks as threads over Gloo and UCX at worlds 1 to 3;
// what a rank holds is counted from gradient hooks and between the calls of
// the model's forward, and with MemoryScope over the backward (cohort's
// ring, whose gathers stage nothing).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "cohort/memory/memory_scope.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::call_order_test {
namespace {

using namespace fsdp_test;

constexpr int64_t kWidth = 32, kBlocks = 6;
// A block's full parameters, as one unit's full storage holds them.
constexpr int64_t kBlockBytes = (kWidth * kWidth + kWidth) * 4;

// Blocks registered b0 .. b5, called b5 .. b0 when `reversed` (else in
// registration order), then a head the root holds. Units when built with a
// communicator. `between` runs after each block's call.
struct ReversedImpl : torch::nn::Module {
  std::vector<AnyModule> blocks;
  Linear head{nullptr};
  bool reversed = true;
  std::function<void()> between;
  ReversedImpl(const std::shared_ptr<Communicator>& comm, FullyShardOptions options) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      AnyModule block(Linear(kWidth, kWidth));
      if (comm) block = AnyModule(FullyShard(block, comm, options));
      blocks.push_back(block);
      register_module("b" + std::to_string(i), block.ptr());
    }
    head = register_module("head", Linear(kWidth, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (int64_t k = 0; k < kBlocks; ++k) {
      h = torch::tanh(blocks[reversed ? kBlocks - 1 - k : k].forward(h));
      if (between) between();
    }
    return head(h);
  }
};
TORCH_MODULE(Reversed);

std::vector<FullyShardImpl*> units_of(FullyShard& model) {
  std::vector<FullyShardImpl*> out;
  for (const auto& m : model->modules()) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.get());
    if (unit && unit->has_param_group()) out.push_back(unit);
  }
  return out;
}

// Bytes of full parameters (gathered units) and of full gradients (.grad,
// which holds only full gradients in the middle of a backward: the shards
// are put aside until its end).
int64_t full_bytes(const std::vector<FullyShardImpl*>& units) {
  int64_t n = 0;
  for (auto* unit : units) {
    n += unit->param_group().unsharded_bytes();
    for (const auto& p : unit->param_group().params()) {
      if (p.grad().defined()) n += p.grad().numel() * p.grad().element_size();
    }
  }
  return n;
}

// Units gathered or with an all-gather in flight (whose output buffer is
// the unit's size).
int gathering(const std::vector<FullyShardImpl*>& units) {
  int n = 0;
  for (auto* unit : units) n += unit->param_group().will_gather() ? 0 : 1;
  return n;
}

class FSDPCallOrder : public ::testing::TestWithParam<EngineWorld> {};

// On the second step: the most bytes of full parameters and gradients a
// rank holds in the middle of backward (each block's weight hook), and the
// most units gathered or gathering in forward (after each block's call).
// In call order a backward holds the unit computing and its gradients, the
// next one prefetched at the end (and the root's head); a forward the
// root and the block prefetched for the next call (a unit whose forward
// already ran is not gathered again).
TEST_P(FSDPCallOrder, AUnitCalledOutOfRegistrationOrderIsReshardedWhenItsBackwardEnds) {
  const auto c = GetParam();
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto bare = Reversed(comm, FullyShardOptions{});
        auto model = fully_shard(AnyModule(bare), comm);
        const auto units = units_of(model);
        int64_t backward_peak = 0;
        int forward_peak = 0;
        for (auto& block : bare->blocks) {
          block.ptr()->named_parameters()["weight"].register_hook([&](const torch::Tensor&) {
            backward_peak = std::max(backward_peak, full_bytes(units));
          });
        }
        bare->between = [&] { forward_peak = std::max(forward_peak, gathering(units)); };
        auto x = torch::randn({2, kWidth});
        model->forward(x).sum().backward();
        backward_peak = forward_peak = 0;
        model->forward(x).sum().backward();
        std::cout << "[ rank " << comm->rank() << " ] forward: " << forward_peak
                  << " units gathered or gathering; backward: " << backward_peak
                  << " bytes (a block: " << kBlockBytes << ")\n";
        const int64_t head = 2 * (kWidth * 3 + 3) * 4;  // the root's parameters and gradients
        EXPECT_LE(forward_peak, 2);
        EXPECT_LE(backward_peak, 2 * kBlockBytes + head);
        EXPECT_GE(backward_peak, kBlockBytes);  // the hooks ran while a block computed
      },
      options_for(c));
}

// Blocks called in reverse on even steps and in registration order on odd
// ones, with AdamW: the parameters equal one process's, at either
// reshard_after_forward, within 1e-5 relative (float32 through seven
// layers, the ranks' gradients averaged in another order than one
// process sums them: up to 2.2e-6, at world 3).
TEST_P(FSDPCallOrder, ACallOrderThatChangesBetweenStepsTrainsAsOneProcess) {
  const auto c = GetParam();
  const auto batches = [] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    Batches b;
    for (int s = 0; s < kSteps; ++s) {
      b.x.push_back(torch::randn({kBatch, kWidth}, gen));
      b.y.push_back(torch::randn({kBatch, 3}, gen));
    }
    return b;
  }();
  auto adamw = [](std::vector<torch::Tensor> p) {
    return torch::optim::AdamW(p, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  };
  auto ref = Reversed(std::shared_ptr<Communicator>(), FullyShardOptions{});
  init_parameters(*ref, 5);
  Named expected;
  {
    auto opt = adamw(ref->parameters());
    for (int s = 0; s < kSteps; ++s) {
      ref->reversed = s % 2 == 0;
      opt.zero_grad();
      torch::mse_loss(ref->forward(batches.x[s]), batches.y[s]).backward();
      opt.step();
    }
    for (const auto& p : ref->named_parameters()) expected.insert(p.key(), p.value().clone());
  }
  for (bool reshard : {true, false}) {
    std::mutex mu;
    std::vector<Named> got;
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          FullyShardOptions options;
          options.reshard_after_forward = reshard;
          auto bare = Reversed(comm, options);
          auto model = fully_shard(AnyModule(bare), comm);
          auto twin = Reversed(std::shared_ptr<Communicator>(), FullyShardOptions{});
          init_parameters(*twin, 5);
          load_from(model, *twin);
          auto opt = adamw(model->parameters());
          for (int s = 0; s < kSteps; ++s) {
            bare->reversed = s % 2 == 0;
            opt.zero_grad();
            auto x = local(batches.x[s], *comm), y = local(batches.y[s], *comm);
            torch::mse_loss(model->forward(x), y).backward();
            opt.step();
          }
          auto state = model->full_state_dict();
          std::lock_guard<std::mutex> lock(mu);
          got.push_back(state);
        },
        options_for(c));
    for (const auto& state : got) {
      expect_close(state, expected, 1e-5, "reshard_after_forward " + std::to_string(reshard));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPCallOrder, ::testing::ValuesIn(engine_worlds({1, 2, 3})),
                         engine_world_name);

// What the reversed model's backward allocates on the rank's thread, as
// FSDPFeatures.ABackwardHoldsAtMostTwoUnitsBeyondItsShards counts it in
// registration order: two units (a unit = the padded flat buffer), a
// shard, the gradient landing and a few activation gradients; the root's
// head and its gradient.
TEST(FSDPCallOrderMemory, AReversedModelsBackwardHoldsAtMostTwoUnitsBeyondItsShards) {
  for (int world : {1, 2, 3}) {
    ThreadRanksOptions ring;
    ring.algorithm = Algorithm::Ring;
    run_ranks_shared(
        world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          auto model = fully_shard(AnyModule(Reversed(comm, FullyShardOptions{})), comm);
          auto x = torch::randn({1, kWidth});
          model->forward(x).sum().backward();
          auto loss = model->forward(x).sum();
          int64_t peak = 0;
          {
            memory::MemoryScope scope;
            loss.backward();
            peak = scope.peak_bytes();
          }
          const int64_t rows = (kWidth + world - 1) / world;
          const int64_t shard = rows * (kWidth + 1) * 4;
          const int64_t unit = world * shard;
          const int64_t head = 2 * (kWidth * 3 + 3) * 4;
          const int64_t activation_grads = 4 * kWidth * 4;
          const int64_t landing = kWidth * kWidth * 4;
          std::cout << "[ world " << world << " rank " << comm->rank() << " ] backward peak "
                    << peak << " bytes (a unit: " << unit << ")\n";
          EXPECT_LE(peak, 2 * unit + shard + landing + activation_grads + head);
          EXPECT_GE(peak, kBlockBytes);  // it did gather
        },
        ring);
  }
}

}  // namespace
}  // namespace cohort::testing::call_order_test
