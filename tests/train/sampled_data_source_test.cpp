// SampledDataSource through the Trainer (ranks as threads, worlds 1 to 3):
// sample i's feature is i, so the loss function sees which samples each
// rank trains on. Every epoch each sample is trained on exactly once across
// the ranks when the dataset divides evenly, the epochs' orders differ, and
// with a remainder the sampler pads (repeats from the order's start) or,
// with drop_last, cuts, as PyTorch's DistributedSampler does (its dealing is
// compared with PyTorch's in tests/data/sampler_test.cpp).
#include "cohort/train/sampled_data_source.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::sampled_data_source_test {
namespace {

constexpr int64_t kEpochs = 2;

// Each epoch's samples as the loss function saw them on every rank, rank
// by rank: seen[epoch][rank].
using Seen = std::vector<std::vector<std::vector<int64_t>>>;

Seen train(int world, int64_t n, int64_t micro, bool drop_last) {
  Seen seen(kEpochs, std::vector<std::vector<int64_t>>(static_cast<size_t>(world)));
  std::mutex mu;
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const auto x = torch::arange(n, torch::kFloat32).unsqueeze(1);
    data::DistributedSamplerOptions deal;
    deal.seed = 5;
    deal.drop_last = drop_last;
    SampledDataSource source(x, torch::zeros({n, 1}), micro,
                             data::DistributedSampler(static_cast<size_t>(n), *comm, deal));
    // Ranks as threads draw their weights from one generator: make them
    // equal, as the all-reduce wiring requires.
    auto model = std::make_shared<torch::nn::LinearImpl>(1, 1);
    testing::fill_alike(*model);
    torch::optim::SGD opt(model->parameters(), 0.01);
    TrainerOptions config;
    config.epochs = kEpochs;
    config.progress = false;
    int64_t batches = 0;
    const int64_t per_epoch = source.num_batches();
    Trainer trainer(
        TrainerWiring::all_reduce(model, opt, comm),
        [&](const torch::data::Example<>& b) {
          const auto epoch = static_cast<size_t>(batches++ / per_epoch);
          std::lock_guard<std::mutex> lock(mu);
          auto& mine = seen[epoch][static_cast<size_t>(comm->rank())];
          for (int64_t i = 0; i < b.data.size(0); ++i) {
            mine.push_back(static_cast<int64_t>(b.data[i][0].item<float>()));
          }
          return torch::mse_loss(model->forward(b.data), b.target);
        },
        config);
    trainer.fit(source);
  });
  return seen;
}

std::vector<int64_t> all_of(const std::vector<std::vector<int64_t>>& ranks) {
  std::vector<int64_t> out;
  for (const auto& r : ranks) out.insert(out.end(), r.begin(), r.end());
  return out;
}

TEST(SampledDataSource, EverySampleOncePerEpochAndTheEpochsDiffer) {
  for (int world : {1, 2, 3}) {
    const int64_t n = 24;  // divides by world x micro-batch
    const auto seen = train(world, n, 2, false);
    for (int64_t e = 0; e < kEpochs; ++e) {
      auto got = all_of(seen[static_cast<size_t>(e)]);
      std::sort(got.begin(), got.end());
      std::vector<int64_t> want(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] = i;
      EXPECT_EQ(got, want) << "world " << world << " epoch " << e;
    }
    EXPECT_NE(all_of(seen[0]), all_of(seen[1])) << "world " << world << ": epochs alike";
  }
}

// 25 samples over 2 ranks, micro-batches of 1: padded to 26 (one sample
// twice), or cut to 24 distinct ones with drop_last.
TEST(SampledDataSource, ARemainderIsPaddedOrDropped) {
  for (bool drop_last : {false, true}) {
    const auto seen = train(2, 25, 1, drop_last);
    for (int64_t e = 0; e < kEpochs; ++e) {
      const auto got = all_of(seen[static_cast<size_t>(e)]);
      std::vector<int64_t> distinct = got;
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      EXPECT_EQ(seen[static_cast<size_t>(e)][0].size(), seen[static_cast<size_t>(e)][1].size());
      EXPECT_EQ(got.size(), drop_last ? 24u : 26u) << "epoch " << e;
      EXPECT_EQ(distinct.size(), drop_last ? 24u : 25u) << "epoch " << e;
    }
  }
}

TEST(SampledDataSource, ASamplerOfAnotherSizeIsRefused) {
  data::DistributedSamplerOptions deal;
  deal.num_replicas = 1;
  deal.rank = 0;
  for (size_t size : {3u, 8u}) {
    try {
      SampledDataSource(torch::zeros({4, 1}), torch::zeros({4, 1}), 1,
                        data::DistributedSampler(size, deal));
      ADD_FAILURE() << "no error for a sampler of " << size;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("deals from " + std::to_string(size) +
                                           " samples but the data has 4"),
                std::string::npos)
          << e.what();
    }
  }
}

// Careless input on one rank: a data source over other data (fewer
// micro-batches an epoch) or another step limit. Every rank must fail at
// once, naming each group of ranks, rather than one leaving the loop early
// and the others waiting in their next step until the timeout.
TEST(TrainerData, RanksThatDisagreeOnTheEpochFailTogether) {
  for (const std::string odd : {"samples", "max_steps"}) {
    const int world = 3;
    std::vector<std::string> errors(world);
    const auto start = std::chrono::steady_clock::now();
    testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      const bool is_odd = comm->rank() == 1;
      const int64_t n = odd == "samples" && is_odd ? 18 : 24;
      TensorDataSource source(torch::zeros({n, 1}), torch::zeros({n, 1}), 2, comm->rank(), world);
      auto model = std::make_shared<torch::nn::LinearImpl>(1, 1);
      testing::fill_alike(*model);
      torch::optim::SGD opt(model->parameters(), 0.01);
      TrainerOptions config;
      config.progress = false;
      config.max_steps = odd == "max_steps" && is_odd ? 2 : 3;
      Trainer trainer(
          TrainerWiring::all_reduce(model, opt, DeviceMesh::from_group(comm, "dp")),
          [&](const torch::data::Example<>& b) {
            return torch::mse_loss(model->forward(b.data), b.target);
          },
          config);
      try {
        trainer.fit(source);
      } catch (const InvalidArgument& e) {
        errors[static_cast<size_t>(comm->rank())] = e.what();
      }
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << odd;
    const std::string groups = odd == "samples"
                                   ? "epoch 0: 3 micro-batches"
                                   : "epoch 0: 4 micro-batches (global 6), accumulation 1, "
                                     "epochs 1, max_steps 2";
    for (int r = 0; r < world; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_NE(e.find("Trainer::fit on rank " + std::to_string(r) +
                       ": ranks disagree on the data source's micro-batches or the training "
                       "length"),
                std::string::npos)
          << odd << ", rank " << r << ": " << e;
      EXPECT_NE(e.find("rank 1: " + groups), std::string::npos) << odd << ": " << e;
      EXPECT_NE(e.find("ranks 0, 2: "), std::string::npos) << odd << ": " << e;
    }
  }
}

}  // namespace
}  // namespace cohort::sampled_data_source_test
