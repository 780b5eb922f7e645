// fully_shard against one-process training when the model changes between
// steps or is nested with checkpointing, ranks as threads over Gloo and UCX
// at world 1 to 3: parameters frozen when the model is wrapped and unfrozen
// later (before the first forward, or after the first step) and frozen
// again; and checkpoint_blocks around shard_blocks under a fully_shard
// root, with gradients zeroed (not dropped) between steps. After 10 AdamW
// steps every parameter equals the one-process model's within 1e-6
// relative.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>

#include "cohort/activation/checkpoint_wrapper.h"
#include "cohort/fsdp/fully_shard.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::changes_test {
namespace {

using namespace fsdp_test;

// Units of 7, 6 and 5 rows (none divides by 2 or 3).
Sequential chain() { return Sequential(Linear(5, 7), Tanh(), Linear(7, 6), Tanh(), Linear(6, 5)); }

// The parameters frozen when the model is wrapped: the whole middle layer
// (a unit with nothing to reduce) and the last layer's weight (a unit
// half frozen).
const std::vector<std::string> kFrozen = {"2.weight", "2.bias", "4.weight"};

void set_frozen(torch::nn::Module& m, bool frozen) {
  for (auto& p : m.named_parameters()) {
    if (std::find(kFrozen.begin(), kFrozen.end(), p.key()) != kFrozen.end())
      p.value().set_requires_grad(!frozen);
  }
}

// Whether kFrozen is frozen when the model is wrapped; unfrozen before step
// `unfreeze_at`'s forward; frozen again before step `refreeze_at`'s.
struct Schedule {
  bool frozen_at_wrap;
  int unfreeze_at, refreeze_at;
};

void train(torch::nn::Module& model, std::vector<torch::Tensor> params, const Schedule& when,
           const std::function<torch::Tensor(int)>& loss) {
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int s = 0; s < kSteps; ++s) {
    if (s == when.unfreeze_at) set_frozen(model, false);
    if (s == when.refreeze_at) set_frozen(model, true);
    // Zeroed, not dropped (LibTorch 1.13's zero_grad()): a frozen parameter
    // that had a gradient keeps a zero one.
    opt.zero_grad();
    loss(s).backward();
    opt.step();
  }
}

struct Case {
  std::string backend;
  int world;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.backend + "_world" + std::to_string(info.param.world);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& b : thread_backends()) {
    for (int w : {1, 2, 3}) out.push_back({b, w});
  }
  return out;
}

// gtest prints a failing case's parameter.
void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << " world " << c.world; }

ThreadRanksOptions options_for(const Case& c) {
  ThreadRanksOptions o;
  o.backend = c.backend;
  return o;
}

// One process; `checkpointed`: the chain's blocks are checkpointed.
Named reference(const Batches& b, const Schedule& when, bool checkpointed) {
  auto bare = chain();
  init_parameters(*bare, 7);
  set_frozen(*bare, when.frozen_at_wrap);
  auto model = checkpointed ? checkpoint_blocks(bare) : bare;
  train(*model, model->parameters(), when,
        [&](int s) { return torch::mse_loss(model->forward(b.x[s]), b.y[s]); });
  return parameters_of(*model);
}

// `world` ranks; each returns its gathered model.
std::map<int, Named> sharded(const Case& c, const Batches& b, const Schedule& when,
                             bool checkpointed) {
  std::mutex mu;
  std::map<int, Named> got;
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto bare = chain();
        set_frozen(*bare, when.frozen_at_wrap);
        auto blocks = shard_blocks(bare, comm);
        auto model = fully_shard(checkpointed ? checkpoint_blocks(blocks) : blocks, comm);
        auto twin = chain();
        init_parameters(*twin, 7);
        auto full = checkpointed ? checkpoint_blocks(twin) : twin;
        load_from(model, *full);
        train(*model, model->parameters(), when, [&](int s) {
          return torch::mse_loss(model->forward(local(b.x[s], *comm)), local(b.y[s], *comm));
        });
        auto state = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = state;
      },
      options_for(c));
  return got;
}

// After 10 steps every rank's gathered model equals one process's.
void expect_one_process(const Case& c, uint64_t seed, const Schedule& when, bool checkpointed) {
  const auto batches = make_batches(seed);
  const auto expected = reference(batches, when, checkpointed);
  for (const auto& [rank, state] : sharded(c, batches, when, checkpointed))
    expect_close(state, expected, 1e-6, "rank " + std::to_string(rank));
}

class FSDPChanges : public ::testing::TestWithParam<Case> {};

TEST_P(FSDPChanges, UnfrozenAfterTheFirstStepAndFrozenAgainEqualsOneProcess) {
  expect_one_process(GetParam(), 5, {true, 1, 6}, false);
}

TEST_P(FSDPChanges, UnfrozenBeforeTheFirstForwardAndFrozenAgainEqualsOneProcess) {
  expect_one_process(GetParam(), 6, {true, 0, 4}, false);
}

TEST_P(FSDPChanges, CheckpointedShardedBlocksWithZeroedGradientsEqualOneProcess) {
  expect_one_process(GetParam(), 8, {false, -1, -1}, true);
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPChanges, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::changes_test
