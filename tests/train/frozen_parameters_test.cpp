// Parameters without a gradient under the all-reduce wiring: a frozen layer
// (requires_grad false) and a trainable layer no rank uses must be left as
// one process leaves them. Their .grad stays undefined, so AdamW (weight
// decay 0.01 by default) skips them; a defined zero gradient would decay
// them every step on two or more ranks only.
#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <vector>

#include "cohort/grad_sync/average_gradients.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::frozen_parameters_test {
namespace {

using cohort::testing::make_data;
using cohort::testing::make_mlp;
using Case = cohort::testing::EngineWorld;

constexpr int64_t kMicro = 4;  // samples per rank and step
constexpr int64_t kSteps = 3;
constexpr double kLr = 0.01;

// The MLP (its first Linear frozen when asked) and, beside it, a trainable
// Linear the forward never calls.
struct Model {
  std::shared_ptr<torch::nn::Module> holder;
  torch::nn::Sequential mlp;
  torch::nn::Linear idle{nullptr};
};

Model make_model(bool freeze_first) {
  Model m{std::make_shared<torch::nn::Module>("Holder"), make_mlp(), torch::nn::Linear(4, 4)};
  {
    torch::NoGradGuard no_grad;
    for (auto& p : m.idle->parameters()) p.fill_(0.5);
  }
  if (freeze_first) {
    for (auto& p : m.mlp[0]->parameters()) p.requires_grad_(false);
  }
  m.holder->register_module("mlp", m.mlp);
  m.holder->register_module("idle", m.idle);
  return m;
}

std::vector<torch::Tensor> snapshot(const Model& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.holder->parameters()) out.push_back(p.detach().clone());
  return out;
}

// One process: AdamW on the global batch (the ranks' slices in rank order).
std::vector<torch::Tensor> reference(int world, bool freeze_first, const testing::Synthetic& data) {
  auto m = make_model(freeze_first);
  torch::optim::AdamW opt(m.holder->parameters(), torch::optim::AdamWOptions(kLr));
  const int64_t global = world * kMicro;
  for (int64_t s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(m.mlp->forward(data.x.narrow(0, s * global, global)),
                                         data.y.narrow(0, s * global, global))
        .backward();
    opt.step();
  }
  return snapshot(m);
}

class FrozenParameters : public ::testing::TestWithParam<Case> {
 protected:
  void check(bool freeze_first) {
    const Case c = GetParam();
    const auto data = make_data(kSteps * c.world * kMicro);
    const auto ref = reference(c.world, freeze_first, data);
    const auto initial = snapshot(make_model(freeze_first));
    testing::run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          auto m = make_model(freeze_first);
          torch::optim::AdamW opt(m.holder->parameters(), torch::optim::AdamWOptions(kLr));
          TrainerOptions config;
          config.progress = false;
          Trainer trainer(
              TrainerWiring::all_reduce(m.holder, opt, comm),
              [&](const torch::data::Example<>& b) {
                return torch::nn::functional::cross_entropy(m.mlp->forward(b.data), b.target);
              },
              config);
          const int64_t global = c.world * kMicro;
          for (int64_t s = 0; s < kSteps; ++s) {
            const int64_t start = s * global + comm->rank() * kMicro;
            trainer.train_step(
                {{data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)}});
          }
          const auto named = m.holder->named_parameters();
          for (size_t i = 0; i < named.size(); ++i) {
            const auto& name = named[i].key();
            const auto& p = named[i].value();
            const bool still = !p.requires_grad() || name.rfind("idle.", 0) == 0;
            if (still) {
              EXPECT_TRUE(torch::equal(p, initial[i]))
                  << name << " on rank " << comm->rank() << " moved by "
                  << (p - initial[i]).abs().max().item<float>() << "; one process leaves it";
              EXPECT_FALSE(p.grad().defined()) << name << " on rank " << comm->rank();
            } else {
              EXPECT_TRUE(torch::allclose(p, ref[i], 1e-5, 1e-6))
                  << name << " on rank " << comm->rank() << " differs from one process by "
                  << (p - ref[i]).abs().max().item<float>();
            }
          }
        },
        testing::options_for(c));
  }
};

TEST_P(FrozenParameters, AFrozenLayerStaysAsItWasAndTheRestMatchesOneProcess) { check(true); }

TEST_P(FrozenParameters, ALayerNoRankUsesStaysAsItWasAndTheRestMatchesOneProcess) { check(false); }

