// The learning-rate schedule as PyTorch's LambdaLR applies it: a factor of
// each parameter group's own initial rate. The default schedule keeps the
// optimizer's rate (SGD at 0.1 trains at 0.1); groups with different rates
// keep their ratio under warm-up and cosine decay; a resume continues the
// schedule from the recorded initial rates instead of scaling the last
// scheduled ones again; base_lr over groups of different rates is refused.
// Against one process of plain LibTorch, worlds 1 and 3 (Gloo, UCX).
// Also: train_step refuses micro-batches of unequal sizes (or another count)
// on every rank when one rank passed them, and ranks whose trainers have
// other accumulation_steps, at worlds 1-3 over Gloo and UCX.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <map>
#include <mutex>

#include "cohort/core/error.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::lr_groups_test {
namespace {

using testing::make_data;
using testing::make_mlp;
using testing::TempDir;

constexpr int64_t kMicro = 4, kSteps = 6;
const double kPi = std::acos(-1.0);

// Two groups: the first Linear at `first`, the rest at `second`; listed the
// other way round when `swapped`.
std::vector<torch::optim::OptimizerParamGroup> groups_of(torch::nn::Sequential& net, double first,
                                                         double second, bool swapped = false) {
  auto params = net->parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const int g : swapped ? std::vector<int>{1, 0} : std::vector<int>{0, 1}) {
    groups.emplace_back(std::vector<torch::Tensor>{params[2 * g], params[2 * g + 1]},
                        std::make_unique<torch::optim::SGDOptions>(g == 0 ? first : second));
  }
  return groups;
}

// Closed form of the warm-up cosine factor: 2 warm-up steps, cosine to 0.1
// of the peak at step 5.
double factor(int64_t t) {
  if (t < 2) return (t + 1) / 2.0;
  const double p = std::min(1.0, (t - 2) / 3.0);
  return 0.1 + 0.5 * (1 - 0.1) * (1 + std::cos(kPi * p));
}

LrSchedule warmup_cosine(double first) {
  LrSchedule s;
  s.kind = LrScheduleKind::WarmupCosine;
  s.warmup_steps = 2;
  s.total_steps = 5;
  s.min_lr = 0.1 * first;  // base_lr unset: relative to the first group's 0.1
  return s;
}

using Case = cohort::testing::EngineWorld;

std::vector<Case> cases() { return cohort::testing::engine_worlds({1, 3}); }

// One process: SGD over the two groups, each step's rates from the closed
// form (or the constant rates when `scheduled` is false).
std::vector<torch::Tensor> reference(int world, bool scheduled, double first, double second,
                                     const testing::Synthetic& data) {
  auto net = make_mlp();
  torch::optim::SGD opt(groups_of(net, first, second), torch::optim::SGDOptions(first));
  const int64_t global = world * kMicro;
  for (int64_t t = 0; t < kSteps; ++t) {
    const double f = scheduled ? factor(t) : 1.0;
    opt.param_groups()[0].options().set_lr(first * f);
    opt.param_groups()[1].options().set_lr(second * f);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(data.x.narrow(0, t * global, global)),
                                         data.y.narrow(0, t * global, global))
        .backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

struct Job {
  int64_t steps;           // steps this job runs (from its position)
  bool resume = false;     // from `dir`
  double opt_first = 0.1;  // the first group's rate the optimizer is built with
  bool swapped = false;    // the groups listed second first
};

// Trains on `world` ranks from the position (after a resume when asked),
// `run.steps` steps; returns rank 0's parameters and each step's lr metric.
std::pair<std::vector<torch::Tensor>, std::vector<double>> train(
    const Case& c, const testing::Synthetic& data, const LrSchedule& schedule, double second,
    const std::string& dir, const Job& run) {
  std::vector<torch::Tensor> params;
  std::vector<double> lrs;
  std::mutex mu;
  testing::ThreadRanksOptions options;
  options.backend = c.backend;
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto net = make_mlp();
        torch::optim::SGD opt(groups_of(net, run.opt_first, second, run.swapped),
                              torch::optim::SGDOptions(run.opt_first));
        TrainerOptions config;
        config.schedule = schedule;
        config.progress = false;
        config.checkpoint_dir = dir;
        Trainer trainer(
            TrainerWiring::all_reduce(net.ptr(), opt, comm),
            [&](const torch::data::Example<>& b) {
              return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
            },
            config);
        if (run.resume) trainer.resume();
        const int64_t global = c.world * kMicro;
        std::vector<double> mine;
        for (int64_t i = 0; i < run.steps; ++i) {
          const int64_t t = trainer.position().step;
          const int64_t start = t * global + comm->rank() * kMicro;
          mine.push_back(
              trainer
                  .train_step({{data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)}})
                  .lr);
        }
        if (!dir.empty()) trainer.save_checkpoint();
        if (comm->rank() != 0) return;
        std::lock_guard<std::mutex> lock(mu);
        for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
        lrs = mine;
      },
      options);
  return {params, lrs};
}

