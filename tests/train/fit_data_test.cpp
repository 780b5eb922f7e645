// What fit() takes from its DataSource, per epoch and per rank: epochs of
// different lengths each train to their end (2 micro-batches, then 4: 6
// steps, equal to one process's SGD over the same global batches), with
// and without a step limit; and sources that deal the ranks' shares of the
// data wrongly (every rank made with rank 0, or with a world of its own)
// are refused at the epoch's start on every rank, naming the shares,
// before any step; replicas that start apart are refused when the wiring is
// made. Worlds 1 to 3 over Gloo and UCX, ranks as threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/core/error.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::fit_data_test {
namespace {

using testing::make_data;
using testing::make_mlp;

constexpr int64_t kMicro = 4;

// Epoch 0 has 2 micro-batches a rank, epoch 1 has 4. Global micro-batch j
// of the run (j = 0, 1 in epoch 0, then 2..5) is samples [j g, (j + 1) g)
// with g = kMicro x world; rank r's part of it is its r-th kMicro.
class GrowingSource : public DataSource {
 public:
  GrowingSource(testing::Synthetic data, int rank, int world)
      : data_(std::move(data)), rank_(rank), world_(world) {}
  void set_epoch(int64_t epoch) override { epoch_ = epoch; }
  int64_t num_batches() const override { return epoch_ == 0 ? 2 : 4; }
  torch::data::Example<> batch(int64_t index) override {
    const int64_t j = (epoch_ == 0 ? 0 : 2) + index;
    const int64_t start = (j * world_ + rank_) * kMicro;
    return {data_.x.narrow(0, start, kMicro), data_.y.narrow(0, start, kMicro)};
  }

 private:
  testing::Synthetic data_;
  int rank_, world_;
  int64_t epoch_ = 0;
};

// One process: SGD at 0.1 over the first `steps` global batches.
std::vector<torch::Tensor> reference(int world, int64_t steps, const testing::Synthetic& data) {
  auto net = make_mlp();
  torch::optim::SGD opt(net->parameters(), 0.1);
  const int64_t g = kMicro * world;
  for (int64_t t = 0; t < steps; ++t) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(data.x.narrow(0, t * g, g)),
                                         data.y.narrow(0, t * g, g))
        .backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

class FitData : public ::testing::TestWithParam<testing::EngineWorld> {};

// Two epochs, the second twice as long as the first: every step of both,
// with no step limit (6 steps) and with one beyond them (6 as well), or up
// to a limit inside the second epoch (5).
TEST_P(FitData, EpochsOfDifferentLengthsEachTrainToTheirEnd) {
  const auto& c = GetParam();
  const auto data = make_data(6 * kMicro * c.world);
  for (const int64_t max_steps : {0, 10, 5}) {
    const int64_t want = max_steps == 5 ? 5 : 6;
    const auto ref = reference(c.world, want, data);
    std::mutex mu;
    std::map<int, int64_t> steps;
    std::vector<torch::Tensor> params;
    testing::run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          auto net = make_mlp();
          torch::optim::SGD opt(net->parameters(), 0.1);
          TrainerOptions config;
          config.epochs = 2;
          config.max_steps = max_steps;
          config.progress = false;
          Trainer trainer(
              TrainerWiring::all_reduce(net.ptr(), opt, comm),
              [&](const torch::data::Example<>& b) {
                return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
              },
              config);
          GrowingSource source(data, comm->rank(), comm->size());
          const auto done = trainer.fit(source);
          std::lock_guard<std::mutex> lock(mu);
          steps[comm->rank()] = static_cast<int64_t>(done.size());
          if (comm->rank() == 0) {
            for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
          }
        },
        testing::options_for(c));
    for (const auto& [rank, n] : steps) {
      EXPECT_EQ(n, want) << "max_steps " << max_steps << ", rank " << rank;
    }
    ASSERT_EQ(params.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_TRUE(torch::allclose(params[i], ref[i], 1e-5, 1e-6))
          << "max_steps " << max_steps << ", parameter " << i << " differs by "
          << (params[i] - ref[i]).abs().max().item<float>();
    }
  }
}

struct BadShares {
  const char* name;
  int rank;           // the share each rank's source is made with (-1: the rank's own)
  int world;          // the shares it is made with (-1: the world size)
  std::string named;  // what every rank's error names (at world 3)
};

