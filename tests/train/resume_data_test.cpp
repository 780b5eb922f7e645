// Where a resumed fit() continues in the data: a checkpoint taken in the
// middle of epoch 1 resumed with a smaller dataset, whose epoch 1 now ends
// before the samples already trained, ends that epoch and trains the next
// (as torchdata's StatefulDistributedSampler yields nothing past a dataset's
// end), on every rank alike, also with the global batch cut into other
// micro-batches; ranks given data of different lengths fail together. A
// checkpoint at the last step of an epoch resumes at the next epoch's start,
// and a SampledDataSource resumed mid-epoch deals the same shuffled order.
// Every run is checked against one process's SGD over the same global
// batches, or against the uninterrupted run. Ranks as threads, worlds 1 and 3.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <utility>

#include "cohort/core/error.h"
#include "cohort/train/sampled_data_source.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::resume_data_test {
namespace {

using testing::TempDir;

constexpr double kLr = 0.1;

struct Job {
  int world = 1;
  int64_t micro = 2;
  int64_t accumulation = 2;
  int64_t samples = 0;      // the first `samples` rows of the data
  int64_t odd_samples = 0;  // rank 1's, when positive
  int64_t epochs = 3;
  int64_t max_steps = 0;
  bool resume = false;
  bool sampled = false;  // a SampledDataSource (seed 5) instead of a TensorDataSource
};

struct Outcome {
  std::vector<std::string> errors;                      // by rank
  std::vector<std::pair<int64_t, int64_t>> steps;       // rank 0's (step, epoch)
  std::vector<double> losses;                           // rank 0's
  std::vector<std::pair<int64_t, int64_t>> epoch_ends;  // rank 0's (epoch, step)
  TrainingPosition position;                            // rank 0's, at the end
  std::vector<torch::Tensor> params;                    // rank 0's, at the end
};

testing::Synthetic rows(const testing::Synthetic& data, int64_t n) {
  return {data.x.narrow(0, 0, n), data.y.narrow(0, 0, n)};
}

Outcome run(const std::string& backend, const std::string& dir, const Job& job) {
  const auto all = testing::make_data(256);
  Outcome out;
  out.errors.resize(static_cast<size_t>(job.world));
  std::mutex mu;
  testing::ThreadRanksOptions options;
  options.backend = backend;
  testing::run_ranks_shared(
      job.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto net = testing::make_mlp(job.resume ? 99 : 7);  // resume must overwrite it
        torch::optim::SGD opt(net->parameters(), kLr);
        TrainerOptions config;
        config.accumulation_steps = job.accumulation;
        config.epochs = job.epochs;
        config.max_steps = job.max_steps;
        config.checkpoint_dir = dir;
        config.progress = false;
        Trainer trainer(
            TrainerWiring::all_reduce(net.ptr(), opt, comm),
            [&](const torch::data::Example<>& b) {
              return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
            },
            config);
        const int64_t n = job.odd_samples > 0 && comm->rank() == 1 ? job.odd_samples : job.samples;
        const auto mine = rows(all, n);
        std::unique_ptr<DataSource> source;
        if (job.sampled) {
          data::DistributedSamplerOptions deal;
          deal.seed = 5;
          source = std::make_unique<SampledDataSource>(
              mine.x, mine.y, job.micro,
              data::DistributedSampler(static_cast<size_t>(n), *comm, deal));
        } else {
          source = std::make_unique<TensorDataSource>(mine.x, mine.y, job.micro, comm->rank(),
                                                      comm->size());
        }
        FitCallbacks callbacks;
        std::vector<std::pair<int64_t, int64_t>> steps, ends;
        std::vector<double> losses;
        callbacks.on_step = [&](const StepMetrics& m) {
          steps.emplace_back(m.step, m.epoch);
          losses.push_back(m.loss);
        };
        callbacks.on_epoch_end = [&](const EpochEnd& e) { ends.emplace_back(e.epoch, e.step); };
        std::string error;
        try {
          if (job.resume) trainer.resume();
          trainer.fit(*source, callbacks);
        } catch (const Error& e) {
          error = e.what();
        }
        std::lock_guard<std::mutex> lock(mu);
        out.errors[static_cast<size_t>(comm->rank())] = error;
        if (comm->rank() != 0) return;
        out.steps = steps;
        out.losses = losses;
        out.epoch_ends = ends;
        out.position = trainer.position();
        for (const auto& p : net->parameters()) out.params.push_back(p.detach().clone());
      },
      options);
  return out;
}

// One process's SGD over global batches of `batch` samples: for each
// segment, steps [first, end) of the epoch's global order of the data's
// first `samples` rows (TensorDataSource's at world 1, which every world
// deals out in the same order).
struct Segment {
  int64_t samples, epoch, first, end;
};

