// Distributed checkpoints move between world sizes and modes exactly:
// parameters, buffers and optimizer state after a load equal, bit for bit,
// what the saving job held (DDP 4 -> 2, 3; 1 -> 3; 3 -> 1; ZeRO-2 world 4 ->
// ZeRO-1 world 3 and -> DDP world 2; FSDP world 4 -> 2 -> 1), a parameter
// of no elements included (its step count: ZeRO -> ZeRO, DDP, fused; FSDP).
#include <mutex>

#include "cohort/fsdp/fully_shard.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::round_trip_test {
namespace {

namespace fs = std::filesystem;

int64_t data_bytes(const dcp::Metadata& meta) {
  int64_t n = 0;
  for (const auto& f : meta.files) n += f.bytes;
  return n;
}

class DdpRoundTrip : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DdpRoundTrip, LoadsExactlyAtAnotherWorldSize) {
  const auto [save_world, load_world] = GetParam();
  const auto dir = temp_dir("ddp_" + std::to_string(save_world) + "_" + std::to_string(load_world));
  Net ref(1, true);
  torch::optim::AdamW ref_opt(ref->parameters(), kAdamW);
  train(ref, 3, [&] { ref_opt.step(); });
  const auto expected = snapshot(*ref, &ref_opt);

  run_ranks(save_world, [&](Communicator& comm) {
    Net net(1, true);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    train(net, 3, [&] { opt.step(); });
    dcp::save(dcp::get_state_dict(*net, opt), dir, comm);
  });
  // Replicated tensors are written once, whatever the world size.
  int64_t bytes = 0;
  for (const auto& [name, t] : expected) bytes += static_cast<int64_t>(t.nbytes());
  // And each parameter's group options (AdamW: lr, two betas, eps, weight
  // decay, amsgrad), 0-d float64 (param_groups_test checks their values).
  bytes += static_cast<int64_t>(ref->parameters().size() * 6 * sizeof(double));
  EXPECT_EQ(data_bytes(dcp::read_metadata(dir)), bytes);

  std::mutex mu;
  run_ranks(load_world, [&](Communicator& comm) {
    Net net(2, true);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    // Odd ranks load into state that exists, even ranks into none.
    if (comm.rank() % 2 == 1) train(net, 1, [&] { opt.step(); });
    const auto meta = dcp::read_metadata(dir);
    auto sd = dcp::get_state_dict(*net, opt);
    dcp::load(sd, dir, comm, &meta);
    const auto got = snapshot(*net, &opt);
    std::lock_guard<std::mutex> lock(mu);
    expect_equal(got, expected, "rank " + std::to_string(comm.rank()));
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, DdpRoundTrip,
                         ::testing::Values(std::make_tuple(4, 2), std::make_tuple(4, 3),
                                           std::make_tuple(1, 3), std::make_tuple(3, 1)));

std::unique_ptr<ZeroRedundancyOptimizer> make_zero(Net& net, std::shared_ptr<Communicator> comm,
                                                   int stage) {
  ZeroOptions zo;
  zo.stage = stage;
  zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);  // 16 elements: parameters straddle ranks
  return ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kAdamW, zo);
}

// The whole state a ZeRO job holds, on rank 0 (collective).
Named zero_snapshot(Net& net, ZeroRedundancyOptimizer& zero) {
  auto state = zero.consolidate_state_dict(0);
  Named out = snapshot(*net, nullptr);
  const auto named = net->named_parameters();
  for (size_t i = 0; i < state.size(); ++i) {
    for (const auto& [name, t] : state[i]) {
      out["optim." + named[i].key() + "." + name] = name == "step" ? t.reshape({}) : t;
    }
  }
  return out;
}

TEST(ZeroRoundTrip, Stage2World4LoadsIntoStage1World3AndDdpWorld2) {
  const auto dir = temp_dir("zero");
  Named expected;
  run_ranks_shared(4, [&](std::shared_ptr<Communicator> comm) {
    Net net(1, false);
    auto zero = make_zero(net, comm, 2);
    train(net, 3, [&] { zero->step(); });
    auto full = zero_snapshot(net, *zero);
    if (comm->rank() == 0) expected = full;
    dcp::save(dcp::get_state_dict(*net, *zero), dir, *comm);
  });
  ASSERT_FALSE(expected.empty());
  ASSERT_EQ(expected.count("optim.a.weight.exp_avg_sq"), 1u);

  std::mutex mu;
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    Net net(2, false);
    auto zero = make_zero(net, comm, 1);
    const auto meta = dcp::read_metadata(dir);
    auto sd = dcp::get_state_dict(*net, *zero);
    dcp::load(sd, dir, *comm, &meta);
    auto got = zero_snapshot(net, *zero);
    std::lock_guard<std::mutex> lock(mu);
    if (comm->rank() == 0) expect_equal(got, expected, "ZeRO-1 world 3");
    // Every rank's parameters, whole: replicated.
    for (const auto& p : net->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), expected.at("model." + p.key()))) << p.key();
    }
  });
  run_ranks(2, [&](Communicator& comm) {
    Net net(2, false);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    const auto meta = dcp::read_metadata(dir);
    auto sd = dcp::get_state_dict(*net, opt);
    dcp::load(sd, dir, comm, &meta);
    const auto got = snapshot(*net, &opt);
    std::lock_guard<std::mutex> lock(mu);
    expect_equal(got, expected, "DDP world 2, rank " + std::to_string(comm.rank()));
  });
  fs::remove_all(dir);
}

