// StageExecutor's slot states: one (stage, micro-batch) through F, I, the
// hand-over of its input gradients and W, and the transitions it refuses
// (internal errors naming the slot and both states, never a silent step).
#include "cohort/pipeline/stage_executor.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "cohort/core/error.h"

namespace cohort::pipeline::stage_executor_test {
namespace {

// y = x * p with one scalar parameter p = 1.
PipelineStage scale_stage(int index, const torch::Tensor& p) {
  return PipelineStage(index, [p](const Tensors& in) { return Tensors{in[0] * p}; }, {p});
}

// Two stages on one rank, one micro-batch, stage 1 split into I and W.
struct TwoStages {
  torch::Tensor p0 = torch::ones({}, torch::requires_grad());
  torch::Tensor p1 = torch::ones({}, torch::requires_grad());
  std::vector<PipelineStage> stages{scale_stage(0, p0), scale_stage(1, p1)};
  PipelineSchedule schedule;
  PipelineLossFn loss = [](const Tensors& out, const Tensors&) { return out[0].sum(); };
  TwoStages() {
    schedule.num_ranks = 1, schedule.num_stages = 2, schedule.num_microbatches = 1;
    schedule.stage_to_rank = {0, 0};
    schedule.actions = {{{0, ActionType::Forward, 0},
                         {1, ActionType::Forward, 0},
                         {1, ActionType::BackwardInput, 0},
                         {0, ActionType::Backward, 0},
                         {1, ActionType::BackwardWeight, 0}}};
  }
  StageExecutor executor() {
    StageExecutor ex(stages, schedule, 0, loss);
    ex.begin_step({{torch::full({2}, 3.0)}}, {{}});
    return ex;
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(StageExecutor, SlotStatesFollowTheActions) {
  TwoStages t;
  StageExecutor ex = t.executor();
  EXPECT_EQ(ex.state(0, 0), SlotState::Free);
  ex.forward(0, 0);
  ex.forward(1, 0);
  EXPECT_EQ(ex.state(0, 0), SlotState::Forwarded);
  EXPECT_EQ(ex.state(1, 0), SlotState::Forwarded);
  ex.backward(1, 0, /*full=*/false);
  EXPECT_EQ(ex.state(1, 0), SlotState::WeightsAndGrads);
  ex.backward(0, 0, /*full=*/true);  // takes stage 1's input gradients
  EXPECT_EQ(ex.state(0, 0), SlotState::Free);
  EXPECT_EQ(ex.state(1, 0), SlotState::Weights);
  ex.backward_weight(1, 0);
  EXPECT_EQ(ex.state(1, 0), SlotState::Free);
  EXPECT_NO_THROW(ex.end_step());
  EXPECT_EQ(ex.peak_live(), 2);
  // loss = sum(3 * p0 * p1) over 2 elements: each gradient 6 at p = 1.
  EXPECT_DOUBLE_EQ(t.p0.grad().item<double>(), 6.0);
  EXPECT_DOUBLE_EQ(t.p1.grad().item<double>(), 6.0);
  EXPECT_DOUBLE_EQ(ex.losses().losses.at(0), 6.0);
}

TEST(StageExecutor, WrongTransitionsAreInternalErrorsNamingSlotAndStates) {
  TwoStages t;
  StageExecutor ex = t.executor();
  EXPECT_NE(error_of([&] { ex.backward_weight(1, 0); })
                .find("W of stage 1 micro-batch 0 found its slot Free, expected "
                      "WeightsAndGrads or Weights"),
            std::string::npos);
  ex.forward(0, 0);
  EXPECT_NE(error_of([&] {
              ex.forward(0, 0);
            }).find("F of stage 0 micro-batch 0 found its slot Forwarded, expected Free"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ex.take_input_grads(0, 0); })
                .find("stage 0 micro-batch 0 found its slot Forwarded, expected Grads or "
                      "WeightsAndGrads"),
            std::string::npos);
  const std::string ended = error_of([&] { ex.end_step(); });
  EXPECT_NE(ended.find("cohort internal error"), std::string::npos) << ended;
  EXPECT_NE(ended.find("stage 0 micro-batch 0 in state Forwarded, expected Free"),
            std::string::npos)
      << ended;
  EXPECT_EQ(ex.state(0, 0), SlotState::Free);  // end_step dropped it
}

}  // namespace
}  // namespace cohort::pipeline::stage_executor_test
