// dcp::get_state_dict -> dcp::save -> fresh model and optimizer ->
// dcp::get_state_dict -> dcp::load -> dcp::set_state_dict, as dcp.h shows
// it, in every mode (one process, DDP, ZeRO-2, FSDP) at worlds 1 and 3:
// every rank's parameters, optimizer state, step counts and group options
// equal the saving job's bit for bit, and the next step equals the saving
// job's next step bit for bit. The state dict is the saving form (built
// before the checkpoint was known) and the optimizer has not stepped, so
// everything the optimizer holds comes from the checkpoint. Across modes
// (DDP world 2 -> FSDP world 3, FSDP world 3 -> DDP world 1) the next step
// equals one process's within 1e-5, with the saved steps and options.
#include "cohort/dcp/state_dict.h"

#include <mutex>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::state_dict_test {
namespace {

enum class Mode { Plain, Ddp, Zero, Fsdp };

std::string name(Mode m) {
  const char* names[] = {"plain", "ddp", "zero2", "fsdp"};
  return names[static_cast<int>(m)];
}

std::string job_name(Mode m, int world) { return name(m) + std::to_string(world); }

using Ddp = DistributedDataParallel<torch::nn::Sequential>;

// One rank's make_seq(seed) in `mode` and its AdamW (kAdamW).
struct Job {
  Job(Mode mode, std::shared_ptr<Communicator> comm, uint64_t seed) : seq(make_seq(seed)) {
    if (mode == Mode::Ddp) ddp = std::make_unique<Ddp>(seq, comm);
    if (mode == Mode::Fsdp) fsdp = fully_shard(shard_blocks(seq, comm), comm);
    if (mode == Mode::Zero) {
      ZeroOptions zo;
      zo.stage = 2;
      zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);  // 16 elements: parameters straddle ranks
      zero =
          ZeroRedundancyOptimizer::make<torch::optim::AdamW>(seq->parameters(), kAdamW, comm, zo);
    } else {
      opt = std::make_unique<torch::optim::AdamW>(fsdp ? fsdp->parameters() : seq->parameters(),
                                                  kAdamW);
    }
  }

  // Step `s`: the same batch on every rank, so every mode computes what one
  // process does.
  void step(int s) {
    const auto x = batch(100 + s, 12);
    if (zero) {
      zero->zero_grad();
      seq->forward(x).pow(2).mean().backward();
      zero->step();
      return;
    }
    opt->zero_grad();
    auto out = ddp ? ddp->forward(x) : fsdp ? fsdp->forward(x) : seq->forward(x);
    out.pow(2).mean().backward();
    opt->step();
  }

  // What a schedule would have changed by the checkpoint.
  void change_options() {
    for (auto& g : zero ? zero->param_groups() : opt->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(0.004).weight_decay(0.2);
    }
  }

  dcp::StateDict get() {
    if (zero) return dcp::get_state_dict(seq, *zero);
    if (fsdp) return dcp::get_state_dict(fsdp, *opt);
    if (ddp) return dcp::get_state_dict(*ddp, *opt);
    return dcp::get_state_dict(seq, *opt);
  }

  void set(const dcp::StateDict& sd) {
    if (zero) return dcp::set_state_dict(seq, *zero, sd);
    if (fsdp) return dcp::set_state_dict(fsdp, *opt, sd);
    if (ddp) return dcp::set_state_dict(*ddp, *opt, sd);
    dcp::set_state_dict(seq, *opt, sd);
  }

  // Every box of every tensor this rank holds, by name and box, cloned.
  Named boxes() {
    Named out;
    for (const auto& e : get().tensors) {
      for (const auto& s : e.shards) out[e.fqn + dcp::to_string(s.box)] = s.data.clone();
    }
    return out;
  }

  // The whole parameters (collective under FSDP).
  Named parameters() {
    Named out;
    if (fsdp) {
      for (const auto& p : fsdp->full_state_dict()) out[p.key()] = p.value().clone();
    } else {
      for (const auto& p : seq->named_parameters()) out[p.key()] = p.value().detach().clone();
    }
    return out;
  }

  torch::nn::Sequential seq;
  std::unique_ptr<Ddp> ddp;
  FullyShard fsdp{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
};

constexpr int kSteps = 3;

// Trains kSteps, changes the options and saves into `dir`; returns each
// rank's boxes at the save and after one more step.
std::pair<std::map<int, Named>, std::map<int, Named>> train_and_save(Mode mode, int world,
                                                                     const std::string& dir) {
  std::map<int, Named> saved, continued;
  std::mutex mu;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Job job(mode, comm, 1);
    for (int s = 0; s < kSteps; ++s) job.step(s);
    job.change_options();
    dcp::save(job.get(), dir, *comm);
    auto at_save = job.boxes();
    job.step(kSteps);
    auto after = job.boxes();
    std::lock_guard<std::mutex> lock(mu);
    saved[comm->rank()] = std::move(at_save);
    continued[comm->rank()] = std::move(after);
  });
  return {saved, continued};
}

