// Parameters without a gradient under the mesh wiring (TrainerWiring::mesh,
// whose pipeline computes the gradients past the DP reducer's hooks and
// GradientSynchronizer::synchronize reduces them): a trainable Linear no
// rank uses must be left as one process leaves it, its .grad undefined, so
// that AdamW's weight decay skips it; a branch some ranks take must get the
// average over all ranks (zeros from the others), as one process running the
// ranks' micro-batches one after another computes it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/schedule.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::mesh_unused_parameters_test {
namespace {

using Case = cohort::testing::EngineWorld;
using pipeline::Tensors;

constexpr int64_t kMicro = 2;  // micro-batches per rank and step
constexpr int64_t kRows = 3;   // rows per micro-batch
constexpr int64_t kSteps = 3;
constexpr double kLr = 0.1, kDecay = 0.1;

// `used` runs on every micro-batch, `branch` where the micro-batch's first
// column says so, `idle` never.
struct Model {
  std::shared_ptr<torch::nn::Module> holder = std::make_shared<torch::nn::Module>("Holder");
  torch::nn::Linear used{4, 4}, branch{4, 4}, idle{4, 4};

  Model() {
    auto gen = testing::make_generator(5);
    torch::NoGradGuard no_grad;
    for (auto* l : {&used, &branch, &idle}) {
      for (auto& p : (*l)->parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.5);
    }
    holder->register_module("used", used);
    holder->register_module("branch", branch);
    holder->register_module("idle", idle);
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto h = used->forward(x);
    if (x.select(1, 0).gt(0.5).any().item<bool>()) h = h + branch->forward(x);
    return h;
  }
};

std::vector<torch::Tensor> snapshot(const Model& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.holder->parameters()) out.push_back(p.detach().clone());
  return out;
}

// Micro-batch j of rank r at step s: random rows whose first column (the
// branch flag) is 1 in micro-batch 0 of the ranks with r + s even.
torch::data::Example<> micro_batch(int64_t s, int r, int64_t j) {
  auto gen = testing::make_generator(static_cast<uint64_t>(100 + 10 * s + 3 * r + j));
  auto x = torch::randn({kRows, 4}, gen);
  x.select(1, 0).fill_((r + s) % 2 == 0 && j == 0 ? 1.0 : 0.0);
  return {x, torch::randn({kRows, 4}, gen)};
}

torch::optim::AdamW make_adamw(const Model& m) {
  return torch::optim::AdamW(m.holder->parameters(),
                             torch::optim::AdamWOptions(kLr).weight_decay(kDecay));
}

// One process: every rank's micro-batches one after another, each loss
// divided by their number, then AdamW.
std::vector<torch::Tensor> reference(int world) {
  Model m;
  auto opt = make_adamw(m);
  for (int64_t s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    for (int r = 0; r < world; ++r) {
      for (int64_t j = 0; j < kMicro; ++j) {
        const auto b = micro_batch(s, r, j);
        (torch::nn::functional::mse_loss(m.forward(b.data), b.target) / (world * kMicro))
            .backward();
      }
    }
    opt.step();
  }
  return snapshot(m);
}

class MeshUnusedParameters : public ::testing::TestWithParam<Case> {};

TEST_P(MeshUnusedParameters, ALayerNoRankUsesStaysAsItWasAndABranchSomeTakeIsAveraged) {
  const Case c = GetParam();
  const auto ref = reference(c.world);
  const auto initial = snapshot(Model());
  testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(comm, {1, c.world, 1}, {"pp", "dp", "tp"});
        Model m;
        cohort::GradientSynchronizer sync(mesh, m.holder, {}, torch::Tensor());
        std::vector<pipeline::PipelineStage> stages;
        stages.emplace_back(
            0, [&m](const Tensors& in) -> Tensors { return {m.forward(in.at(0))}; },
            m.holder->parameters(), m.holder);
        pipeline::PipelineRuntime rt(mesh["pp"], std::move(stages),
                                     pipeline::make_schedule("1f1b", 1, 1, kMicro),
                                     [](const Tensors& out, const Tensors& t) {
                                       return torch::nn::functional::mse_loss(out[0], t[0]);
                                     });
        auto opt = make_adamw(m);
        TrainerOptions config;
        config.accumulation_steps = kMicro;
        config.schedule.base_lr = kLr;
        config.progress = false;
        Trainer trainer(TrainerWiring::mesh(mesh, rt, opt, sync), config);
        const int r = comm->rank();
        for (int64_t s = 0; s < kSteps; ++s) {
          std::vector<torch::data::Example<>> batches;
          for (int64_t j = 0; j < kMicro; ++j) batches.push_back(micro_batch(s, r, j));
          trainer.train_step(batches);
        }
        const auto named = m.holder->named_parameters();
        for (size_t i = 0; i < named.size(); ++i) {
          const auto& name = named[i].key();
          const auto& p = named[i].value();
          if (name.rfind("idle.", 0) == 0) {
            EXPECT_TRUE(torch::equal(p, initial[i]))
                << name << " on rank " << r << " moved by "
                << (p - initial[i]).abs().max().item<float>() << "; one process leaves it";
            EXPECT_FALSE(p.grad().defined()) << name << " on rank " << r;
          } else {
            EXPECT_TRUE(torch::allclose(p, ref[i], 1e-5, 1e-6))
                << name << " on rank " << r << " differs from one process by "
                << (p - ref[i]).abs().max().item<float>();
          }
        }
      },
      testing::options_for(c));
}

INSTANTIATE_TEST_SUITE_P(EngineWorlds, MeshUnusedParameters,
                         ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

}  // namespace
}  // namespace cohort::mesh_unused_parameters_test
