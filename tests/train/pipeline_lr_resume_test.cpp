// A pipeline whose stages' optimizers train at rates of their own (one group
// each; or stage 0 with its bias in a group of its own, so that the ranks
// hold different numbers of groups), stopped after 2 of 4 steps and
// resumed: every rank
// goes on at its own groups' rates, and the parameters of every stage equal
// one process's SGD over the whole model with the same per-layer rates.
// A resume that takes rank 0's rates for every rank, or refuses the ranks'
// different numbers of groups, fails here. Pipelines of 2 and 3 stages
// over Gloo and UCX, ranks as threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/mesh/device_mesh.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::pipeline_lr_resume_test {
namespace {

using pipeline::Tensors;
using testing::TempDir;

constexpr int64_t kWidth = 6, kMicro = 2, kM = 2, kSamples = 16;
constexpr int64_t kSteps = kSamples / (kMicro * kM);
// Stage s trains at kRate[s]; split: stage 0's bias in a group of its own
// at kSplitBiasRate.
constexpr double kRate[] = {0.01, 0.1, 0.05};
constexpr double kSplitBiasRate = 0.03;

double bias_rate(int s, bool split) { return s == 0 && split ? kSplitBiasRate : kRate[s]; }

torch::Tensor det(std::vector<int64_t> shape, double phase) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return torch::sin(torch::arange(n, torch::kFloat32) * 0.37 + phase).reshape(shape) * 0.5;
}

// One Linear and Tanh per stage.
torch::nn::Sequential make_model(int stages) {
  torch::nn::Sequential seq;
  torch::NoGradGuard no_grad;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Linear lin(kWidth, kWidth);
    lin->weight.copy_(det({kWidth, kWidth}, s));
    lin->bias.copy_(det({kWidth}, 10 + s));
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

// Stage s's groups: one, or split: [weight, bias] at two rates on stage 0.
std::vector<torch::optim::OptimizerParamGroup> stage_groups(const std::vector<torch::Tensor>& ps,
                                                            int s, bool split) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (s == 0 && split) {
    groups.emplace_back(std::vector<torch::Tensor>{ps[0]},
                        std::make_unique<torch::optim::SGDOptions>(kRate[0]));
    groups.emplace_back(std::vector<torch::Tensor>{ps[1]},
                        std::make_unique<torch::optim::SGDOptions>(kSplitBiasRate));
  } else {
    groups.emplace_back(ps, std::make_unique<torch::optim::SGDOptions>(kRate[s]));
  }
  return groups;
}

// Micro-batch i is samples [i * kMicro, (i + 1) * kMicro), on every stage.
class Source : public DataSource {
 public:
  Source(torch::Tensor x, torch::Tensor y) : x_(std::move(x)), y_(std::move(y)) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return x_.size(0) / kMicro; }
  int64_t global_micro_batch() const override { return kMicro; }
  torch::data::Example<> batch(int64_t i) override {
    return {x_.narrow(0, i * kMicro, kMicro), y_.narrow(0, i * kMicro, kMicro)};
  }

 private:
  torch::Tensor x_, y_;
};

using Params = std::map<int64_t, torch::Tensor>;  // index in the whole model's parameters

// One process: the whole model, SGD at each layer's rates, each step's
// kM micro-batches as one batch (the mean of equal micro-batches' means).
Params reference(int stages, bool split, const torch::Tensor& x, const torch::Tensor& y) {
  auto model = make_model(stages);
  const auto ps = model->parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (int s = 0; s < stages; ++s) {
    groups.emplace_back(std::vector<torch::Tensor>{ps[2 * s]},
                        std::make_unique<torch::optim::SGDOptions>(kRate[s]));
    groups.emplace_back(std::vector<torch::Tensor>{ps[2 * s + 1]},
                        std::make_unique<torch::optim::SGDOptions>(bias_rate(s, split)));
  }
  torch::optim::SGD opt(groups, torch::optim::SGDOptions(1.0));
  const int64_t batch = kMicro * kM;
  for (int64_t t = 0; t < kSteps; ++t) {
    opt.zero_grad();
    torch::nn::functional::mse_loss(model->forward(x.narrow(0, t * batch, batch)),
                                    y.narrow(0, t * batch, batch))
        .backward();
    opt.step();
  }
  Params out;
  for (size_t i = 0; i < ps.size(); ++i) out[static_cast<int64_t>(i)] = ps[i].detach().clone();
  return out;
}