void expect_params(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-5, 1e-6))
        << "parameter " << i << " differs by " << (got[i] - want[i]).abs().max().item<float>();
  }
}

class LrGroups : public ::testing::TestWithParam<Case> {};

// No schedule set: each group trains at the rate its optimizer was given.
TEST_P(LrGroups, DefaultScheduleKeepsTheOptimizersRates) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * c.world * kMicro);
  const auto ref = reference(c.world, false, 0.1, 0.02, data);
  const auto [params, lrs] = train(c, data, LrSchedule{}, 0.02, "", {kSteps});
  expect_params(params, ref);
  for (double lr : lrs) EXPECT_EQ(lr, 0.1);
}

// Warm-up then cosine: each group at its own rate times the schedule's factor.
TEST_P(LrGroups, WarmupCosineScalesEachGroupsOwnRate) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * c.world * kMicro);
  const auto ref = reference(c.world, true, 0.1, 0.02, data);
  const auto [params, lrs] = train(c, data, warmup_cosine(0.1), 0.02, "", {kSteps});
  expect_params(params, ref);
  for (int64_t t = 0; t < kSteps; ++t) EXPECT_NEAR(lrs[t], 0.1 * factor(t), 1e-12) << "step " << t;
}

// Resumed after 3 steps (the optimizer's groups then hold the scheduled
// rates of step 2), with an optimizer built at another rate: the schedule
// goes on from the checkpoint's initial rates, as the uninterrupted run.
TEST_P(LrGroups, ResumeContinuesFromTheInitialRates) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * c.world * kMicro);
  const auto ref = reference(c.world, true, 0.1, 0.02, data);
  TempDir dir("cohort-lr-groups");
  train(c, data, warmup_cosine(0.1), 0.02, dir.str(), {3});
  Job rest{kSteps - 3, true, 0.5};
  const auto [params, lrs] = train(c, data, warmup_cosine(0.1), 0.02, dir.str(), rest);
  expect_params(params, ref);
  for (int64_t i = 0; i < kSteps - 3; ++i) {
    EXPECT_NEAR(lrs[i], 0.1 * factor(3 + i), 1e-12) << "step " << 3 + i;
  }
}

// Resumed after 3 steps with the same groups listed the other way round,
// each built at the other's rate: each group takes the initial rate the
// checkpoint recorded for its parameters, not the one of its index, and
// the run ends where the uninterrupted one does.
TEST_P(LrGroups, ResumeMatchesGroupsByTheirParameters) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * c.world * kMicro);
  const auto ref = reference(c.world, false, 0.1, 0.02, data);
  TempDir dir("cohort-lr-groups");
  train(c, data, LrSchedule{}, 0.02, dir.str(), {3});
  Job rest{kSteps - 3, true, 0.02};
  rest.swapped = true;  // [second layer at 0.1, first layer at 0.02]
  const auto [params, lrs] = train(c, data, LrSchedule{}, 0.1, dir.str(), rest);
  expect_params(params, ref);
  // Group 0 is now the second layer's, at its own 0.02.
  for (double lr : lrs) EXPECT_EQ(lr, 0.02);
}

