// A Trainer with DDP and a stateful compressor (int8 and top-k error
// feedback, PowerSGD's Q, error and step counters) resumed from a checkpoint
// takes bitwise the steps of the uninterrupted run: the compressor's state
// travels in each rank's checkpoint shard.
#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/ddp_gradient_sync.h"
#include "cohort/train/trainer.h"
#include "support/thread_ranks.h"
#include "tests/train/train_fixtures.h"

namespace cohort::testing::compression_resume_test {
namespace {

using compression::CompressionKind;

constexpr int kWorld = 2;
constexpr int64_t kMicro = 4;
constexpr int64_t kSteps = 6;

// Trains steps [from, to) (resuming from `dir` when from > 0, writing a
// checkpoint at `to` when it is not the end) and returns rank 0's params.
std::vector<torch::Tensor> train(CompressionKind kind, const std::string& dir, int64_t from,
                                 int64_t to, const Synthetic& data) {
  std::vector<torch::Tensor> out;
  std::mutex mu;
  run_ranks_shared(kWorld, [&](std::shared_ptr<Communicator> comm) {
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
    LossFn loss = [&](const torch::data::Example<>& b) {
      return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
    };
    Trainer trainer(TrainerWiring::ddp(ddp, adamw), loss, config);
    if (from > 0) {
      ASSERT_EQ(trainer.resume().value_or(-1), from);
    }
    for (int64_t s = from; s < to; ++s) {
      const int64_t start = (s * kWorld + comm->rank()) * kMicro;
      trainer.train_step({{data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)}});
    }
    if (to < kSteps) trainer.save_checkpoint();
    std::lock_guard<std::mutex> lock(mu);
    if (comm->rank() == 0) {
      for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    }
  });
  return out;
}

class Resume : public ::testing::TestWithParam<CompressionKind> {};

TEST_P(Resume, BitwiseTheUninterruptedRun) {
  const auto data = make_data(kSteps * kWorld * kMicro);
  TempDir straight_dir("compression-straight"), resumed_dir("compression-resumed");
  const auto straight = train(GetParam(), straight_dir.str(), 0, kSteps, data);
  train(GetParam(), resumed_dir.str(), 0, 3, data);
  bool shard = false;
  for (auto& e : std::filesystem::directory_iterator(resumed_dir.str())) {
    shard = shard || e.path().string().find(".shard-") != std::string::npos;
  }
  EXPECT_TRUE(shard) << "the compressor state has no shard file";
  const auto resumed = train(GetParam(), resumed_dir.str(), 3, kSteps, data);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed[i], straight[i])) << "parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Compression, Resume,
                         ::testing::Values(CompressionKind::Int8, CompressionKind::TopK,
                                           CompressionKind::PowerSGD),
                         [](const auto& info) { return compression::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::compression_resume_test