std::vector<torch::Tensor> reference(int64_t batch, const std::vector<Segment>& segments) {
  const auto all = testing::make_data(256);
  auto net = testing::make_mlp();
  torch::optim::SGD opt(net->parameters(), kLr);
  for (const auto& s : segments) {
    const auto data = rows(all, s.samples);
    TensorDataSource order(data.x, data.y, batch, 0, 1);
    order.set_epoch(s.epoch);
    for (int64_t t = s.first; t < s.end; ++t) {
      const auto b = order.batch(t);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(b.data), b.target).backward();
      opt.step();
    }
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-5, 1e-6))
        << what << ": parameter " << i << " differs by "
        << (got[i] - want[i]).abs().max().item<float>();
  }
}

using Case = testing::EngineWorld;

class ResumeData : public ::testing::TestWithParam<Case> {};

// Global batch G = 4 x world (micro-batch 2, accumulation 2). The first job
// trains epoch 0 and 4 of epoch 1's 6 steps on 6 G samples. The resumed job
// has fewer: 3 G + 1 (3 steps an epoch: epoch 1 is past its end), 4.5 G (4
// steps, and half a step's micro-batches after the position) or 5 G (one
// step left), cut as before or into micro-batches of 1 with accumulation 4.
// Epoch 1 ends where the new data ends, epoch 2 trains whole.
TEST_P(ResumeData, ASmallerDatasetEndsTheResumedEpochAndTrainsTheNext) {
  const Case c = GetParam();
  const int64_t g = 4 * c.world;
  struct Cut {
    int64_t micro, accumulation;
  };
  for (const int64_t twice_steps : {6, 9, 10}) {  // the new data: twice_steps x G / 2 (+1)
    const int64_t samples = twice_steps * g / 2 + (twice_steps == 6 ? 1 : 0);
    const int64_t per_epoch = samples / g;
    const int64_t left = std::max<int64_t>(per_epoch - 4, 0);
    for (const Cut cut : {Cut{2, 2}, Cut{1, 4}}) {
      const std::string what = "new data " + std::to_string(samples) + " samples, micro-batch " +
                               std::to_string(cut.micro);
      TempDir dir("cohort-resume-data");
      const auto first = run(c.backend, dir.str(), {c.world, 2, 2, 6 * g, 0, 3, 10, false});
      ASSERT_EQ(first.errors, std::vector<std::string>(static_cast<size_t>(c.world)));
      ASSERT_EQ(first.position.epoch, 1);
      Job resumed{c.world, cut.micro, cut.accumulation, samples};
      resumed.resume = true;
      const auto second = run(c.backend, dir.str(), resumed);
      ASSERT_EQ(second.errors, std::vector<std::string>(static_cast<size_t>(c.world))) << what;
      ASSERT_EQ(second.steps.size(), static_cast<size_t>(left + per_epoch)) << what;
      for (size_t i = 0; i < second.steps.size(); ++i) {
        EXPECT_EQ(second.steps[i].first, 11 + static_cast<int64_t>(i)) << what;
        EXPECT_EQ(second.steps[i].second, static_cast<int64_t>(i) < left ? 1 : 2) << what;
      }
      const std::vector<std::pair<int64_t, int64_t>> ends = {{1, 10 + left},
                                                             {2, 10 + left + per_epoch}};
      EXPECT_EQ(second.epoch_ends, ends) << what;
      EXPECT_EQ(second.position.epoch, 3) << what;
      EXPECT_EQ(second.position.step, 10 + left + per_epoch) << what;
      const auto want = reference(g, {{6 * g, 0, 0, 6},
                                      {6 * g, 1, 0, 4},
                                      {samples, 1, 4, 4 + left},
                                      {samples, 2, 0, per_epoch}});
      expect_close(second.params, want, what);
    }
  }
}

// Rank 1 resumes with fewer samples than its peers: its epoch has fewer
// micro-batches, which every rank refuses at the epoch's start, naming the
// ranks, before any step and without waiting for a timeout.
TEST_P(ResumeData, RanksResumedWithDataOfDifferentLengthsFailTogether) {
  const Case c = GetParam();
  if (c.world == 1) GTEST_SKIP() << "one rank cannot disagree";
  const int64_t g = 4 * c.world;
  TempDir dir("cohort-resume-data");
  run(c.backend, dir.str(), {c.world, 2, 2, 6 * g, 0, 3, 10, false});
  const auto start = std::chrono::steady_clock::now();
  Job resumed{c.world, 2, 2, 6 * g, 3 * g + 1};
  resumed.resume = true;
  const auto second = run(c.backend, dir.str(), resumed);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_TRUE(second.steps.empty());
  for (int r = 0; r < c.world; ++r) {
    const auto& e = second.errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("Trainer::fit on rank " + std::to_string(r) +
                     ": ranks disagree on the data source's micro-batches"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("rank 1: epoch 1: 6 micro-batches"), std::string::npos) << e;
  }
}

