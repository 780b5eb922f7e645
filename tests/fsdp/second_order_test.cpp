// Gradients of gradients through a fully sharded model, ranks as threads
// over Gloo and UCX at worlds 1 to 3, against one process:
//
// - a backward with create_graph (loss.backward(create_graph=true), or
//   torch::autograd::grad with create_graph, a gradient penalty's first
//   half) is refused on every rank, naming create_graph: fully_shard frees
//   each unit's full parameters once its backward is over, and the graph
//   of the gradients it would build reads them again in a later backward.
//   The refusal changes nothing: training goes on as if the step had been
//   skipped (every parameter within 1e-6 of one process that skipped it);
// - torch::autograd::grad of the loss with respect to the input and a
//   unit's weight (no create_graph) is one process's for this rank's rows
//   (the weight's: its full gradient, not averaged over the ranks, as
//   cohort's checkpoint asks for a unit's parameters inside its backward),
//   and leaves the sharded gradients of a backward before it as they were
//   (each step: backward, then these gradients, then the optimizer step).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "cohort/core/error.h"
#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::second_order_test {
namespace {

using namespace fsdp_test;

constexpr int kRefusedStep = 3;

enum class Form { kBackward, kGrad };

// One process's gradient of the penalized loss at world 1 (the shard is the
// whole parameter there), for the message of a run that was not refused.
double penalty_error(FullyShard& model, const Named& before, const torch::Tensor& x,
                     const torch::Tensor& y) {
  auto twin = make_model(nullptr, {});
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : twin->named_parameters()) p.value().copy_(before[p.key()]);
  }
  auto xr = x.detach().clone().requires_grad_();
  auto out = twin->forward(xr);
  auto g = torch::autograd::grad({out.sum()}, {xr}, {}, true, true)[0];
  (torch::mse_loss(out, y) + g.square().mean()).backward();
  double worst = 0;
  const auto params = model->named_parameters();
  for (const auto& p : twin->named_parameters()) {
    const auto* mine = params.find(p.key());
    if (!mine || !mine->grad().defined() || mine->grad().sizes() != p.value().grad().sizes()) {
      return INFINITY;
    }
    const double scale = p.value().grad().abs().max().item<double>();
    worst = std::max(worst, (mine->grad() - p.value().grad()).abs().max().item<double>() / scale);
  }
  return worst;
}

class FSDPSecondOrder : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPSecondOrder, ABackwardWithCreateGraphIsRefusedOnEveryRankAndChangesNothing) {
  const auto c = GetParam();
  const auto b = make_batches(17);
  const auto want = reference(Opt::AdamW, b, kRefusedStep);
  for (auto form : {Form::kBackward, Form::kGrad}) {
    SCOPED_TRACE(form == Form::kBackward ? "backward(create_graph)" : "autograd::grad");
    RankStates got;
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          auto model = fully_shard(make_model(comm, {}), comm);
          auto twin = make_model(nullptr, {});
          init_parameters(*twin, 7);
          load_from(model, *twin);
          auto opt = make_optimizer(Opt::AdamW, model->parameters());
          const std::string who = "rank " + std::to_string(comm->rank());
          for (int s = 0; s < kSteps; ++s) {
            auto x = local(b.x[s], *comm), y = local(b.y[s], *comm);
            opt->zero_grad();
            if (s != kRefusedStep) {
              torch::mse_loss(model->forward(x), y).backward();
              opt->step();
              continue;
            }
            try {
              if (form == Form::kBackward) {
                torch::mse_loss(model->forward(x), y).backward({}, true, true);
              } else {
                const auto before = model->full_state_dict();
                auto xg = x.clone().requires_grad_();
                auto out = model->forward(xg);
                auto g = torch::autograd::grad({out.sum()}, {xg}, {}, true, true)[0];
                (torch::mse_loss(out, y) + g.square().mean()).backward();
                if (c.world == 1) {
                  ADD_FAILURE() << "not refused; the penalized gradient differs from one "
                                   "process's by "
                                << penalty_error(model, before, x, y) << " (relative)";
                }
              }
              ADD_FAILURE() << who << ": not refused";
            } catch (const InvalidArgument& e) {
              EXPECT_NE(std::string(e.what()).find("create_graph"), std::string::npos) << e.what();
            }
          }
          got.keep(comm->rank(), model->full_state_dict());
        },
        options_for(c));
    got.expect_close_to(want, 1e-6);
  }
}

TEST_P(FSDPSecondOrder, TheInputsGradientIsOneProcesssAndLeavesTheShardedGradientsAlone) {
  const auto c = GetParam();
  const auto b = make_batches(19);
  // One process: each step's input gradient, and the parameters at the end.
  std::vector<torch::Tensor> want_dx;
  std::vector<std::vector<torch::Tensor>> want_dw(kSteps);  // per step, per rank
  Named want;
  {
    auto model = make_model(nullptr, {});
    init_parameters(*model, 7);
    auto opt = make_optimizer(Opt::AdamW, model->parameters());
    for (int s = 0; s < kSteps; ++s) {
      opt->zero_grad();
      torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
      auto x = b.x[s].clone().requires_grad_();
      want_dx.push_back(
          torch::autograd::grad({torch::mse_loss(model->forward(x), b.y[s])}, {x})[0]);
      const int64_t n = kBatch / c.world;
      for (int r = 0; r < c.world; ++r) {
        auto loss =
            torch::mse_loss(model->forward(b.x[s].narrow(0, r * n, n)), b.y[s].narrow(0, r * n, n));
        want_dw[s].push_back(
            torch::autograd::grad({loss}, {model->named_parameters()["2.weight"]})[0]);
      }
      opt->step();
    }
    for (const auto& p : model->named_parameters()) want.insert(p.key(), p.value().clone());
  }
  RankStates got;
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto model = fully_shard(make_model(comm, {}), comm);
        auto twin = make_model(nullptr, {});
        init_parameters(*twin, 7);
        load_from(model, *twin);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        for (int s = 0; s < kSteps; ++s) {
          auto x = local(b.x[s], *comm), y = local(b.y[s], *comm);
          opt->zero_grad();
          torch::mse_loss(model->forward(x), y).backward();
          auto xg = x.clone().requires_grad_();
          auto w = model->named_parameters()["2.weight"];
          auto grads = torch::autograd::grad({torch::mse_loss(model->forward(xg), y)}, {xg, w});
          // The local mean's gradient is world times the global mean's.
          auto dx = local(want_dx[s], *comm) * comm->size();
          const auto& dw = want_dw[s][comm->rank()];
          const std::string where =
              "step " + std::to_string(s) + " rank " + std::to_string(comm->rank());
          EXPECT_LE((grads[0] - dx).abs().max().item<double>(),
                    1e-6 * dx.abs().max().item<double>())
              << where;
          ASSERT_EQ(grads[1].sizes(), dw.sizes()) << where;
          EXPECT_LE((grads[1] - dw).abs().max().item<double>(),
                    1e-6 * dw.abs().max().item<double>())
              << where;
          opt->step();
        }
        got.keep(comm->rank(), model->full_state_dict());
      },
      options_for(c));
  got.expect_close_to(want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPSecondOrder, ::testing::ValuesIn(engine_worlds({1, 2, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::second_order_test
