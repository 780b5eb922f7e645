// Gradients of gradients through DDP, ranks as threads over Gloo and UCX at
// worlds 1 to 3, against one process on the whole batch:
//
// - an input-gradient penalty (torch::autograd::grad of the output with
//   respect to the input with create_graph, its square's mean added to the
//   loss, then backward): the penalty's graph is the rank's own, and the
//   backward through it is reduced as any other, so after a few SGD steps
//   every rank's parameters are one process's (within 1e-6);
// - a backward with create_graph (loss.backward(create_graph=true), e.g.
//   a penalty on the parameters' gradient norm) is refused on every rank,
//   naming create_graph: the averaged .grad DDP writes back has no graph
//   of the other ranks' gradients, so such a penalty would train on this
//   rank's curvature alone. The refusal changes nothing: training goes on
//   as if the step had been skipped.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "support/engine_worlds.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::ddp_second_order_test {
namespace {

using Mlp = torch::nn::Sequential;

constexpr int kSteps = 4;
constexpr int64_t kRows = 6;  // divides among 1, 2 and 3 ranks
constexpr int kRefusedStep = 2;
constexpr double kPenalty = 0.5;

enum class Form { kInputPenalty, kGradNormPenalty };

using Mode = DdpMode;

std::vector<Mode> modes() { return ddp_bucket_modes(); }

struct Data {
  std::vector<torch::Tensor> init;
  torch::Tensor x, y;  // [steps, rows, features]
};

Data make_data() {
  torch::manual_seed(11);
  Data d;
  d.init = clone_all(make_ddp_mlp()->parameters());
  d.x = torch::randn({kSteps, kRows, 8});
  d.y = torch::randn({kSteps, kRows, 4});
  return d;
}

// One step's loss on these rows, with its penalty; `forward` is the model's.
template <typename Forward>
void penalized_backward(Forward&& forward, const std::vector<torch::Tensor>& params, Form form,
                        const torch::Tensor& x, const torch::Tensor& y) {
  if (form == Form::kInputPenalty) {
    auto xg = x.clone().requires_grad_();
    auto out = forward(xg);
    auto g = torch::autograd::grad({out.sum()}, {xg}, {}, true, true)[0];
    (torch::mse_loss(out, y) + kPenalty * g.square().mean()).backward();
    return;
  }
  torch::mse_loss(forward(x), y).backward({}, true, true);
  auto norm = torch::zeros({});
  for (const auto& p : params) norm = norm + p.grad().square().sum();
  (kPenalty * norm).backward();
}

// `skip`: the step one process leaves out (the one DDP refuses), or -1.
std::vector<torch::Tensor> one_process(const Data& d, Form form, int skip) {
  auto net = make_ddp_mlp();
  copy_parameters(*net, d.init);
  torch::optim::SGD opt(net->parameters(), 0.1);
  for (int s = 0; s < kSteps; ++s) {
    if (s == skip) continue;
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    penalized_backward([&](const torch::Tensor& x) { return net->forward(x); }, net->parameters(),
                       form, d.x[s], d.y[s]);
    opt.step();
  }
  return clone_all(net->parameters());
}

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<std::string> thrown;  // "step s: what" of each refused step
};

// `refused`: the step that takes the gradient-norm penalty instead, or -1.
Trained train(const Data& d, const Mode& mode, int refused,
              const std::shared_ptr<Communicator>& comm) {
  auto net = make_ddp_mlp();
  copy_parameters(*net, d.init);
  DistributedDataParallel<Mlp> ddp(net, comm, mode.options);
  torch::optim::SGD opt(ddp.parameters(), 0.1);
  const int64_t n = kRows / comm->size();
  Trained out;
  for (int s = 0; s < kSteps; ++s) {
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    try {
      penalized_backward([&](const torch::Tensor& x) { return ddp.forward(x); }, net->parameters(),
                         s == refused ? Form::kGradNormPenalty : Form::kInputPenalty,
                         d.x[s].narrow(0, comm->rank() * n, n),
                         d.y[s].narrow(0, comm->rank() * n, n));
      opt.step();
    } catch (const InvalidArgument& e) {
      out.thrown.push_back("step " + std::to_string(s) + ": InvalidArgument: " + e.what());
    } catch (const std::exception& e) {
      out.thrown.push_back("step " + std::to_string(s) + ": " +
                           std::string(e.what()).substr(0, 160));
    }
  }
  out.params = clone_all(net->parameters());
  return out;
}

class DdpSecondOrder : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DdpSecondOrder, AnInputGradientPenaltyIsOneProcesss) {
  const auto c = GetParam();
  const auto d = make_data();
  const auto want = one_process(d, Form::kInputPenalty, -1);
  for (const auto& mode : modes()) {
    auto got = results_of_ranks<Trained>(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          return train(d, mode, -1, comm);
        },
        options_for(c));
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world)) << mode.name;
    for (const auto& [rank, trained] : got) {
      const std::string where = mode.name + ", rank " + std::to_string(rank);
      EXPECT_TRUE(trained.thrown.empty()) << where << ": " << trained.thrown.front();
      EXPECT_LT(max_abs_diff(trained.params, want), 1e-6) << where;
    }
  }
}

TEST_P(DdpSecondOrder, ABackwardWithCreateGraphIsRefusedOnEveryRankAndChangesNothing) {
  const auto c = GetParam();
  const auto d = make_data();
  const auto want = one_process(d, Form::kInputPenalty, kRefusedStep);
  for (const auto& mode : modes()) {
    auto got = results_of_ranks<Trained>(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          return train(d, mode, kRefusedStep, comm);
        },
        options_for(c));
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world)) << mode.name;
    for (const auto& [rank, trained] : got) {
      const std::string where = mode.name + ", rank " + std::to_string(rank);
      ASSERT_EQ(trained.thrown.size(), 1u)
          << where << ": " << ::testing::PrintToString(trained.thrown);
      const auto& what = trained.thrown[0];
      EXPECT_EQ(what.rfind("step " + std::to_string(kRefusedStep) + ": InvalidArgument: ", 0), 0u)
          << where << ": " << what;
      EXPECT_NE(what.find("create_graph"), std::string::npos) << where << ": " << what;
      EXPECT_LT(max_abs_diff(trained.params, want), 1e-6) << where;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpSecondOrder, ::testing::ValuesIn(engine_worlds({1, 2, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::ddp_second_order_test
