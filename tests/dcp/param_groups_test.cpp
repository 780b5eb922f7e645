// The options of an optimizer's parameter groups (lr, betas, eps, weight
// decay, amsgrad) go through dcp: changed after training, saved in one mode
// at one world size, and loaded into a fresh optimizer with other options in
// another mode at another world (DDP, ZeRO, FSDP at worlds 1 and 3), every
// rank's groups have the saved options, group by group.
#include <tuple>

#include "cohort/fsdp/fully_shard.h"
#include "support/rank_errors.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::param_groups_test {
namespace {

namespace fs = std::filesystem;
using torch::optim::AdamWOptions;

enum class Mode { Ddp, Zero, Fsdp };

// Group 0: the first two parameters; group 1: the rest.
std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<torch::Tensor>& params,
                                                          const AdamWOptions& first,
                                                          const AdamWOptions& second) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>(params.begin(), params.begin() + 2),
                      std::make_unique<AdamWOptions>(first));
  groups.emplace_back(std::vector<torch::Tensor>(params.begin() + 2, params.end()),
                      std::make_unique<AdamWOptions>(second));
  return groups;
}

// One rank's model and AdamW in `mode`, its two groups built with `first`
// and `second`.
struct Job {
  Job(Mode mode, std::shared_ptr<Communicator> comm, uint64_t seed, const AdamWOptions& first,
      const AdamWOptions& second)
      : mode(mode), seq(make_seq(seed)) {
    if (mode == Mode::Fsdp) {
      fsdp = fully_shard(shard_blocks(seq, comm), comm);
      opt = std::make_unique<torch::optim::AdamW>(two_groups(fsdp->parameters(), first, second),
                                                  kAdamW);
    } else if (mode == Mode::Zero) {
      ZeroOptions zo;
      zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);  // 16 elements: parameters straddle ranks
      zero = std::make_unique<ZeroRedundancyOptimizer>(
          two_groups(seq->parameters(), first, second),
          [](std::vector<torch::optim::OptimizerParamGroup> shard) {
            return std::make_unique<torch::optim::AdamW>(std::move(shard), kAdamW);
          },
          comm, zo);
    } else {
      opt = std::make_unique<torch::optim::AdamW>(two_groups(seq->parameters(), first, second),
                                                  kAdamW);
    }
  }

  // The groups that step: the inner optimizer's under ZeRO.
  std::vector<torch::optim::OptimizerParamGroup>& groups() {
    return zero ? zero->param_groups() : opt->param_groups();
  }

  void train(int steps) {
    for (int s = 0; s < steps; ++s) {
      if (zero) {
        zero->zero_grad();
      } else {
        opt->zero_grad();
      }
      auto out = fsdp ? fsdp->forward(batch(100 + s, 12)) : seq->forward(batch(100 + s, 12));
      out.pow(2).mean().backward();
      if (zero) {
        zero->step();
      } else {
        opt->step();
      }
    }
  }

  dcp::StateDict state() {
    if (mode == Mode::Fsdp) return dcp::get_state_dict(fsdp, *opt);
    if (mode == Mode::Zero) return dcp::get_state_dict(seq, *zero);
    return dcp::get_state_dict(seq, *opt);
  }

  // This rank's parameters (its shards under FSDP) and optimizer state,
  // flattened and concatenated, cloned.
  std::vector<float> parameters_and_state() {
    std::vector<torch::Tensor> parts;
    auto& opt_ref = zero ? zero->shard_optimizer() : *opt;
    for (const auto& p : fsdp ? fsdp->parameters() : seq->parameters()) {
      parts.push_back(p.detach().reshape(-1));
    }
    for (auto& [key, st] : opt_ref.state()) {
      for (const auto& [n, t] : state_tensors(*st)) parts.push_back(t.reshape(-1));
    }
    auto all = torch::cat(parts).contiguous();
    return {all.data_ptr<float>(), all.data_ptr<float>() + all.numel()};
  }

  Mode mode;
  torch::nn::Sequential seq;
  FullyShard fsdp{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
};

// What a schedule would have set by the time of the checkpoint.
const AdamWOptions kSaved0 =
    AdamWOptions(0.005).betas({0.85, 0.99}).eps(1e-7).weight_decay(0.3).amsgrad(false);
const AdamWOptions kSaved1 =
    AdamWOptions(0.002).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.0).amsgrad(true);

void expect_options(const torch::optim::OptimizerOptions& got, const AdamWOptions& want,
                    const std::string& what) {
  const auto& o = dynamic_cast<const AdamWOptions&>(got);
  EXPECT_EQ(o.lr(), want.lr()) << what;
  EXPECT_EQ(std::get<0>(o.betas()), std::get<0>(want.betas())) << what;
  EXPECT_EQ(std::get<1>(o.betas()), std::get<1>(want.betas())) << what;
  EXPECT_EQ(o.eps(), want.eps()) << what;
  EXPECT_EQ(o.weight_decay(), want.weight_decay()) << what;
  EXPECT_EQ(o.amsgrad(), want.amsgrad()) << what;
}