// A fresh job (other weights, an optimizer that has not stepped) that loads
// `dir` as dcp.h shows; `check(job, rank)` runs after the load.
template <typename Check>
void load_fresh(Mode mode, int world, const std::string& dir, Check&& check) {
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Job job(mode, comm, 2);
    auto sd = job.get();
    dcp::load(sd, dir, *comm);
    job.set(sd);
    check(job, comm->rank());
  });
}

class SameMode : public ::testing::TestWithParam<std::tuple<Mode, int>> {};

TEST_P(SameMode, LoadsEverythingAndContinuesBitForBit) {
  const auto [mode, world] = GetParam();
  const auto dir = temp_dir("state_dict_" + job_name(mode, world));
  const auto [saved, continued] = train_and_save(mode, world, dir.string());
  std::mutex mu;
  load_fresh(mode, world, dir.string(), [&](Job& job, int rank) {
    const auto loaded = job.boxes();
    job.step(kSteps);
    const auto next = job.boxes();
    std::lock_guard<std::mutex> lock(mu);
    const auto where =
        name(mode) + " world " + std::to_string(world) + ", rank " + std::to_string(rank);
    // The saving form holds the optimizer's step counts and options too.
    int steps = 0, rates = 0;
    for (const auto& [key, t] : saved.at(rank)) {
      steps += key.find(".step[") != std::string::npos;
      rates += key.rfind("optim.param_groups.", 0) == 0 && key.find(".lr[") != std::string::npos;
    }
    EXPECT_GT(steps, 0) << where;
    EXPECT_GT(rates, 0) << where;
    expect_equal(loaded, saved.at(rank), where + ", loaded");
    expect_equal(next, continued.at(rank), where + ", next step");
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, SameMode,
    ::testing::Combine(::testing::Values(Mode::Plain, Mode::Ddp, Mode::Zero, Mode::Fsdp),
                       ::testing::Values(1, 3)),
    [](const auto& info) { return job_name(std::get<0>(info.param), std::get<1>(info.param)); });

class AcrossModes : public ::testing::TestWithParam<std::tuple<Mode, int, Mode, int>> {};

TEST_P(AcrossModes, ContinuesAsOneProcess) {
  const auto [from, from_world, to, to_world] = GetParam();
  const auto dir = temp_dir("state_dict_" + name(from) + "_" + name(to));
  // One process, continued past the checkpoint.
  Named reference;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    Job job(Mode::Plain, comm, 1);
    for (int s = 0; s < kSteps; ++s) job.step(s);
    job.change_options();
    job.step(kSteps);
    reference = job.parameters();
  });
  train_and_save(from, from_world, dir.string());
  std::mutex mu;
  load_fresh(to, to_world, dir.string(), [&](Job& job, int rank) {
    std::vector<int64_t> steps;
    std::vector<double> lrs;
    auto& opt = job.opt ? *job.opt : job.zero->shard_optimizer();
    for (auto& [key, state] : opt.state()) steps.push_back(*state_step(*state));
    for (auto& g : opt.param_groups()) lrs.push_back(g.options().get_lr());
    job.step(kSteps);
    const auto got = job.parameters();
    std::lock_guard<std::mutex> lock(mu);
    const auto where = name(to) + " rank " + std::to_string(rank);
    EXPECT_FALSE(steps.empty()) << where;
    for (auto s : steps) EXPECT_EQ(s, kSteps) << where;
    for (auto lr : lrs) EXPECT_EQ(lr, 0.004) << where;
    ASSERT_EQ(got.size(), reference.size()) << where;
    for (const auto& [n, t] : reference) {
      EXPECT_TRUE(torch::allclose(got.at(n), t, 0, 1e-5)) << where << ": " << n;
    }
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, AcrossModes,
                         ::testing::Values(std::make_tuple(Mode::Ddp, 2, Mode::Fsdp, 3),
                                           std::make_tuple(Mode::Fsdp, 3, Mode::Ddp, 1)),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return job_name(std::get<0>(p), std::get<1>(p)) + "_to_" +
                                  job_name(std::get<2>(p), std::get<3>(p));
                         });

}  // namespace
}  // namespace cohort::testing::dcp_test::state_dict_test
