// What a resume gives back besides the model and optimizer: each rank's
// own buffers where nothing broadcasts them, an async checkpoint of a
// train_step loop once committed, and rotation that keeps checkpoints a
// resume can load. Ranks as threads (the buffers and checkpoints draw
// nothing from the global generator).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cohort/dcp/checkpoint_file.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/train/dcp_checkpoint.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::resume_state_test {
namespace {

using cohort::testing::TempDir;

// ---- BatchNorm statistics, each rank's own ----------------------------------

struct BufferCase {
  bool ddp;  // DDP with broadcast_buffers false, else the all-reduce wiring
  int world;
};

struct BufferRun {
  std::vector<double> losses;                      // rank 0's, per step run
  std::vector<std::vector<torch::Tensor>> params;  // by rank
  std::vector<std::vector<torch::Tensor>> buffers;
  std::optional<int64_t> resumed_at;
};

// Linear BatchNorm1d tanh Linear; each rank's data scaled by 1 + rank, so
// that every rank's running statistics are its own.
BufferRun run_bn(const BufferCase& c, const std::string& dir, int64_t max_steps, bool resume) {
  const auto data = testing::make_data(240);
  BufferRun out;
  out.params.resize(c.world);
  out.buffers.resize(c.world);
  std::mutex mu;
  testing::run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16),
                              torch::nn::Tanh(), torch::nn::Linear(16, 4));
    {
      auto gen = testing::make_generator(resume ? 99 : 7);
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
    }
    std::optional<DistributedDataParallel<torch::nn::Sequential>> ddp;
    if (c.ddp) {
      DDPOptions options;
      options.broadcast_buffers = false;
      ddp.emplace(net, comm, options);
    }
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    TrainerOptions config;
    config.accumulation_steps = 2;
    config.epochs = 100;
    config.max_steps = max_steps;
    config.checkpoint_dir = dir;
    config.checkpoint_every = 5;
    config.progress = false;
    auto wiring =
        c.ddp ? TrainerWiring::ddp(*ddp, opt) : TrainerWiring::all_reduce(net.ptr(), opt, comm);
    Trainer trainer(
        std::move(wiring),
        [&](const torch::data::Example<>& b) {
          auto y = ddp ? ddp->forward(b.data) : net->forward(b.data);
          return torch::nn::functional::cross_entropy(y, b.target);
        },
        config);
    std::optional<int64_t> resumed = resume ? trainer.resume() : std::nullopt;
    TensorDataSource source(data.x * (1 + comm->rank()), data.y, 4, comm->rank(), comm->size());
    std::vector<double> losses;
    FitCallbacks callbacks;
    callbacks.on_step = [&](const StepMetrics& m) { losses.push_back(m.loss); };
    trainer.fit(source, callbacks);
    std::lock_guard<std::mutex> lock(mu);
    for (auto& p : net->parameters()) out.params[comm->rank()].push_back(p.detach().clone());
    for (auto& b : net->buffers()) out.buffers[comm->rank()].push_back(b.detach().clone());
    if (comm->rank() == 0) {
      out.losses = losses;
      out.resumed_at = resumed;
    }
  });
  return out;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    m = std::max(m,
                 (a[i].to(torch::kFloat64) - b[i].to(torch::kFloat64)).abs().max().item<double>());
  }
  return m;
}

class RankBuffers : public ::testing::TestWithParam<BufferCase> {};

// Nothing makes the ranks' BatchNorm statistics alike: the resumed run must
// give every rank its own back, or it trains on with rank 0's.
TEST_P(RankBuffers, ResumeGivesEveryRankItsOwn) {
  const auto c = GetParam();
  TempDir whole("cohort-bn-whole"), split("cohort-bn-split");
  const auto uninterrupted = run_bn(c, whole.str(), 12, false);
  run_bn(c, split.str(), 5, false);
  const auto resumed = run_bn(c, split.str(), 12, true);
  ASSERT_EQ(resumed.resumed_at, std::optional<int64_t>(5));
  ASSERT_EQ(resumed.losses.size(), 7u);
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_EQ(resumed.losses[i], uninterrupted.losses[5 + i]) << "step " << 6 + i;
  }
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(max_difference(resumed.buffers[r], uninterrupted.buffers[r]), 0.0) << "rank " << r;
    EXPECT_EQ(max_difference(resumed.params[r], uninterrupted.params[r]), 0.0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, RankBuffers,
                         ::testing::Values(BufferCase{false, 1}, BufferCase{false, 2},
                                           BufferCase{false, 3}, BufferCase{true, 2},
                                           BufferCase{true, 3}),
                         [](const ::testing::TestParamInfo<BufferCase>& i) {
                           return std::string(i.param.ddp ? "ddp_no_broadcast" : "allreduce") +
                                  "_world" + std::to_string(i.param.world);
                         });

// ---- a train_step loop with async checkpoints, and rotation ------------------

