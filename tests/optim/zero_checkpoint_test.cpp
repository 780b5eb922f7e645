// ZeRO checkpoints: a job saved at step 10 (each rank its shard) and resumed
// by a fresh job ends where an uninterrupted run does; a shard refuses to
// load on another rank; consolidate_state_dict rebuilds on one rank the
// state DDP + torch::optim::AdamW holds.
#include <gtest/gtest.h>

#include <filesystem>

#include "cohort/core/torch_compat.h"
#include "cohort/optim/optimizer_state.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::zero_checkpoint_test {
namespace {

namespace fs = std::filesystem;
constexpr double kTinyBucketMb = 16.0 * 4 / (1024 * 1024);

const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(0.01).weight_decay(0.1);

std::unique_ptr<ZeroRedundancyOptimizer> make_zero(OptimNet& net,
                                                   std::shared_ptr<Communicator> comm, int stage) {
  ZeroOptions zo;
  zo.stage = stage;
  zo.bucket_cap_mb = kTinyBucketMb;
  return ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kAdamW, zo);
}

void train(const Problem& pb, OptimNet& net, ZeroRedundancyOptimizer& zero, int rank, int from,
           int to) {
  for (int s = from; s < to; ++s) {
    zero.zero_grad();
    pb.loss(net, s, rank).backward();
    zero.step();
  }
}

fs::path shard_path(const fs::path& dir, int rank) {
  return dir / ("zero_shard_" + std::to_string(rank) + ".pt");
}

class ZeroCheckpoint : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ZeroCheckpoint, SaveAtTenResumeInFreshJobEqualsUninterrupted) {
  const auto [world, stage] = GetParam();
  torch::set_num_threads(1);
  const Problem pb(world);
  const auto dir =
      fs::temp_directory_path() / ("cohort_zero_ckpt_" + std::to_string(::getpid()) + "_" +
                                   std::to_string(world) + "_" + std::to_string(stage));
  fs::create_directories(dir);

  RankResults straight(world), resumed(world);
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    auto zero = make_zero(net, comm, stage);
    train(pb, net, *zero, comm->rank(), 0, kSteps);
    straight.put(comm->rank(), net->parameters());
  });
  // Job 1: ten steps, then every rank writes its shard and the model.
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    auto zero = make_zero(net, comm, stage);
    train(pb, net, *zero, comm->rank(), 0, kSteps / 2);
    torch::serialize::OutputArchive archive;
    zero->save_shard(archive);
    write_parameters(archive, *net);
    archive.save_to(shard_path(dir, comm->rank()).string());
  });
  // Job 2: fresh model and optimizer, loaded, ten more steps.
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    auto zero = make_zero(net, comm, stage);
    torch::serialize::InputArchive archive;
    archive.load_from(shard_path(dir, comm->rank()).string());
    zero->load_shard(archive);
    read_parameters(archive, *net);
    train(pb, net, *zero, comm->rank(), kSteps / 2, kSteps);
    resumed.put(comm->rank(), net->parameters());
    // Another rank's shard does not fit this rank's optimizer.
    torch::serialize::InputArchive other;
    other.load_from(shard_path(dir, (comm->rank() + 1) % world).string());
    if (world > 1) {
      EXPECT_THROW(zero->load_shard(other), MismatchError);
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_LT(max_diff(resumed.params[r], straight.params[r]), 1e-6) << "rank " << r;
  }
  EXPECT_GT(max_diff(straight.params[0], pb.init), 1e-3);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroCheckpoint,
                         ::testing::Values(std::make_tuple(2, 1), std::make_tuple(3, 2),
                                           std::make_tuple(4, 2)));

TEST(ZeroConsolidate, RebuildsTheFullAdamWStateOnOneRank) {
  torch::set_num_threads(1);
  const int world = 3, to = 1;
  const Problem pb(world);
  // Reference: DDP + AdamW's state on rank 0, per parameter.
  std::vector<std::map<std::string, torch::Tensor>> expected;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    DistributedDataParallel<OptimNet> ddp(net, comm);
    torch::optim::AdamW opt(ddp.parameters(), kAdamW);
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::mse_loss(ddp.forward(pb.xs[s][comm->rank()]), pb.ys[s][comm->rank()]).backward();
      opt.step();
    }
    if (comm->rank() != 0) return;
    for (const auto& p : net->parameters()) {
      const auto& st = *opt.state().at(cohort::optimizer_state_key(p));
      std::map<std::string, torch::Tensor> m;
      for (const auto& [name, t] : state_tensors(st)) m[name] = t.clone();
      m["step"] = torch::tensor({*state_step(st)});
      expected.push_back(m);
    }
  });
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    auto zero = make_zero(net, comm, 2);
    train(pb, net, *zero, comm->rank(), 0, kSteps);
    const auto full = zero->consolidate_state_dict(to);
    if (comm->rank() != to) {
      EXPECT_TRUE(full.empty());
      return;
    }
    ASSERT_EQ(full.size(), expected.size());
    for (size_t i = 0; i < full.size(); ++i) {
      ASSERT_EQ(full[i].size(), expected[i].size()) << "parameter " << i;
      for (const auto& [name, t] : expected[i]) {
        ASSERT_TRUE(full[i].count(name)) << name;
        EXPECT_EQ(full[i].at(name).sizes(), t.sizes()) << name;
        EXPECT_LT((full[i].at(name) - t).abs().max().item<double>(), 1e-6)
            << "parameter " << i << " " << name;
      }
    }
    EXPECT_EQ(full[0].at("step").item<int64_t>(), kSteps);
  });
}

}  // namespace
}  // namespace cohort::testing::zero_checkpoint_test