// 7 micro-batches of 2 a rank (14 x world + 1 samples), accumulation 2: 3
// steps an epoch and one micro-batch left over. Stopped at step 3, the last
// of epoch 0, the checkpoint is at epoch 1's start: the resumed job trains
// epoch 1 whole, bitwise as the uninterrupted run, and as one process when
// cut into micro-batches of 1 with accumulation 4.
TEST_P(ResumeData, ACheckpointAtAnEpochsLastStepResumesAtTheNextEpoch) {
  const Case c = GetParam();
  const int64_t g = 4 * c.world;
  const int64_t samples = 14 * c.world + 1;
  TempDir whole("cohort-resume-whole"), split("cohort-resume-split");
  const auto uninterrupted = run(c.backend, whole.str(), {c.world, 2, 2, samples, 0, 2});
  ASSERT_EQ(uninterrupted.steps.size(), 6u);
  const auto first = run(c.backend, split.str(), {c.world, 2, 2, samples, 0, 2, 3});
  ASSERT_EQ(first.epoch_ends, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}}));
  EXPECT_EQ(first.position.epoch, 1);
  EXPECT_EQ(first.position.batch, 0);
  Job resumed{c.world, 2, 2, samples, 0, 2};
  resumed.resume = true;
  const auto second = run(c.backend, split.str(), resumed);
  ASSERT_EQ(second.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(second.steps[i], std::make_pair(static_cast<int64_t>(4 + i), int64_t{1}));
    EXPECT_EQ(second.losses[i], uninterrupted.losses[3 + i]) << "step " << 4 + i;
  }
  EXPECT_EQ(second.epoch_ends, (std::vector<std::pair<int64_t, int64_t>>{{1, 6}}));
  ASSERT_EQ(second.params.size(), uninterrupted.params.size());
  for (size_t i = 0; i < second.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(second.params[i], uninterrupted.params[i])) << "parameter " << i;
  }
  const auto want = reference(g, {{samples, 0, 0, 3}, {samples, 1, 0, 3}});
  expect_close(uninterrupted.params, want, "uninterrupted");
  Job recut{c.world, 1, 4, samples, 0, 2};
  recut.resume = true;
  TempDir again("cohort-resume-recut");
  run(c.backend, again.str(), {c.world, 2, 2, samples, 0, 2, 3});
  expect_close(run(c.backend, again.str(), recut).params, want, "micro-batches of 1");
}

// A SampledDataSource (DistributedSampler, shuffled with seed 5) stopped in
// the middle of epoch 1 deals the rest of that epoch's order on resume: the
// losses and parameters are bitwise the uninterrupted run's. 40 samples
// padded to a multiple of the world: 7 micro-batches of 2 at world 3, 20 at
// world 1; accumulation 2. Resumed with fewer samples, it is refused: its
// position counts the samples of the old dataset's permutation.
TEST_P(ResumeData, ASampledSourceResumesItsShuffledOrderMidEpoch) {
  const Case c = GetParam();
  Job whole{c.world, 2, 2, 40, 0, 3};
  whole.sampled = true;
  TempDir a("cohort-resume-sampled-whole"), b("cohort-resume-sampled-split");
  const auto uninterrupted = run(c.backend, a.str(), whole);
  const int64_t per_epoch = c.world == 3 ? 3 : 10;
  ASSERT_EQ(uninterrupted.steps.size(), static_cast<size_t>(3 * per_epoch));
  Job first = whole;
  first.max_steps = per_epoch + 2;
  run(c.backend, b.str(), first);
  // The position counts samples of the old dataset's order: 20 samples are
  // refused on every rank, naming both counts.
  Job smaller = whole;
  smaller.samples = 20;
  smaller.resume = true;
  const auto refused = run(c.backend, b.str(), smaller);
  EXPECT_TRUE(refused.steps.empty());
  for (const auto& e : refused.errors) {
    EXPECT_NE(e.find("dealt from 40 samples, this job's data source from 20 samples"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("does not carry over to another dataset"), std::string::npos) << e;
  }
  Job resumed = whole;
  resumed.resume = true;
  const auto second = run(c.backend, b.str(), resumed);
  ASSERT_EQ(second.losses.size(), static_cast<size_t>(2 * per_epoch - 2));
  for (size_t i = 0; i < second.losses.size(); ++i) {
    EXPECT_EQ(second.losses[i], uninterrupted.losses[per_epoch + 2 + i]) << "step " << i;
  }
  ASSERT_EQ(second.params.size(), uninterrupted.params.size());
  for (size_t i = 0; i < second.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(second.params[i], uninterrupted.params[i])) << "parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, ResumeData, ::testing::ValuesIn(testing::engine_worlds({1, 3})),
                         testing::engine_world_name);

}  // namespace
}  // namespace cohort::resume_data_test