// A train_step loop of `world` thread ranks (all-reduce wiring) that calls
// `after_step(trainer, step, comm)` after each step; `before(trainer, rank)` first.
void step_loop(int world, TrainerOptions config, int64_t steps,
               const std::function<void(Trainer&, int64_t, Communicator&)>& after_step,
               const std::function<void(Trainer&, int)>& before = {}) {
  const auto data = testing::make_data(96);
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto net = testing::make_mlp();
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    config.progress = false;
    Trainer trainer(
        TrainerWiring::all_reduce(net.ptr(), opt, comm),
        [&](const torch::data::Example<>& b) {
          return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
        },
        config);
    if (before) before(trainer, comm->rank());
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t at = (s * comm->size() + comm->rank()) * 4 % 96;
      trainer.train_step({{data.x.narrow(0, at, 4), data.y.narrow(0, at, 4)}});
      after_step(trainer, s + 1, *comm);
    }
  });
}

std::optional<int64_t> resume_from(int world, const std::string& dir) {
  std::optional<int64_t> step;
  TrainerOptions config;
  config.checkpoint_dir = dir;
  step_loop(
      world, config, 0, [](Trainer&, int64_t, Communicator&) {},
      [&](Trainer& t, int rank) {
        const auto r = t.resume();
        if (rank == 0) step = r;
      });
  return step;
}

// The last async save of a train_step loop is committed by
// finish_checkpoint(); without it, the Trainer going says so on stderr and
// a resume finds the save before.
TEST(TrainerAsyncCheckpoint, FinishCheckpointCommitsTheLastSaveOfATrainStepLoop) {
  for (const bool finish : {true, false}) {
    TempDir dir("cohort-async-finish");
    TrainerOptions config;
    config.checkpoint_dir = dir.str();
    config.async_checkpoint = true;
    ::testing::internal::CaptureStderr();
    step_loop(2, config, 3, [&](Trainer& trainer, int64_t step, Communicator&) {
      trainer.save_checkpoint();
      if (finish && step == 3) trainer.finish_checkpoint();
    });
    const std::string err = ::testing::internal::GetCapturedStderr();
    const bool warned = err.find("async checkpoint of step 3 not committed") != std::string::npos;
    EXPECT_EQ(resume_from(2, dir.str()), std::optional<int64_t>(finish ? 3 : 2))
        << (finish ? "with" : "without") << " finish_checkpoint";
    EXPECT_EQ(warned, !finish) << err;
  }
}

// Whether `step`'s checkpoint in `dir` is one a resume can load: its file
// and its dcp folder verify.
bool loadable(const std::string& dir, int64_t step) {
  const auto path = CheckpointDir(dir, 1).path_for(step);
  try {
    read_checkpoint_file(path);
    verify_dcp_folder(dcp_folder(path));
  } catch (const CheckpointError&) {
    return false;
  }
  return true;
}

// A checkpoint whose dcp folder is damaged counts for nothing in rotation.
// Saved at 4 and 6 with keep_last 2, 6's folder damaged: the job resumes
// from 4 and saves 5, which must leave two loadable checkpoints, 5 and 4
// (not 5 and the damaged 6), so that with 5 damaged too a resume takes 4.
TEST(TrainerCheckpoint, RotationCountsOnlyCheckpointsWhoseFolderVerifies) {
  for (const int world : {1, 3}) {
    TempDir dir("cohort-rotate-folder");
    TrainerOptions config;
    config.checkpoint_dir = dir.str();
    config.keep_last = 2;
    // The last rank's data file, truncated: the folder's sizes disagree.
    auto damage = [&](int64_t step) {
      const auto file = dcp_folder(CheckpointDir(dir.str(), 1).path_for(step)) + "/__" +
                        std::to_string(world - 1) + "_0.distcp";
      std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
    };
    step_loop(world, config, 6, [&](Trainer& trainer, int64_t step, Communicator&) {
      if (step == 4 || step == 6) trainer.save_checkpoint();
    });
    damage(6);
    ::testing::internal::CaptureStderr();  // the skipped checkpoint's line
    std::optional<int64_t> resumed;
    int loadable_after_save = 0;
    step_loop(
        world, config, 1,
        [&](Trainer& trainer, int64_t, Communicator& comm) {
          trainer.save_checkpoint();
          comm.barrier().wait();
          if (comm.rank() != 0) return;
          for (int64_t s = 1; s <= 6; ++s) loadable_after_save += loadable(dir.str(), s);
        },
        [&](Trainer& trainer, int rank) {
          const auto r = trainer.resume();
          if (rank == 0) resumed = r;
        });
    ASSERT_EQ(resumed, std::optional<int64_t>(4)) << "world " << world;
    EXPECT_EQ(loadable_after_save, 2) << "world " << world;
    damage(5);
    std::string error;
    try {
      resumed = resume_from(world, dir.str());
    } catch (const std::exception& e) {
      resumed.reset();
      error = e.what();
    }
    ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(resumed, std::optional<int64_t>(4)) << "world " << world << ": " << error;
  }
}

}  // namespace
}  // namespace cohort::resume_state_test
