// PipelineRuntime refusing what would not train: a loss outside autograd or
// not a scalar. Each is an exception on every rank of the pipeline, named,
// never a silent step or a timeout.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/rank_errors.h"

namespace cohort::pipeline {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::errors_on_every_rank;
using cohort::testing::kNoError;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class LossWithoutGrad : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// The loss function detaches its input: before, the step succeeded and no
// parameter got a gradient.
TEST_P(LossWithoutGrad, IsAnErrorOnEveryRank) {
  const auto [name, pp] = GetParam();
  const int m = 2;
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_mlp(pp);
    const int r = comm->rank();
    PipelineRuntime rt(comm, {PipelineStage(r, split_sequential(model, mlp_boundaries(pp), r))},
                       make_schedule(name, pp, 1, m), [](const Tensors& out, const Tensors& y) {
                         return mse(Tensors{out[0].detach()}, y);
                       });
    rt.step({det({2 * m, kWidth}, 0)}, {det({2 * m, kWidth}, 1)});
  });
  const std::string last = std::to_string(pp - 1);
  for (int r = 0; r < pp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of group")) << e;
    EXPECT_TRUE(has(e, "the loss of stage " + last + " micro-batch 0 (on rank " + last +
                           ") does not require grad"))
        << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, LossWithoutGrad,
                         ::testing::Combine(::testing::Values("1f1b", "zbh1"),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_pp" +
                                  std::to_string(std::get<1>(info.param));
                         });

// A loss of several elements: the same refusal on every rank (before, only
// the last stage's rank threw and the others waited for its gradients).
TEST(LossNotAScalar, IsAnErrorOnEveryRank) {
  for (int pp : {1, 3}) {
    auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
      auto model = make_mlp(pp);
      const int r = comm->rank();
      PipelineRuntime rt(comm, {PipelineStage(r, split_sequential(model, mlp_boundaries(pp), r))},
                         Schedule1F1B(pp, 2), [](const Tensors& out, const Tensors& y) {
                           return (out[0] - y[0]).pow(2).mean(1);  // one loss per row
                         });
      rt.step({det({4, kWidth}, 0)}, {det({4, kWidth}, 1)});
    });
    const std::string last = std::to_string(pp - 1);
    for (int r = 0; r < pp; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of group")) << e;
      EXPECT_TRUE(has(e, "the loss function returned 2 elements for stage " + last +
                             " micro-batch 0 (on rank " + last + "), not a scalar"))
          << e;
    }
  }
}

}  // namespace
}  // namespace cohort::pipeline