// A checkpoint of two groups at different rates resumed into one group over
// all the parameters: no rate is that group's. ConfigError on every rank,
// naming the parameters and their rates, with nothing loaded.
TEST_P(LrGroups, ResumeRefusesAGroupOfParametersRecordedAtDifferentRates) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * c.world * kMicro);
  TempDir dir("cohort-lr-groups");
  train(c, data, LrSchedule{}, 0.02, dir.str(), {1});
  std::mutex mu;
  std::map<int, std::string> errors;
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto net = make_mlp(99);
        const auto before = net->parameters()[0].clone();
        torch::optim::SGD opt(net->parameters(), 0.1);
        TrainerOptions config;
        config.progress = false;
        config.checkpoint_dir = dir.str();
        Trainer trainer(
            TrainerWiring::all_reduce(net.ptr(), opt, comm),
            [&](const torch::data::Example<>& b) {
              return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
            },
            config);
        try {
          trainer.resume();
        } catch (const ConfigError& e) {
          std::lock_guard<std::mutex> lock(mu);
          errors[comm->rank()] = e.what();
        }
        EXPECT_TRUE(torch::equal(net->parameters()[0], before)) << "rank " << comm->rank();
      },
      testing::options_for(c));
  ASSERT_EQ(errors.size(), static_cast<size_t>(c.world));
  for (const auto& [rank, m] : errors) {
    EXPECT_NE(m.find("optimizer parameter group 0 (0.bias, 0.weight, 2.bias, ... (4 parameters)) "
                     "holds parameters whose groups had different initial rates in the "
                     "checkpoint (2.bias, 2.weight at 0.02; 0.bias, 0.weight at 0.1)"),
              std::string::npos)
        << "rank " << rank << ": " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, LrGroups, ::testing::ValuesIn(cases()),
                         testing::engine_world_name);

TEST(LrGroupsRefused, BaseLrOverGroupsOfDifferentRates) {
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto net = make_mlp();
    torch::optim::SGD opt(groups_of(net, 0.1, 0.02), torch::optim::SGDOptions(0.1));
    TrainerOptions config;
    config.schedule.base_lr = 0.05;
    try {
      Trainer trainer(
          TrainerWiring::all_reduce(net.ptr(), opt, comm),
          [](const torch::data::Example<>&) { return torch::Tensor(); }, config);
      ADD_FAILURE() << "base_lr over groups of different rates was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("group 0 has lr 0.100000 and group 1 has 0.020000"),
                std::string::npos)
          << e.what();
    }
  });
}

// ReplicaLayout weights micro-batches alike, a pipeline by samples: unequal
// sizes are refused before anything runs, and on every rank when only the
// last rank's batch split unequally (or it passed another count, or empty
// micro-batches, whose mean loss is NaN): each rank gets an InvalidArgument
// naming that rank, well before the operation's timeout, with its
// parameters untouched. Then the ranks still step together.
class TrainStepRefused : public ::testing::TestWithParam<testing::EngineWorld> {};

struct OddBatches {
  const char* name;
  std::vector<int64_t> sizes;  // the last rank's micro-batch sizes
  std::string named;           // what every rank's error says of the last rank
};

