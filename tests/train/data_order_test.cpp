// Which samples fit() trains on across a resume, checked against closed
// forms: the loss function records each micro-batch's sample indices (the
// data's last column), and every step must take the indices the sources'
// orders give (DistributedSampler's indices(), TensorDataSource's global
// order at world 1). Resumed in the middle of an epoch, at the same world
// size or 3 -> 2 (either source), every sample of the epoch is trained on once, in the
// uninterrupted run's order; resumed there under other order settings (a
// sampler's seed, shuffle), or with ranks whose sources deal other orders,
// fit() refuses on every rank instead of repeating some samples and
// skipping others. Ranks as threads, Gloo and UCX, worlds 1 to 3.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/train/sampled_data_source.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::data_order_test {
namespace {

using testing::TempDir;
using Indices = std::vector<int64_t>;

// How one rank deals its data.
struct Deal {
  bool sampled = true;  // a SampledDataSource; otherwise a TensorDataSource
  uint64_t seed = 5;    // the sampler's
  bool shuffle = true;
  int64_t samples = 48;
};

struct Job {
  int world = 1;
  int64_t micro = 2;
  int64_t accumulation = 1;
  int64_t epochs = 2;
  int64_t max_steps = 0;
  bool resume = false;
  Deal deal{};
  int odd_rank = -1;  // this rank deals by `odd` instead
  Deal odd{};
};

struct Outcome {
  std::vector<std::string> errors;                // by rank
  std::map<int64_t, int64_t> epoch_of;            // step -> epoch
  std::map<int64_t, std::vector<Indices>> steps;  // step -> each rank's samples, in order
};

// Column 8 is the sample's index; the model reads columns 0..7.
torch::Tensor indexed(int64_t n) {
  return torch::cat({testing::make_data(n).x, torch::arange(n, torch::kFloat32).unsqueeze(1)}, 1);
}

data::DistributedSampler sampler_of(const Deal& d, int world, int rank) {
  data::DistributedSamplerOptions o;
  o.num_replicas = world;
  o.rank = rank;
  o.seed = d.seed;
  o.shuffle = d.shuffle;
  // No communicator: nothing compares the ranks' settings but fit().
  return data::DistributedSampler(static_cast<size_t>(d.samples), o);
}

Outcome run(const std::string& backend, const std::string& dir, const Job& job) {
  Outcome out;
  out.errors.resize(static_cast<size_t>(job.world));
  std::mutex mu;
  testing::ThreadRanksOptions options;
  options.backend = backend;
  testing::run_ranks_shared(
      job.world,
      [&](std::shared_ptr<Communicator> comm) {
        const int rank = comm->rank();
        const Deal& d = rank == job.odd_rank ? job.odd : job.deal;
        const auto x = indexed(d.samples);
        const auto y = testing::make_data(d.samples).y;
        std::unique_ptr<DataSource> source;
        if (d.sampled) {
          source =
              std::make_unique<SampledDataSource>(x, y, job.micro, sampler_of(d, job.world, rank));
        } else {
          source = std::make_unique<TensorDataSource>(x, y, job.micro, rank, job.world, d.shuffle);
        }
        auto net = testing::make_mlp();
        torch::optim::SGD opt(net->parameters(), 0.1);
        TrainerOptions config;
        config.accumulation_steps = job.accumulation;
        config.epochs = job.epochs;
        config.max_steps = job.max_steps;
        config.checkpoint_dir = dir;
        config.progress = false;
        Indices pending;  // this step's micro-batches so far
        Trainer trainer(
            TrainerWiring::all_reduce(net.ptr(), opt, comm),
            [&](const torch::data::Example<>& b) {
              const auto idx = b.data.select(1, 8).to(torch::kInt64).contiguous();
              pending.insert(pending.end(), idx.data_ptr<int64_t>(),
                             idx.data_ptr<int64_t>() + idx.numel());
              return torch::nn::functional::cross_entropy(net->forward(b.data.narrow(1, 0, 8)),
                                                          b.target);
            },
            config);
        FitCallbacks callbacks;
        callbacks.on_step = [&](const StepMetrics& m) {
          std::lock_guard<std::mutex> lock(mu);
          auto& step = out.steps[m.step];
          step.resize(static_cast<size_t>(job.world));
          step[static_cast<size_t>(rank)] = pending;
          out.epoch_of[m.step] = m.epoch;
          pending.clear();
        };
        std::string error;
        try {
          if (job.resume) trainer.resume();
          trainer.fit(*source, callbacks);
        } catch (const Error& e) {
          error = e.what();
        }
        std::lock_guard<std::mutex> lock(mu);
        out.errors[static_cast<size_t>(rank)] = error;
      },
      options);
  return out;
}

// The steps of `b` after those of `a` (a resumed run after its first part).
Outcome joined(Outcome a, const Outcome& b) {
  for (const auto& [step, samples] : b.steps) a.steps[step] = samples;
  for (const auto& [step, epoch] : b.epoch_of) a.epoch_of[step] = epoch;
  return a;
}

// How many of `epoch`'s samples were trained on more than once, and how
// many of the dataset's never.
std::string coverage(const Outcome& o, int64_t epoch, int64_t samples) {
  std::map<int64_t, int> count;
  for (const auto& [step, ranks] : o.steps) {
    if (o.epoch_of.at(step) != epoch) continue;
    for (const auto& r : ranks) {
      for (const int64_t i : r) ++count[i];
    }
  }
  int64_t repeated = 0;
  for (const auto& [i, c] : count) repeated += c > 1;
  return "epoch " + std::to_string(epoch) + ": " + std::to_string(repeated) +
         " samples trained on more than once, " +
         std::to_string(samples - static_cast<int64_t>(count.size())) + " of " +
         std::to_string(samples) + " never";
}

// Every step of `o` as the closed form deals it: step s (1-based) of a
// job of `world` ranks, `steps_per_epoch` steps an epoch, k micro-batches
// of `micro` a step. A sampled source: rank r's micro-batches of the
// sampler's indices for the epoch, in order. A global order: the step's
// samples of all ranks together are the epoch's order P[j G, (j + 1) G),
// j the step within the epoch, G the global batch.
void expect_closed_form(const Outcome& o, const Deal& d, int64_t first_step, int world,
                        int64_t micro, int64_t k, const std::string& what) {
  const int64_t per_step = micro * k;
  int64_t steps_per_epoch = 0;
  if (d.sampled) {
    steps_per_epoch = static_cast<int64_t>(sampler_of(d, world, 0).num_samples()) / per_step;
  } else {
    steps_per_epoch = d.samples / (per_step * world);
  }
  for (const auto& [step, ranks] : o.steps) {
    if (step < first_step) continue;
    const int64_t epoch = (step - 1) / steps_per_epoch, j = (step - 1) % steps_per_epoch;
    ASSERT_EQ(o.epoch_of.at(step), epoch) << what << ", step " << step;
    const std::string at = what + ", step " + std::to_string(step);
    if (d.sampled) {
      ASSERT_EQ(static_cast<int>(ranks.size()), world) << at;
      for (int r = 0; r < world; ++r) {
        auto sampler = sampler_of(d, world, r);
        sampler.set_epoch(epoch);
        const auto all = sampler.indices();
        const Indices want(all.begin() + j * per_step, all.begin() + (j + 1) * per_step);
        EXPECT_EQ(ranks[static_cast<size_t>(r)], want) << at << ", rank " << r;
      }
    } else {
      const auto ids = torch::arange(d.samples, torch::kInt64);
      TensorDataSource order(ids, ids, per_step * world, 0, 1, d.shuffle);
      order.set_epoch(epoch);
      const auto p = order.sample_indices(j);
      std::multiset<int64_t> want(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel()), got;
      for (const auto& r : ranks) got.insert(r.begin(), r.end());
      EXPECT_EQ(got, want) << at;
    }
  }
}

// What coverage() says of an epoch that trained every sample once.
std::string once(int64_t epoch, int64_t samples) {
  return "epoch " + std::to_string(epoch) + ": 0 samples trained on more than once, 0 of " +
         std::to_string(samples) + " never";
}

using Case = testing::EngineWorld;

class DataOrder : public ::testing::TestWithParam<Case> {};

// 48 samples, 4 a rank's step (micro-batches of 2, accumulation 2), stopped
// a step into epoch 1 and resumed: every step is the closed form's, so each epoch trains every
// sample once, in the uninterrupted run's order.
TEST_P(DataOrder, ResumedMidEpochEverySampleOnceInTheUninterruptedOrder) {
  const Case c = GetParam();
  for (const bool sampled : {true, false}) {
    const std::string what = sampled ? "sampled" : "global order";
    Job job{c.world};
    job.accumulation = 2;
    job.deal.sampled = sampled;
    const int64_t per_epoch = 48 / (4 * c.world);
    TempDir dir("cohort-data-order");
    Job first = job;
    first.max_steps = per_epoch + 1;
    const auto a = run(c.backend, dir.str(), first);
    ASSERT_EQ(a.errors, std::vector<std::string>(static_cast<size_t>(c.world))) << what;
    Job second = job;
    second.resume = true;
    const auto b = run(c.backend, dir.str(), second);
    ASSERT_EQ(b.errors, std::vector<std::string>(static_cast<size_t>(c.world))) << what;
    ASSERT_FALSE(b.steps.empty()) << what;
    EXPECT_EQ(b.steps.begin()->first, per_epoch + 2) << what;
    const auto all = joined(a, b);
    ASSERT_EQ(static_cast<int64_t>(all.steps.size()), 2 * per_epoch) << what;
    expect_closed_form(all, job.deal, 1, c.world, 2, 2, what);
    for (int64_t e = 0; e < 2; ++e) {
      EXPECT_EQ(coverage(all, e, 48), once(e, 48)) << what;
    }
  }
}

// Stopped a step into epoch 1 and resumed with another order: a sampler of
// another seed, without shuffle or over one sample more, or a global order
// without shuffle. The checkpoint's position counts micro-batches of the
// order it was written under, so every rank refuses the resume, naming
// both settings, and trains nothing.
TEST_P(DataOrder, ResumedMidEpochUnderAnotherOrderIsRefusedOnEveryRank) {
  const Case c = GetParam();
  struct Change {
    std::string what;
    Deal deal;  // the resumed job's
    std::string before, after;
  };
  const std::vector<Change> changes = {
      {"seed", {true, 6, true, 48}, "seed 5", "seed 6"},
      {"sampler shuffle", {true, 5, false, 48}, "shuffle true", "shuffle false"},
      // As many micro-batches an epoch at every world size here.
      {"sampler dataset", {true, 5, true, 49}, "48 samples", "49 samples"},
      {"global order shuffle", {false, 5, false, 48}, "shuffle true", "shuffle false"}};
  for (const auto& change : changes) {
    Job job{c.world};
    job.deal.sampled = change.deal.sampled;
    const int64_t per_epoch = 48 / (2 * c.world);
    TempDir dir("cohort-data-order");
    Job first = job;
    first.max_steps = per_epoch + 1;
    const auto a = run(c.backend, dir.str(), first);
    ASSERT_EQ(a.errors, std::vector<std::string>(static_cast<size_t>(c.world))) << change.what;
    Job second = job;
    second.resume = true;
    second.deal = change.deal;
    const auto b = run(c.backend, dir.str(), second);
    // What the steps would have trained: the epoch's samples counted over
    // both parts.
    const std::string trained = coverage(joined(a, b), 1, change.deal.samples);
    EXPECT_TRUE(b.steps.empty()) << change.what << ": trained on; " << trained;
    for (int r = 0; r < c.world; ++r) {
      const auto& e = b.errors[static_cast<size_t>(r)];
      EXPECT_NE(e.find("Trainer::fit on rank " + std::to_string(r) +
                       ": resumed in the middle of epoch 1"),
                std::string::npos)
          << change.what << ": " << e << " (" << trained << ")";
      EXPECT_NE(e.find(change.before), std::string::npos) << change.what << ": " << e;
      EXPECT_NE(e.find(change.after), std::string::npos) << change.what << ": " << e;
    }
  }
}

// A checkpoint at an epoch's start holds no position in an order: resumed
// with another seed, the next epoch is the new seed's, whole.
TEST_P(DataOrder, AnotherSeedAtAnEpochsStartDealsThatSeedsOrder) {
  const Case c = GetParam();
  const int64_t per_epoch = 48 / (2 * c.world);
  TempDir dir("cohort-data-order");
  Job first{c.world};
  first.max_steps = per_epoch;
  const auto a = run(c.backend, dir.str(), first);
  ASSERT_EQ(a.errors, std::vector<std::string>(static_cast<size_t>(c.world)));
  Job second{c.world};
  second.resume = true;
  second.deal.seed = 6;
  const auto b = run(c.backend, dir.str(), second);
  ASSERT_EQ(b.errors, std::vector<std::string>(static_cast<size_t>(c.world)));
  ASSERT_EQ(static_cast<int64_t>(b.steps.size()), per_epoch);
  expect_closed_form(b, second.deal, per_epoch + 1, c.world, 2, 1, "seed 6");
  EXPECT_EQ(coverage(b, 1, 48), once(1, 48));
}

// One rank's source deals another order than its peers': another seed or
// dataset size (with as many micro-batches an epoch), or no shuffle. Every
// rank refuses at the epoch's start, naming the ranks, instead of the
// replicas training on some samples twice and others never.
TEST_P(DataOrder, RanksThatDealOtherOrdersFailTogether) {
  const Case c = GetParam();
  if (c.world == 1) GTEST_SKIP() << "one rank cannot disagree";
  struct Odd {
    std::string what;
    Deal deal;
    std::string named;  // in every rank's message
  };
  const std::vector<Odd> odds = {{"seed", {true, 6, true, 48}, "seed 6"},
                                 {"sampler size", {true, 5, true, 49}, "49 samples"},
                                 {"shuffle", {false, 5, false, 48}, "shuffle false"},
                                 {"global order size", {false, 5, true, 49}, "49 samples"}};
  for (const auto& odd : odds) {
    Job job{c.world};
    job.epochs = 1;
    job.deal.sampled = odd.deal.sampled;
    job.odd_rank = 1;
    job.odd = odd.deal;
    TempDir dir("cohort-data-order");
    const auto o = run(c.backend, dir.str(), job);
    const std::string trained = coverage(o, 0, 48);
    EXPECT_TRUE(o.steps.empty()) << odd.what << ": trained on; " << trained;
    for (int r = 0; r < c.world; ++r) {
      const auto& e = o.errors[static_cast<size_t>(r)];
      EXPECT_NE(e.find("Trainer::fit on rank " + std::to_string(r) + ": "), std::string::npos)
          << odd.what << ": " << e << " (" << trained << ")";
      EXPECT_NE(e.find("rank 1: "), std::string::npos) << odd.what << ": " << e;
      EXPECT_NE(e.find(odd.named), std::string::npos) << odd.what << ": " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, DataOrder, ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

class DataOrderShrink : public ::testing::TestWithParam<std::string> {};

// Stopped at world 3 a step into epoch 1 and resumed at world 2 (cohortrun
// -n 2:3 after a rank's loss) with the global batch kept (12: micro-batches
// of 2 x accumulation 2 x 3 ranks, then 3 x 2 x 2). A global order
// continues, and so does a sampled source (the sampler's padded order is the
// same at any number of replicas, each rank taking every num_replicas-th
// element): every step is the closed form's, each epoch trains every
// sample once.
TEST_P(DataOrderShrink, AGlobalOrderAndASamplerContinue) {
  const std::string backend = GetParam();
  for (const bool sampled : {false, true}) {
    const std::string what = sampled ? "sampled" : "global order";
    TempDir dir("cohort-data-order");
    Job first{3, 2, 2, 2, 5};  // 4 steps an epoch
    first.deal.sampled = sampled;
    const auto a = run(backend, dir.str(), first);
    ASSERT_EQ(a.errors, std::vector<std::string>(3)) << what;
    Job second{2, 3, 2, 2};
    second.resume = true;
    second.deal.sampled = sampled;
    const auto b = run(backend, dir.str(), second);
    ASSERT_EQ(b.errors, std::vector<std::string>(2))
        << what << ": " << coverage(joined(a, b), 1, 48);
    const auto all = joined(a, b);
    ASSERT_EQ(all.steps.size(), 8u);
    expect_closed_form(a, first.deal, 1, 3, 2, 2, "world 3");
    expect_closed_form(b, second.deal, 6, 2, 3, 2, "world 2");
    for (int64_t e = 0; e < 2; ++e) EXPECT_EQ(coverage(all, e, 48), once(e, 48));
  }
}

// The engines (one case each).
std::vector<std::string> engines() {
  std::vector<std::string> out;
  for (const auto& c : testing::engine_worlds({3})) out.push_back(c.backend);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, DataOrderShrink, ::testing::ValuesIn(engines()));

}  // namespace
}  // namespace cohort::data_order_test