// TensorDataSource made with rank 0 on every rank, or as the one share of
// a world of one on every rank: each replica would train on the same
// samples. Every rank
// gets an InvalidArgument naming the shares, with its parameters untouched.
TEST_P(FitData, SourcesDealingTheSameShareAreRefusedOnEveryRank) {
  const auto& c = GetParam();
  if (c.world == 1) GTEST_SKIP() << "one rank deals every share";
  const auto data = make_data(8 * kMicro * c.world);
  const std::vector<BadShares> cases = {
      {"all rank 0", 0, -1, "ranks 0, 1, 2: share 0 of 3"},
      {"world of one", 0, 1, "ranks 0, 1, 2: share 0 of 1"},
  };
  for (const auto& bad : cases) {
    std::mutex mu;
    std::map<int, std::string> errors;
    testing::run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          auto net = make_mlp();
          const auto before = net->parameters()[0].clone();
          torch::optim::SGD opt(net->parameters(), 0.1);
          TrainerOptions config;
          config.progress = false;
          Trainer trainer(
              TrainerWiring::all_reduce(net.ptr(), opt, comm),
              [&](const torch::data::Example<>& b) {
                return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
              },
              config);
          TensorDataSource source(data.x, data.y, kMicro, bad.rank < 0 ? comm->rank() : bad.rank,
                                  bad.world < 0 ? comm->size() : bad.world);
          try {
            trainer.fit(source);
          } catch (const InvalidArgument& e) {
            std::lock_guard<std::mutex> lock(mu);
            errors[comm->rank()] = e.what();
          }
          EXPECT_TRUE(torch::equal(net->parameters()[0], before))
              << bad.name << ": rank " << comm->rank() << " stepped";
        },
        testing::options_for(c));
    ASSERT_EQ(errors.size(), static_cast<size_t>(c.world)) << bad.name;
    for (const auto& [rank, m] : errors) {
      EXPECT_NE(m.find("Trainer::fit on rank " + std::to_string(rank) + ": the data sources deal "),
                std::string::npos)
          << m;
      if (c.world == 3) {
        EXPECT_NE(m.find(bad.named), std::string::npos) << m;
      }
      EXPECT_NE(m.find("replicas would train on the same samples"), std::string::npos) << m;
    }
  }
}

// The all-reduce wiring broadcasts nothing: a replica that starts apart
// (here the last rank's first weight, one element off by 0.01, or its
// frozen last bias) would stay apart under the same averaged update. Every
// rank gets a MismatchError naming the parameter's index, before any step.
TEST_P(FitData, AllReduceWiringRefusesReplicasThatDiffer) {
  const auto& c = GetParam();
  for (const bool frozen : {false, true}) {
    std::mutex mu;
    std::map<int, std::string> errors;
    testing::run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          auto net = make_mlp();
          auto params = net->parameters();
          auto& off = frozen ? params.back() : params.front();
          if (frozen) off.set_requires_grad(false);
          if (comm->rank() == comm->size() - 1 && comm->size() > 1) {
            torch::NoGradGuard no_grad;
            off.view({-1})[0].add_(0.01);
          }
          torch::optim::SGD opt(net->parameters(), 0.1);
          try {
            (void)TrainerWiring::all_reduce(net.ptr(), opt, comm);
          } catch (const MismatchError& e) {
            std::lock_guard<std::mutex> lock(mu);
            errors[comm->rank()] = e.what();
          }
        },
        testing::options_for(c));
    if (c.world == 1) {
      EXPECT_TRUE(errors.empty()) << errors.begin()->second;
      continue;
    }
    ASSERT_EQ(errors.size(), static_cast<size_t>(c.world)) << "frozen " << frozen;
    const auto index = std::to_string(frozen ? make_mlp()->parameters().size() - 1 : 0);
    for (const auto& [rank, m] : errors) {
      EXPECT_NE(m.find("AllReduceGradientSync"), std::string::npos) << m;
      EXPECT_NE(m.find("parameter " + index), std::string::npos) << m;
      EXPECT_NE(m.find("silently stay different"), std::string::npos) << m;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, FitData, ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

}  // namespace
}  // namespace cohort::fit_data_test