TEST_P(TrainStepRefused, OneRanksUnequalMicroBatchesOnEveryRank) {
  using Clock = std::chrono::steady_clock;
  const auto& c = GetParam();
  const int last = c.world - 1;
  const std::vector<OddBatches> cases = {
      {"unequal",
       {4, 2},
       "'s micro-batches have unequal sizes (micro-batch 1 has 2 samples, "
       "micro-batch 0 has 4)"},
      {"count", {4, 4, 4}, " got 3 micro-batches, accumulation_steps is 2"},
      {"empty", {0, 0}, " passed micro-batches of 0 samples"},
  };
  const auto data = make_data(16);
  auto o = testing::options_for(c);
  o.timeout = std::chrono::seconds(30);  // far above the bound below
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto net = make_mlp();
        // DDP: a rank that refused alone would leave its peers in the
        // backward's all-reduces.
        DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
        torch::optim::SGD opt(net->parameters(), 0.1);
        TrainerOptions config;
        config.accumulation_steps = 2;
        config.progress = false;
        Trainer trainer(
            TrainerWiring::ddp(ddp, opt),
            [&](const torch::data::Example<>& b) {
              return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
            },
            config);
        auto batches = [&](const std::vector<int64_t>& sizes) {
          std::vector<torch::data::Example<>> out;
          int64_t at = 0;
          for (int64_t n : sizes) {
            out.push_back({data.x.narrow(0, at, n), data.y.narrow(0, at, n)});
            at += n;
          }
          return out;
        };
        for (const auto& odd : cases) {
          const auto before = net->parameters()[0].clone();
          const auto start = Clock::now();
          try {
            trainer.train_step(
                batches(comm->rank() == last ? odd.sizes : std::vector<int64_t>{4, 4}));
            ADD_FAILURE() << odd.name << ": rank " << comm->rank() << " stepped";
          } catch (const InvalidArgument& e) {
            const std::string m = e.what();
            EXPECT_NE(m.find("rank " + std::to_string(last) + odd.named), std::string::npos) << m;
            EXPECT_NE(m.find("on rank " + std::to_string(comm->rank()) + " of "), std::string::npos)
                << m;
          }
          EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0)
              << odd.name << ": rank " << comm->rank() << " waited for its peers' timeout";
          EXPECT_TRUE(torch::equal(net->parameters()[0], before)) << odd.name;
        }
        // Nothing was left half done: every rank steps together after.
        EXPECT_NO_THROW(trainer.train_step(batches({4, 4})));
      },
      o);
}

// The last rank's trainer accumulates 3 micro-batches, the others' 2, and
// each rank passes as many: each rank's count fits its own setting, but the
// ranks would weight their micro-batches differently (1/3 against 1/2)
// while DDP averages their gradients as equals. Every rank gets an
// InvalidArgument naming each group of ranks with its accumulation_steps,
// with its parameters untouched.
TEST_P(TrainStepRefused, RanksWithOtherAccumulationStepsOnEveryRank) {
  const auto& c = GetParam();
  if (c.world == 1) GTEST_SKIP() << "needs other ranks";
  const int last = c.world - 1;
  const auto data = make_data(16);
  auto o = testing::options_for(c);
  o.timeout = std::chrono::seconds(30);
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto net = make_mlp();
        DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
        torch::optim::SGD opt(net->parameters(), 0.1);
        TrainerOptions config;
        config.accumulation_steps = comm->rank() == last ? 3 : 2;
        config.progress = false;
        Trainer trainer(
            TrainerWiring::ddp(ddp, opt),
            [&](const torch::data::Example<>& b) {
              return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
            },
            config);
        std::vector<torch::data::Example<>> batches;
        for (int64_t k = 0; k < config.accumulation_steps; ++k)
          batches.push_back({data.x.narrow(0, 4 * k, 4), data.y.narrow(0, 4 * k, 4)});
        const auto before = net->parameters()[0].clone();
        try {
          trainer.train_step(batches);
          ADD_FAILURE() << "rank " << comm->rank() << " stepped";
        } catch (const InvalidArgument& e) {
          const std::string m = e.what();
          const std::string others = c.world == 2 ? "rank 0: 2" : "ranks 0, 1: 2";
          const std::string groups = others + "; rank " + std::to_string(last) + ": 3";
          EXPECT_NE(m.find("accumulation_steps (" + groups + ")"), std::string::npos) << m;
          EXPECT_NE(m.find("on rank " + std::to_string(comm->rank()) + " of "), std::string::npos)
              << m;
        }
        EXPECT_TRUE(torch::equal(net->parameters()[0], before));
      },
      o);
}

INSTANTIATE_TEST_SUITE_P(EngineWorlds, TrainStepRefused,
                         ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

}  // namespace
}  // namespace cohort::lr_groups_test