// A parameter of no elements (Net's `empty`) under ZeRO: rank 0 holds its
// state (empty moments, a step count) and saves it, as DDP and FSDP do, and
// ZeRO at another world, DDP and the fused optimizer that stepped already
// load it: every state, the step counts included, as the saving job held.
class ZeroEmpty : public ::testing::TestWithParam<std::tuple<int, int>> {};  // stage, world

TEST_P(ZeroEmpty, AParameterOfNoElementsSavesItsStateAndLoadsElsewhere) {
  const auto [stage, world] = GetParam();
  const auto dir = temp_dir("zero_empty_" + std::to_string(stage) + "_" + std::to_string(world));
  Named expected;
  run_ranks_shared(world, [&, stage = stage](std::shared_ptr<Communicator> comm) {
    Net net(1, true);
    auto zero = make_zero(net, comm, stage);
    train(net, 3, [&] { zero->step(); });
    auto full = zero_snapshot(net, *zero);
    if (comm->rank() == 0) expected = full;
    dcp::save(dcp::get_state_dict(*net, *zero), dir, *comm);
  });
  ASSERT_EQ(expected.count("optim.empty.exp_avg"), 1u);
  EXPECT_EQ(expected.at("optim.empty.step").item<int64_t>(), 3);
  const auto meta = dcp::read_metadata(dir);
  ASSERT_NE(meta.find("optim.empty.step"), nullptr);
  EXPECT_EQ(dcp::read_tensor(dir, meta, "optim.empty.step").item<int64_t>(), 3);

  std::mutex mu;
  run_ranks_shared(world == 1 ? 3 : 1, [&, stage = stage](std::shared_ptr<Communicator> comm) {
    Net net(2, true);
    auto zero = make_zero(net, comm, 3 - stage);
    train(net, 1, [&] { zero->step(); });
    auto sd = dcp::get_state_dict(*net, *zero);
    dcp::load(sd, dir, *comm, &meta);
    auto got = zero_snapshot(net, *zero);
    std::lock_guard<std::mutex> lock(mu);
    if (comm->rank() == 0) expect_equal(got, expected, "ZeRO");
  });
  run_ranks(2, [&](Communicator& comm) {
    Net net(2, true);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    train(net, 1, [&] { opt.step(); });
    auto sd = dcp::get_state_dict(*net, opt);
    dcp::load(sd, dir, comm, &meta);
    const auto got = snapshot(*net, &opt);
    std::lock_guard<std::mutex> lock(mu);
    expect_equal(got, expected, "DDP, rank " + std::to_string(comm.rank()));
  });
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    Net net(2, true);
    FusedDistributedOptimizer fused(net->parameters(), comm, kAdamW);
    train(net, 1, [&] { fused.step(); });
    auto sd = dcp::get_state_dict(*net, fused);
    dcp::load(sd, dir, *comm, &meta);
    const auto named = net->named_parameters();
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < named.size(); ++i) {
      const std::string at = "optim." + named[i].key() + ".";
      const auto held = fused.param_state(i);
      EXPECT_EQ(held.step, expected.at(at + "step").item<int64_t>()) << named[i].key();
      EXPECT_TRUE(torch::equal(held.exp_avg, expected.at(at + "exp_avg"))) << named[i].key();
      EXPECT_TRUE(torch::equal(held.exp_avg_sq, expected.at(at + "exp_avg_sq"))) << named[i].key();
    }
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(StagesWorlds, ZeroEmpty,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values(1, 3)));

// What one process holds after loading `dir` into the bare model.
Named load_whole(const fs::path& dir) {
  Named got;
  run_ranks(1, [&](Communicator& comm) {
    auto seq = make_seq(3);
    torch::optim::AdamW opt(seq->parameters(), kAdamW);
    const auto meta = dcp::read_metadata(dir);
    auto sd = dcp::get_state_dict(*seq, opt);
    dcp::load(sd, dir, comm, &meta);
    got = snapshot(*seq, &opt);
  });
  return got;
}

