// Stages whose layers share a parameter (the same Linear used twice, a
// tied weight) against one process: LibTorch's parameters() lists such a
// tensor twice, and ZB-H1's per-layer W would count the earlier layer's
// use again. Every schedule, pp 1 to 3, ranks as threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/tensor_checks.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline::shared_parameter_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::run_ranks_shared;

using cohort::testing::expect_close;

// Stage s is (L_s, Tanh, L_s, Tanh): one Linear applied twice.
torch::nn::Sequential make_reused(int stages) {
  torch::nn::Sequential seq;
  torch::NoGradGuard no_grad;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Linear lin(kWidth, kWidth);
    lin->weight.copy_(det({kWidth, kWidth}, s) * 0.8);
    lin->bias.copy_(det({kWidth}, 10 + s));
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

std::vector<int64_t> reused_boundaries(int stages) {
  std::vector<int64_t> b;
  for (int s = 1; s < stages; ++s) b.push_back(4 * s);
  return b;
}

struct Case {
  std::string schedule;
  int pp, v;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.schedule + "_pp" + std::to_string(info.param.pp) + "_v" +
         std::to_string(info.param.v);
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int pp : {1, 2, 3}) {
    for (const char* s : {"gpipe", "1f1b", "zbh1"}) out.push_back({s, pp, 1});
    if (pp > 1) out.push_back({"interleaved", pp, 2});
  }
  return out;
}

// The case against one process. With `frozen_while_building` the
// parameters are frozen while the stages are built and unfrozen before the
// step: whether a stage may run a W per layer depends on which layers hold
// the same tensor, not on what required grad at construction.
void check_against_one_process(const Case& c, bool frozen_while_building) {
  const int stages = c.pp * c.v, m = 2 * c.pp;
  const auto x = det({2 * m, kWidth}, 0.3), y = det({2 * m, kWidth}, 1.1);
  // One process, plain LibTorch: each Linear's gradient once.
  std::vector<torch::Tensor> ref;
  {
    auto model = make_reused(stages);
    torch::nn::functional::mse_loss(model->forward(x), y).backward();
    for (int s = 0; s < stages; ++s) {
      auto lin = model[4 * s]->as<torch::nn::Linear>();
      ref.push_back(lin->weight.grad().clone());
      ref.push_back(lin->bias.grad().clone());
    }
  }
  run_ranks_shared(c.pp, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto schedule = make_schedule(c.schedule, c.pp, c.v, m);
    auto model = make_reused(stages);
    if (frozen_while_building)
      for (auto p : model->parameters()) p.requires_grad_(false);
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(comm->rank())) {
      mine.emplace_back(s, split_sequential(model, reused_boundaries(stages), s));
      EXPECT_EQ(mine.back().parameters().size(), 2u) << "stage " << s << ": each tensor once";
    }
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
    if (frozen_while_building)
      for (auto p : model->parameters()) p.requires_grad_(true);
    rt.step({x}, {y});
    for (int s : schedule.stages_of(comm->rank())) {
      auto lin = model[4 * s]->as<torch::nn::Linear>();
      expect_close(lin->weight.grad(), ref[2 * s], "stage " + std::to_string(s) + " weight");
      expect_close(lin->bias.grad(), ref[2 * s + 1], "stage " + std::to_string(s) + " bias");
    }
  });
}

class SharedParameters : public ::testing::TestWithParam<Case> {};

TEST_P(SharedParameters, GradientsMatchOneProcess) { check_against_one_process(GetParam(), false); }

TEST_P(SharedParameters, UnfrozenAfterConstructionGradientsMatchOneProcess) {
  check_against_one_process(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Schedules, SharedParameters, ::testing::ValuesIn(all_cases()), case_name);

// A function stage given the same tensor twice adds its gradient once.
TEST(SharedParametersFunctionStage, TensorListedTwiceGetsItsGradientOnce) {
  const int m = 2;
  const auto x = det({4, kWidth}, 0.3), y = det({4, kWidth}, 1.1);
  const auto w0 = det({kWidth, kWidth}, 2.0);
  torch::Tensor ref;
  {
    auto w = w0.clone().requires_grad_(true);
    torch::nn::functional::mse_loss(torch::tanh(x.matmul(w)), y).backward();
    ref = w.grad().clone();
  }
  for (const char* name : {"1f1b", "zbh1"}) {
    run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
      auto w = w0.clone().requires_grad_(true);
      PipelineStage stage(
          0, [w](const Tensors& in) { return Tensors{torch::tanh(in[0].matmul(w))}; }, {w, w});
      EXPECT_EQ(stage.parameters().size(), 1u);
      PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), {std::move(stage)},
                         make_schedule(name, 1, 1, m), mse);
      rt.step({x}, {y});
      expect_close(w.grad(), ref, name);
    });
  }
}

}  // namespace
}  // namespace cohort::pipeline::shared_parameter_test