std::string name(Mode m) { return m == Mode::Ddp ? "ddp" : m == Mode::Zero ? "zero" : "fsdp"; }

// save mode, save world, load mode, load world
using Param = std::tuple<Mode, int, Mode, int>;
class ParamGroups : public ::testing::TestWithParam<Param> {};

TEST_P(ParamGroups, OptionsChangedBeforeSavingAreRestored) {
  const auto [save_mode, save_world, load_mode, load_world] = GetParam();
  const auto dir = temp_dir("param_groups_" + name(save_mode) + std::to_string(save_world) + "_" +
                            name(load_mode) + std::to_string(load_world));
  run_ranks_shared(save_world, [&, save_mode = save_mode](std::shared_ptr<Communicator> comm) {
    // Built with the defaults, amsgrad in group 1 from the start (so its
    // state has max_exp_avg_sq); then trained and changed.
    Job job(save_mode, comm, 1, kAdamW, AdamWOptions(kAdamW).amsgrad(true));
    job.train(2);
    for (size_t g = 0; g < 2; ++g) {
      auto& o = static_cast<AdamWOptions&>(job.groups()[g].options());
      const auto& want = g == 0 ? kSaved0 : kSaved1;
      o.lr(want.lr()).betas(want.betas()).eps(want.eps()).weight_decay(want.weight_decay());
    }
    dcp::save(job.state(), dir, *comm);
  });
  std::mutex mu;
  run_ranks_shared(load_world, [&, load_mode = load_mode](std::shared_ptr<Communicator> comm) {
    Job job(load_mode, comm, 2, kAdamW, kAdamW);
    auto sd = job.state();
    dcp::load(sd, dir, *comm);
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(job.groups().size(), 2u);
    for (size_t g = 0; g < 2; ++g) {
      expect_options(job.groups()[g].options(), g == 0 ? kSaved0 : kSaved1,
                     "rank " + std::to_string(comm->rank()) + ", group " + std::to_string(g));
    }
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, ParamGroups,
                         ::testing::Values(std::make_tuple(Mode::Ddp, 1, Mode::Ddp, 3),
                                           std::make_tuple(Mode::Ddp, 3, Mode::Zero, 1),
                                           std::make_tuple(Mode::Zero, 3, Mode::Ddp, 1),
                                           std::make_tuple(Mode::Zero, 1, Mode::Fsdp, 3),
                                           std::make_tuple(Mode::Fsdp, 3, Mode::Zero, 3),
                                           std::make_tuple(Mode::Fsdp, 1, Mode::Ddp, 3)),
                         [](const auto& info) {
                           return name(std::get<0>(info.param)) +
                                  std::to_string(std::get<1>(info.param)) + "_to_" +
                                  name(std::get<2>(info.param)) +
                                  std::to_string(std::get<3>(info.param));
                         });

// A checkpoint of two groups (no weight decay on the biases) loaded into
// an optimizer whose one group holds a weight and a bias: the group cannot
// take both values, so the load is a ConfigError on every rank, naming the
// option, both values and both parameters, and nothing changes (taking the
// last parameter's would train every other one with options it was never
// saved with). DDP, ZeRO (whose ranks hold different parameters of the
// group) and FSDP, at worlds 1 and 3.
class GroupsThatDiffer : public ::testing::TestWithParam<std::tuple<Mode, int>> {};

TEST_P(GroupsThatDiffer, LoadingThemIntoOneGroupIsAConfigErrorOnEveryRank) {
  const auto [mode, world] = GetParam();
  const auto dir = temp_dir("groups_differ_" + name(mode) + std::to_string(world));
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto seq = make_seq(1);
    std::vector<torch::Tensor> weights, biases;
    for (const auto& p : seq->named_parameters()) {
      (p.key().find("bias") != std::string::npos ? biases : weights).push_back(p.value());
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(weights, std::make_unique<AdamWOptions>(AdamWOptions(kAdamW)));
    groups.emplace_back(biases,
                        std::make_unique<AdamWOptions>(AdamWOptions(kAdamW).weight_decay(0)));
    torch::optim::AdamW opt(std::move(groups), kAdamW);
    opt.zero_grad();
    seq->forward(batch(100, 12)).pow(2).mean().backward();
    opt.step();
    dcp::save(dcp::get_state_dict(seq, opt), dir, *comm);
  });
  const auto one = AdamWOptions(0.003).weight_decay(0.05);
  const auto errors =
      errors_on_every_rank(world, [&, mode = mode](std::shared_ptr<Communicator> comm) {
        // One group: the same options twice.
        Job job(mode, comm, 2, one, one);
        job.train(1);
        const auto before = job.parameters_and_state();
        auto sd = job.state();
        try {
          dcp::load(sd, dir, *comm);
        } catch (const ConfigError&) {
          for (auto& g : job.groups()) expect_options(g.options(), one, "after the refused load");
          EXPECT_TRUE(job.parameters_and_state() == before) << "changed by the refused load";
          throw;
        } catch (const std::exception& e) {
          throw std::runtime_error(std::string("not a ConfigError: ") + e.what());
        }
      });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("weight_decay is 0.1 for 0.weight and 0 for 0.bias"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, GroupsThatDiffer,
                         ::testing::Combine(::testing::Values(Mode::Ddp, Mode::Zero, Mode::Fsdp),
                                            ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return name(std::get<0>(info.param)) +
                                  std::to_string(std::get<1>(info.param));
                         });

// A checkpoint of another optimizer class (SGD with momentum) loaded into
// an AdamW that has not stepped: the names it shares with AdamW's options
// (lr, weight_decay) would be taken, meaning other things, and no state;
// so the load is a ConfigError on every rank naming an option AdamW has
// not, and nothing changes. DDP, ZeRO and FSDP at worlds 1 and 3.
using torch::optim::SGDOptions;

void save_sgd(const fs::path& dir) {
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto seq = make_seq(1);
    torch::optim::SGD opt(seq->parameters(), SGDOptions(0.5).momentum(0.9).weight_decay(0.25));
    opt.zero_grad();
    seq->forward(batch(100, 12)).pow(2).mean().backward();
    opt.step();
    dcp::save(dcp::get_state_dict(seq, opt), dir, *comm);
  });
}