TEST(FsdpRoundTrip, World4LoadsIntoWorld2AndBack) {
  const auto dir4 = temp_dir("fsdp4"), dir2 = temp_dir("fsdp2");
  torch::OrderedDict<std::string, torch::Tensor> full;
  run_ranks_shared(4, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_fsdp(1, comm);
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    train_fsdp(model, opt, 3);
    auto f = model->full_state_dict();
    if (comm->rank() == 0) full = f;
    dcp::save(dcp::get_state_dict(*model, opt), dir4, *comm);
  });
  // FSDP -> one process: the parameters FSDP gathers, exactly.
  const auto whole = load_whole(dir4);
  ASSERT_EQ(whole.count("optim.0.weight.exp_avg"), 1u);
  for (const auto& p : full) {
    EXPECT_TRUE(torch::equal(whole.at("model." + p.key()), p.value())) << p.key();
  }
  // World 2: each rank's rows of every parameter and state tensor.
  std::mutex mu;
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_fsdp(2, comm);
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    const auto meta = dcp::read_metadata(dir4);
    auto sd = dcp::get_state_dict(*model, opt);
    dcp::load(sd, dir4, *comm, &meta);
    const auto live = dcp::get_state_dict(*model, opt);
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& e : live.tensors) {
        if (e.fqn.rfind("optim.param_groups.", 0) == 0) continue;  // param_groups_test's
        for (const auto& s : e.shards) {
          auto want = whole.at(e.fqn);
          for (size_t d = 0; d < s.box.offsets.size(); ++d) {
            want = want.narrow(static_cast<int64_t>(d), s.box.offsets[d], s.box.lengths[d]);
          }
          EXPECT_TRUE(torch::equal(s.data, want)) << e.fqn << " " << dcp::to_string(s.box);
        }
      }
    }
    dcp::save(live, dir2, *comm);
  });
  expect_equal(load_whole(dir2), whole, "FSDP 4 -> 2 -> 1");
  fs::remove_all(dir4);
  fs::remove_all(dir2);
}

// A parameter of no rows ([0, 5]) under FSDP: no rank holds its row 0, yet
// its step count (it steps as the others do) is saved, and the checkpoint
// loads back into a fresh FSDP model and optimizer, saved at world 1 and
// loaded at 3 and the other way round: every parameter's state has the
// saved step, and the model's rows equal the saving job's.
struct NoRowsImpl : torch::nn::Module {
  torch::Tensor empty;
  NoRowsImpl() { empty = register_parameter("empty", torch::zeros({0, 5})); }
  torch::Tensor forward(const torch::Tensor& x) { return x + empty.sum(); }
};
TORCH_MODULE(NoRows);

FullyShard no_rows_model(uint64_t seed, std::shared_ptr<Communicator> comm) {
  auto seq = make_seq(seed);
  seq->push_back(NoRows());
  return fully_shard(seq, comm);
}

class FsdpNoRows : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(FsdpNoRows, AParameterOfNoRowsSavesAndLoads) {
  const auto [save_world, load_world] = GetParam();
  const auto dir =
      temp_dir("fsdp_no_rows_" + std::to_string(save_world) + "_" + std::to_string(load_world));
  torch::OrderedDict<std::string, torch::Tensor> full;
  run_ranks_shared(save_world, [&](std::shared_ptr<Communicator> comm) {
    auto model = no_rows_model(1, comm);
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    train_fsdp(model, opt, 2);
    auto f = model->full_state_dict();
    if (comm->rank() == 0) full = f;
    dcp::save(dcp::get_state_dict(*model, opt), dir, *comm);
  });
  ASSERT_EQ(full.size(), 7u);
  const auto meta = dcp::read_metadata(dir);
  ASSERT_NE(meta.find("optim.5.empty.step"), nullptr);
  EXPECT_EQ(dcp::read_tensor(dir, meta, "optim.5.empty.step").item<int64_t>(), 2);
  std::mutex mu;
  run_ranks_shared(load_world, [&](std::shared_ptr<Communicator> comm) {
    auto model = no_rows_model(2, comm);
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    auto sd = dcp::get_state_dict(*model, opt);
    dcp::load(sd, dir, *comm);
    auto got = model->full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(opt.state().size(), model->parameters().size());
    for (auto& [key, st] : opt.state()) EXPECT_EQ(*state_step(*st), 2);
    for (const auto& p : full) EXPECT_TRUE(torch::equal(got[p.key()], p.value())) << p.key();
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, FsdpNoRows,
                         ::testing::Values(std::make_tuple(1, 3), std::make_tuple(3, 1)));

}  // namespace
}  // namespace cohort::testing::dcp_test::round_trip_test
