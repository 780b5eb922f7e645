// Gradients that autograd passes through unchanged: for out = h + P,
// torch::autograd::grad returns one tensor as the gradient of h and of P.
// The runtime keeps h's as the stage's input gradient until the previous
// stage or SEND_B takes it, and adds later micro-batches into P's .grad, so
// the two must not share storage. Orders that leave a micro-batch's input
// gradient waiting while the next one's backward runs, B and I/W, against
// one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/tensor_checks.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline::aliased_gradient_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::run_ranks_shared;

using cohort::testing::expect_close;

// A learned offset of one micro-batch's shape, as a layer: x + p.
struct OffsetImpl : torch::nn::Module {
  explicit OffsetImpl(const torch::Tensor& init) { p = register_parameter("p", init.clone()); }
  torch::Tensor forward(const torch::Tensor& x) { return x + p; }
  torch::Tensor p;
};

struct Case {
  std::string name;
  bool offset_layer;  // stage 1 a Sequential (W per layer), else a function
  std::string order;  // rank 0's actions
};

std::vector<Case> all_cases() {
  const std::string forward = "0F0 1F0 0F1 1F1 ";
  return {{"B_consumed_at_once", false, forward + "1B0 0B0 1B1 0B1"},
          {"B_input_grad_waits", false, forward + "1B0 1B1 0B0 0B1"},
          {"B_input_grad_waits_layer", true, forward + "1B0 1B1 0B0 0B1"},
          {"IW_function", false, forward + "1I0 1I1 0B0 0B1 1W0 1W1"},
          {"IW_input_grad_waits_layer", true, forward + "1I0 1W0 1I1 1W1 0B0 0B1"}};
}

class AliasedGradients : public ::testing::TestWithParam<Case> {};

// Stage 0: tanh(x W). Stage 1: h + P. Two stages on one rank, m = 2.
TEST_P(AliasedGradients, MatchOneProcess) {
  const Case c = GetParam();
  const int m = 2, n = 3;
  const auto x = det({m * n, kWidth}, 0.3), y = det({m * n, kWidth}, 1.1);
  const auto w0 = det({kWidth, kWidth}, 2.0), p0 = det({n, kWidth}, 0.7);
  torch::Tensor ref_w, ref_p;
  {
    auto w = w0.clone().requires_grad_(true), p = p0.clone().requires_grad_(true);
    torch::nn::functional::mse_loss(torch::tanh(x.matmul(w)) + p.repeat({m, 1}), y).backward();
    ref_w = w.grad().clone(), ref_p = p.grad().clone();
  }
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto w = w0.clone().requires_grad_(true);
    auto offset = std::make_shared<OffsetImpl>(p0);
    auto p = offset->p;
    std::vector<PipelineStage> stages;
    stages.emplace_back(
        0, [w](const Tensors& in) { return Tensors{torch::tanh(in[0].matmul(w))}; },
        std::vector<torch::Tensor>{w});
    if (c.offset_layer)
      stages.emplace_back(1, torch::nn::Sequential(offset));
    else
      stages.emplace_back(
          1, [p](const Tensors& in) { return Tensors{in[0] + p}; }, std::vector<torch::Tensor>{p});
    auto schedule =
        parse_schedule("schedule custom stages 2 microbatches 2 map 0 0\nrank 0: " + c.order);
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(stages), schedule,
                       mse);
    rt.step({x}, {y});
    expect_close(w.grad(), ref_w, "stage 0 weight");
    expect_close(p.grad(), ref_p, "stage 1 offset");
  });
}

INSTANTIATE_TEST_SUITE_P(Orders, AliasedGradients, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace cohort::pipeline::aliased_gradient_test