// Trains the pipeline to `max_steps` (0: the epoch), after a resume from
// `dir` when asked; every stage's parameters at the end.
Params train(const testing::EngineWorld& c, bool split, const std::string& dir, int64_t max_steps,
             bool resume, const torch::Tensor& x, const torch::Tensor& y) {
  Params out;
  std::mutex mu;
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> world) {
        const int r = world->rank();
        auto model = make_model(c.world);
        std::vector<int64_t> bounds;
        for (int s = 1; s < c.world; ++s) bounds.push_back(2 * s);
        std::vector<pipeline::PipelineStage> stages;
        stages.emplace_back(r, pipeline::split_sequential(model, bounds, r));
        auto mse = [](const Tensors& o, const Tensors& t) {
          return torch::nn::functional::mse_loss(o[0], t[0]);
        };
        pipeline::PipelineRuntime rt(DeviceMesh::from_group(world, "pp"), std::move(stages),
                                     pipeline::make_schedule("1f1b", c.world, 1, kM), mse);
        torch::optim::SGD opt(stage_groups(rt.parameters(), r, split),
                              torch::optim::SGDOptions(1.0));
        TrainerOptions config;
        config.accumulation_steps = kM;
        config.max_steps = max_steps;
        config.checkpoint_dir = dir;
        config.progress = false;
        Trainer trainer(TrainerWiring::pipeline(rt, opt), config);
        if (resume) {
          EXPECT_EQ(trainer.resume(), std::optional<int64_t>(2));
        }
        Source src(x, y);
        trainer.fit(src);
        std::lock_guard<std::mutex> lock(mu);
        const auto ps = model->parameters();
        for (int64_t k : {2 * r, 2 * r + 1}) out[k] = ps[static_cast<size_t>(k)].detach().clone();
      },
      testing::options_for(c));
  return out;
}

class PipelineLrResume : public ::testing::TestWithParam<testing::EngineWorld> {};

TEST_P(PipelineLrResume, EveryStageResumesAtItsOwnGroupsRates) {
  const auto& c = GetParam();
  const auto x = det({kSamples, kWidth}, 3.0), y = det({kSamples, kWidth}, 4.0);
  for (const bool split : {false, true}) {
    const std::string what = split ? "stage 0 split in two groups" : "one group a stage";
    const auto ref = reference(c.world, split, x, y);
    TempDir whole("cohort-pipeline-lr-whole"), parts("cohort-pipeline-lr-parts");
    const auto uninterrupted = train(c, split, whole.str(), 0, false, x, y);
    train(c, split, parts.str(), 2, false, x, y);
    const auto resumed = train(c, split, parts.str(), 0, true, x, y);
    ASSERT_EQ(resumed.size(), ref.size()) << what;
    for (const auto& [k, want] : ref) {
      EXPECT_LT((resumed.at(k) - want).abs().max().item<double>(), 1e-6)
          << what << ": parameter " << k << " (stage " << k / 2 << ") after the resume";
      EXPECT_LT((uninterrupted.at(k) - want).abs().max().item<double>(), 1e-6)
          << what << ": parameter " << k << " uninterrupted";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, PipelineLrResume,
                         ::testing::ValuesIn(testing::engine_worlds({2, 3})),
                         testing::engine_world_name);

}  // namespace
}  // namespace cohort::pipeline_lr_resume_test