INSTANTIATE_TEST_SUITE_P(EngineWorlds, FrozenParameters,
                         ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

// average_gradients itself: a gradient on rank 0 only is averaged with the
// others' zeros (1 / world everywhere); one on every rank (rank + 1) becomes
// (world + 1) / 2; one on no rank and a frozen parameter's stay undefined.
class AverageGradients : public ::testing::TestWithParam<Case> {};

TEST_P(AverageGradients, MissingOnSomeRanksCountsAsZeroMissingEverywhereStaysUndefined) {
  const Case c = GetParam();
  testing::run_ranks(
      c.world,
      [&](Communicator& comm) {
        auto some = torch::zeros({3}, torch::requires_grad());
        auto none = torch::zeros({2}, torch::requires_grad());
        auto frozen = torch::zeros({4});
        auto all = torch::zeros({5}, torch::requires_grad());
        if (comm.rank() == 0) some.mutable_grad() = torch::ones({3});
        all.mutable_grad() = torch::full({5}, comm.rank() + 1.0);
        average_gradients({some, none, frozen, all}, comm);
        const int r = comm.rank();
        ASSERT_TRUE(some.grad().defined()) << "rank " << r;
        EXPECT_TRUE(torch::allclose(some.grad(), torch::full({3}, 1.0 / c.world)))
            << "rank " << r << ": " << some.grad();
        EXPECT_FALSE(none.grad().defined()) << "rank " << r;
        EXPECT_FALSE(frozen.grad().defined()) << "rank " << r;
        EXPECT_TRUE(torch::allclose(all.grad(), torch::full({5}, (c.world + 1) / 2.0)))
            << "rank " << r << ": " << all.grad();
      },
      testing::options_for(c));
}

INSTANTIATE_TEST_SUITE_P(EngineWorlds, AverageGradients,
                         ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

// A pipeline of function stages, tanh(x w_s + b_s), each b_s frozen, under
// the pipeline wiring (its optimizer over runtime.parameters(), which lists
// frozen tensors too): the wiring registers each tensor for checkpoints and
// clipping and must leave b_s frozen, so b_s gets no gradient and stays as
// it was while w_s trains. pp 1 and 3, ranks as threads.
class PipelineFrozenTensor : public ::testing::TestWithParam<int> {};

TEST_P(PipelineFrozenTensor, StaysFrozenAndAsItWas) {
  const int pp = GetParam(), m = 2;
  constexpr int64_t width = 4;
  auto gen = testing::make_generator(5);
  const auto x = torch::randn({8 * m, width}, gen), y = torch::randn({8 * m, width}, gen);
  testing::run_ranks_shared(pp, [&](std::shared_ptr<Communicator> comm) {
    const int s = comm->rank();
    auto w = torch::full({width, width}, 0.1 * (s + 1)).requires_grad_(true);
    auto b = torch::full({width}, 0.2 * (s + 1));  // frozen
    const auto w0 = w.detach().clone(), b0 = b.clone();
    pipeline::PipelineStage stage(s,
                                  [w, b](const pipeline::Tensors& in) {
                                    return pipeline::Tensors{torch::tanh(in[0].matmul(w) + b)};
                                  },
                                  {w, b});
    auto mse = [](const pipeline::Tensors& out, const pipeline::Tensors& target) {
      return torch::nn::functional::mse_loss(out[0], target[0]);
    };
    pipeline::PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"), {std::move(stage)},
                                 pipeline::Schedule1F1B(pp, m), mse);
    ASSERT_EQ(rt.parameters().size(), 2u);
    torch::optim::SGD opt(rt.parameters(), 0.1);
    TrainerOptions config;
    config.accumulation_steps = m;
    config.progress = false;
    Trainer trainer(TrainerWiring::pipeline(rt, opt), config);
    TensorDataSource source(x, y, 4, 0, 1);
    EXPECT_FALSE(trainer.fit(source).empty());
    EXPECT_FALSE(b.requires_grad()) << "rank " << s;
    EXPECT_FALSE(b.grad().defined()) << "rank " << s;
    EXPECT_TRUE(torch::equal(b, b0))
        << "rank " << s << ": b moved by " << (b - b0).abs().max().item<float>();
    EXPECT_FALSE(torch::equal(w.detach(), w0)) << "rank " << s << ": w did not train";
  });
}

INSTANTIATE_TEST_SUITE_P(Pipeline, PipelineFrozenTensor, ::testing::Values(1, 3));

}  // namespace
}  // namespace cohort::frozen_parameters_test
