// A Trainer with DDP and a stateful compressor (int8 and top-k error
// feedback, PowerSGD's Q, error and step counters) resumed from a checkpoint
// takes bitwise the steps of the uninterrupted run: the compressor's state
// travels in the checkpoint's dcp folder, each rank's under its own names.
// At another world size the resume is refused on every rank.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <mutex>
#include <set>

#include "cohort/dcp/dcp.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "tests/train/train_fixtures.h"

namespace cohort::testing::compression_resume_test {
namespace {

using compression::CompressionKind;

constexpr int kWorld = 2;
constexpr int64_t kMicro = 4;
constexpr int64_t kSteps = 6;

// Runs `use` with rank comm's DDP Trainer whose comm hook is a `kind`
// compressor, checkpointing into `dir`, and its model.
void with_trainer(const std::shared_ptr<Communicator>& comm, CompressionKind kind,
                  const std::string& dir,
                  const std::function<void(Trainer&, torch::nn::Sequential&)>& use,
                  bool async = false) {
  torch::set_num_threads(1);
  auto net = make_mlp();
  DDPOptions o;
  o.compression.kind = kind;
  o.compression.topk_ratio = 0.2;
  o.compression.powersgd_start_iteration = 2;
  o.compression.powersgd_min_compression_rate = 1;
  DistributedDataParallel<torch::nn::Sequential> ddp(net, comm, o);
  torch::optim::AdamW adamw(ddp.parameters(), torch::optim::AdamWOptions(1e-2));
  TrainerOptions config;
  config.schedule.base_lr = 1e-2;
  config.progress = false;
  config.checkpoint_dir = dir;
  config.async_checkpoint = async;
  LossFn loss = [&](const torch::data::Example<>& b) {
    return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
  };
  Trainer trainer(TrainerWiring::ddp(ddp, adamw), loss, config);
  use(trainer, net);
}

// Trains steps [from, to) (resuming from `dir` when from > 0, writing a
// checkpoint at `to` when it is not the end) and returns rank 0's params.
// async: the checkpoint at `to` is an async one, staged while one more step
// changes the compressor's state in place, and committed by a save after
// that step (which is itself dropped, never committed).
std::vector<torch::Tensor> train(CompressionKind kind, const std::string& dir, int64_t from,
                                 int64_t to, const Synthetic& data, bool async = false) {
  std::vector<torch::Tensor> out;
  std::mutex mu;
  run_ranks_shared(kWorld, [&](std::shared_ptr<Communicator> comm) {
    with_trainer(
        comm, kind, dir,
        [&](Trainer& trainer, torch::nn::Sequential& net) {
          if (from > 0) {
            ASSERT_EQ(trainer.resume().value_or(-1), from);
          }
          auto step = [&](int64_t s) {
            const int64_t start = (s * kWorld + comm->rank()) * kMicro;
            trainer.train_step(
                {{data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)}});
          };
          for (int64_t s = from; s < to; ++s) step(s);
          {
            std::lock_guard<std::mutex> lock(mu);
            if (comm->rank() == 0) {
              for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
            }
          }
          if (to < kSteps) trainer.save_checkpoint();
          if (async && to < kSteps) {
            step(to);
            trainer.save_checkpoint();
          }
        },
        async);
  });
  return out;
}

class Resume : public ::testing::TestWithParam<CompressionKind> {};

TEST_P(Resume, BitwiseTheUninterruptedRun) {
  const auto data = make_data(kSteps * kWorld * kMicro);
  TempDir straight_dir("compression-straight"), resumed_dir("compression-resumed");
  const auto straight = train(GetParam(), straight_dir.str(), 0, kSteps, data);
  train(GetParam(), resumed_dir.str(), 0, 3, data);
  for (auto& e : std::filesystem::directory_iterator(resumed_dir.str())) {
    EXPECT_EQ(e.path().string().find(".shard-"), std::string::npos) << e.path();
  }
  // Each rank's compressor state is in the checkpoint's dcp folder.
  const std::string folder = CheckpointDir(resumed_dir.str(), 3).path_for(3) + ".dcp";
  ASSERT_TRUE(std::filesystem::exists(folder + "/.metadata")) << folder;
  std::set<std::string> ranks;
  for (const auto& t : dcp::read_metadata(folder).tensors) {
    if (t.fqn.rfind("sync.rank", 0) == 0) ranks.insert(t.fqn.substr(0, t.fqn.find('.', 5)));
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"sync.rank0", "sync.rank1"}));
  const auto resumed = train(GetParam(), resumed_dir.str(), 3, kSteps, data);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed[i], straight[i])) << "parameter " << i;
  }
}

TEST_P(Resume, FromAnAsyncCheckpointBitwiseTheUninterruptedRun) {
  const auto data = make_data(kSteps * kWorld * kMicro);
  TempDir straight_dir("compression-straight"), resumed_dir("compression-async");
  const auto straight = train(GetParam(), straight_dir.str(), 0, kSteps, data);
  train(GetParam(), resumed_dir.str(), 0, 3, data, /*async=*/true);
  const CheckpointDir dir(resumed_dir.str(), 3);
  EXPECT_EQ(dir.steps(), std::vector<int64_t>{3});
  EXPECT_TRUE(std::filesystem::exists(dir.path_for(3) + ".dcp/.metadata"));
  const auto resumed = train(GetParam(), resumed_dir.str(), 3, kSteps, data);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed[i], straight[i])) << "parameter " << i;
  }
}

// Each rank's state describes its own gradients: a resume at another world
// size (fewer ranks, where every rank finds entries of its own, and more)
// is a ConfigError on every rank naming the compressor state.
TEST_P(Resume, AtAnotherWorldSizeIsRefusedOnEveryRank) {
  const auto data = make_data(kSteps * kWorld * kMicro);
  TempDir dir("compression-resized");
  train(GetParam(), dir.str(), 0, 3, data);
  for (int world : {1, 3}) {
    std::vector<std::string> errors(world);
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      with_trainer(comm, GetParam(), dir.str(), [&](Trainer& trainer, torch::nn::Sequential&) {
        try {
          trainer.resume();
        } catch (const ConfigError& e) {
          errors[comm->rank()] = e.what();
        }
      });
    });
    for (int r = 0; r < world; ++r) {
      const auto& e = errors[r];
      EXPECT_NE(e.find("Trainer::resume on rank " + std::to_string(r)), std::string::npos) << e;
      EXPECT_NE(e.find("written by 2 ranks, this job has " + std::to_string(world)),
                std::string::npos)
          << e;
      EXPECT_NE(e.find("stateful gradient compressor (error feedback) cannot be resharded"),
                std::string::npos)
          << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Compression, Resume,
                         ::testing::Values(CompressionKind::Int8, CompressionKind::TopK,
                                           CompressionKind::PowerSGD),
                         [](const auto& info) { return compression::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::compression_resume_test
