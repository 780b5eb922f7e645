// ZeRO steps each rank's shard from that rank's values and all-gathers the
// shards; the fused optimizer applies one averaged update to each rank's own
// values. Ranks that start from different values would train a silent mix
// (ZeRO) or stay apart (fused). Both compare a digest of the values at
// construction: one rank whose b.weight differs in one element by one ulp
// is a MismatchError on every rank naming the parameter and the groups of
// ranks (ranks as threads over every engine, worlds 2 and 3). Over cohort
// DDP, whose constructor broadcasts rank 0's values, the same start trains
// as DDP does; so does ZeRO alone from equal values (world 1 included).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::initial_values_test {
namespace {

using Case = EngineWorld;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const auto kOpts = torch::optim::AdamWOptions(0.01);

// The last rank's b.weight[1][2] one ulp up: the smallest difference there is.
void nudge_on_last_rank(OptimNet& net, const Communicator& comm) {
  if (comm.rank() != comm.size() - 1) return;
  torch::NoGradGuard no_grad;
  auto w = net->b->weight;
  const float v = w[1][2].item<float>();
  w[1][2] = std::nextafter(v, std::numeric_limits<float>::infinity());
}

// `build` on every rank after the nudge; each rank's error.
std::vector<std::string> build_with_one_rank_apart(
    const Case& c, const std::function<void(OptimNet&, std::shared_ptr<Communicator>)>& build) {
  const Problem pb(c.world);
  auto options = options_for(c);
  options.timeout = std::chrono::seconds(5);
  return errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto net = pb.make_net();
        nudge_on_last_rank(net, *comm);
        build(net, comm);
      },
      options);
}

void expect_named(const std::vector<std::string>& errors, const std::string& who) {
  const int world = static_cast<int>(errors.size());
  const std::string agree = world == 2 ? "rank 0: values digest " : "ranks 0, 1: values digest ";
  for (int r = 0; r < world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, who + ": on rank " + std::to_string(r) + " of " + std::to_string(world)))
        << e;
    EXPECT_TRUE(has(e, "the ranks start from different parameter values: parameter 2, float")) << e;
    EXPECT_TRUE(has(e, "[3, 5], differs (" + agree)) << e;
    EXPECT_TRUE(has(e, "; rank " + std::to_string(world - 1) + ": values digest ")) << e;
  }
}

class InitialValues : public ::testing::TestWithParam<Case> {};

TEST_P(InitialValues, ZeroAloneRefusesRanksThatStartApartOnEveryRank) {
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto errors = build_with_one_rank_apart(GetParam(), [&](OptimNet& net, auto comm) {
      ZeroOptions zo;
      zo.stage = stage;
      ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kOpts, zo);
    });
    expect_named(errors, "ZeroRedundancyOptimizer");
    for (const auto& e : errors) EXPECT_TRUE(has(e, "after cohort DDP")) << e;
  }
}

TEST_P(InitialValues, FusedRefusesRanksThatStartApartOnEveryRank) {
  auto errors = build_with_one_rank_apart(GetParam(), [&](OptimNet& net, auto comm) {
    FusedDistributedOptimizer fused(net->parameters(), comm, kOpts);
  });
  expect_named(errors, "FusedDistributedOptimizer");
}

// DDP broadcasts rank 0's values first, so ZeRO over DDP starts equal on
// every rank and trains exactly as DDP + AdamW from rank 0's values.
TEST_P(InitialValues, ZeroOverDdpTrainsFromRankZerosValues) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const Problem pb(c.world);
  const auto expected = reference_run(
      pb,
      [&](std::vector<torch::Tensor> ps) {
        return std::make_unique<torch::optim::AdamW>(ps, kOpts);
      },
      3);
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    RankResults got(c.world);
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          auto net = pb.make_net();
          nudge_on_last_rank(net, *comm);
          DistributedDataParallel<OptimNet> ddp(net, comm);
          ZeroOptions zo;
          zo.stage = stage;
          auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kOpts, zo);
          for (int s = 0; s < 3; ++s) {
            zero->zero_grad();
            torch::mse_loss(ddp.forward(pb.xs[s][comm->rank()]), pb.ys[s][comm->rank()]).backward();
            zero->step();
          }
          got.put(comm->rank(), net->parameters());
        },
        options_for(c));
    for (int r = 0; r < c.world; ++r) EXPECT_LT(max_diff(got.params[r], expected), 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(Optim, InitialValues, ::testing::ValuesIn(engine_worlds({2, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::initial_values_test