class AnotherOptimizerClass : public ::testing::TestWithParam<std::tuple<Mode, int>> {};

TEST_P(AnotherOptimizerClass, SgdIntoAdamWIsAConfigErrorOnEveryRank) {
  const auto [mode, world] = GetParam();
  const auto dir = temp_dir("another_class_" + name(mode) + std::to_string(world));
  save_sgd(dir);
  const auto errors =
      errors_on_every_rank(world, [&, mode = mode](std::shared_ptr<Communicator> comm) {
        Job job(mode, comm, 2, kAdamW, kAdamW);
        const auto before = job.parameters_and_state();
        auto sd = job.state();
        try {
          dcp::load(sd, dir, *comm);
        } catch (const ConfigError&) {
          for (auto& g : job.groups())
            expect_options(g.options(), kAdamW, "after the refused load");
          EXPECT_TRUE(job.parameters_and_state() == before) << "changed by the refused load";
          throw;
        } catch (const std::exception& e) {
          throw std::runtime_error(std::string("not a ConfigError: ") + e.what());
        }
        throw std::runtime_error("loaded without an error: lr " +
                                 std::to_string(job.groups()[0].options().get_lr()));
      });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("option dampening of 0.weight"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, AnotherOptimizerClass,
                         ::testing::Combine(::testing::Values(Mode::Ddp, Mode::Zero, Mode::Fsdp),
                                            ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return name(std::get<0>(info.param)) +
                                  std::to_string(std::get<1>(info.param));
                         });

// The other way: an AdamW checkpoint into an SGD that has not stepped
// (each rank holds the whole module, as DDP), worlds 1 and 3.
class AdamWIntoSgd : public ::testing::TestWithParam<int> {};

TEST_P(AdamWIntoSgd, IsAConfigErrorOnEveryRank) {
  const int world = GetParam();
  const auto dir = temp_dir("adamw_into_sgd" + std::to_string(world));
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    Job job(Mode::Ddp, comm, 1, kAdamW, kAdamW);
    job.train(1);
    dcp::save(job.state(), dir, *comm);
  });
  const auto errors = errors_on_every_rank(world, [&](std::shared_ptr<Communicator> comm) {
    auto seq = make_seq(2);
    torch::optim::SGD opt(seq->parameters(), SGDOptions(0.5).momentum(0.9));
    auto sd = dcp::get_state_dict(seq, opt);
    try {
      dcp::load(sd, dir, *comm);
    } catch (const ConfigError&) {
      EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.5) << "after the refused load";
      throw;
    }
    throw std::runtime_error("loaded without an error: lr " +
                             std::to_string(opt.param_groups()[0].options().get_lr()));
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("option amsgrad of 0.weight"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, AdamWIntoSgd, ::testing::Values(1, 3));

}  // namespace
}  // namespace cohort::testing::dcp_test::param_groups_test
