// A pipeline trains stage 0's rank's inputs against the last stage's
// rank's targets, so every rank of one pipeline must draw the same samples.
// A TensorDataSource sharded over the world instead of the data-parallel
// group deals each pipeline rank other samples: fit() refuses it on every
// rank before any step, and trains with the data sharded over dp
// (pipeline alone, pp 2 and 3; PP x DP, pp 2 x dp 2).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "cohort/core/error.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::pipeline_data_test {
namespace {

constexpr int64_t kWidth = 6, kMicro = 2;

torch::nn::Sequential make_model(int stages) {
  torch::nn::Sequential seq;
  auto gen = testing::make_generator(9);
  torch::NoGradGuard no_grad;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Linear lin(kWidth, kWidth);
    for (auto& p : lin->parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

struct Case {
  int pp, dp;
  bool over_world;  // the wrong sharding
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  return "pp" + std::to_string(info.param.pp) + "_dp" + std::to_string(info.param.dp) +
         (info.param.over_world ? "_world_sharded" : "_dp_sharded");
}

class PipelineData : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineData, EveryRankOfAPipelineDrawsTheSameSamples) {
  const Case c = GetParam();
  const int world = c.pp * c.dp, m = c.pp;
  auto gen = testing::make_generator(4);
  const auto x = torch::randn({48, kWidth}, gen), y = torch::randn({48, kWidth}, gen);
  std::vector<std::string> errors(world);
  std::vector<int64_t> steps(world, -1);
  std::mutex mu;
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    const auto mesh = init_device_mesh(comm, {c.dp, c.pp}, {"dp", "pp"});
    const int stage = mesh.local_rank("pp");
    std::vector<int64_t> bounds;
    for (int s = 1; s < c.pp; ++s) bounds.push_back(2 * s);
    auto model = make_model(c.pp);
    auto mse = [](const pipeline::Tensors& out, const pipeline::Tensors& target) {
      return torch::nn::functional::mse_loss(out[0], target[0]);
    };
    pipeline::PipelineRuntime rt(
        mesh["pp"],
        {pipeline::PipelineStage(stage, pipeline::split_sequential(model, bounds, stage))},
        pipeline::Schedule1F1B(c.pp, m), mse);
    torch::optim::SGD opt(rt.parameters(), 0.05);
    TrainerOptions config;
    config.accumulation_steps = m;
    config.progress = false;
    Trainer trainer(
        c.dp > 1 ? TrainerWiring::pipeline(rt, opt, mesh) : TrainerWiring::pipeline(rt, opt),
        config);
    const int rank = c.over_world ? comm->rank() : mesh.local_rank("dp");
    const int size = c.over_world ? world : c.dp;
    TensorDataSource source(x, y, kMicro, rank, size);
    try {
      const auto done = trainer.fit(source);
      std::lock_guard<std::mutex> lock(mu);
      steps[comm->rank()] = static_cast<int64_t>(done.size());
    } catch (const InvalidArgument& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[comm->rank()] = e.what();
    }
  });
  for (int r = 0; r < world; ++r) {
    if (!c.over_world) {
      EXPECT_EQ(errors[r], "") << "rank " << r;
      EXPECT_GT(steps[r], 0) << "rank " << r;
      continue;
    }
    EXPECT_EQ(steps[r], -1) << "rank " << r << " trained";
    EXPECT_NE(errors[r].find("must all draw the same samples"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("shard the data over the data-parallel group, not the world"),
              std::string::npos)
        << errors[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, PipelineData,
                         ::testing::Values(Case{2, 1, true}, Case{3, 1, true}, Case{2, 2, true},
                                           Case{2, 1, false}, Case{3, 1, false}, Case{2, 2, false}),
                         name_of);

}  // namespace
}  // namespace cohort::pipeline_data_test
