// Parameters frozen or unfrozen after the stages are built (a backbone
// frozen for warm-up, then fine-tuned) against one process: each step
// differentiates what requires grad at that step. Every schedule, pp 1 to 3,
// Sequential and function stages, ranks as threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/tensor_checks.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline::frozen_parameter_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::run_ranks_shared;

using cohort::testing::expect_close;

struct Case {
  std::string schedule;
  int pp, v;
  bool function_stages;  // else Sequential stages (ZB-H1: a W per layer)
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.schedule + "_pp" + std::to_string(c.pp) + "_v" + std::to_string(c.v) +
         (c.function_stages ? "_function" : "_sequential");
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (bool fn : {false, true})
    for (int pp : {1, 2, 3}) {
      for (const char* s : {"gpipe", "1f1b", "zbh1"}) out.push_back({s, pp, 1, fn});
      if (pp > 1) out.push_back({"interleaved", pp, 2, fn});
    }
  return out;
}

// One run of the case: `before` runs between building the model and
// building the stages, `after` between building the runtime and its step;
// `check` then looks at this rank's stages (parameters 2s, 2s+1 of
// model->parameters() are stage s's weight and bias).
using Hook = std::function<void(const std::vector<torch::Tensor>& params)>;
using Check = std::function<void(const std::vector<torch::Tensor>& params, int stage,
                                 const PipelineRuntime& rt)>;

void run_case(const Case& c, const torch::Tensor& x, const torch::Tensor& y, const Hook& before,
              const Hook& after, const Check& check) {
  const int stages = c.pp * c.v, m = 2 * c.pp;
  run_ranks_shared(c.pp, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto schedule = make_schedule(c.schedule, c.pp, c.v, m);
    auto model = make_mlp(stages);
    const auto params = model->parameters();
    before(params);
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(comm->rank())) {
      auto seq = split_sequential(model, mlp_boundaries(stages), s);
      if (c.function_stages)
        mine.emplace_back(
            s, [seq](const Tensors& in) mutable { return Tensors{seq->forward(in[0])}; },
            seq->parameters(), seq.ptr());
      else
        mine.emplace_back(s, seq);
    }
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
    after(params);
    rt.step({x}, {y});
    for (int s : schedule.stages_of(comm->rank())) check(params, s, rt);
  });
}

class FrozenParameters : public ::testing::TestWithParam<Case> {};

// Frozen when the stages are built, unfrozen before the step: the step
// gives every parameter the one-process gradient, and the runtime's
// parameters() (what an optimizer is built over) lists them all.
TEST_P(FrozenParameters, UnfrozenAfterConstructionGetsItsGradient) {
  const Case c = GetParam();
  const int stages = c.pp * c.v, m = 2 * c.pp;
  const auto x = det({2 * m, kWidth}, 0.3), y = det({2 * m, kWidth}, 1.1);
  const Reference ref = reference_run(stages, x, y, m);
  auto set_all = [](bool on) {
    return [on](const std::vector<torch::Tensor>& ps) {
      for (auto p : ps) p.requires_grad_(on);
    };
  };
  run_case(c, x, y, set_all(false), set_all(true),
           [&](const std::vector<torch::Tensor>& ps, int s, const PipelineRuntime& rt) {
             EXPECT_EQ(rt.parameters().size(), 2u * rt.stages().size());
             for (int k : {2 * s, 2 * s + 1})
               expect_close(ps[k].grad(), ref.grads[k],
                            "stage " + std::to_string(s) + " param " + std::to_string(k));
           });
}

// Trainable when the stages are built, frozen before the step (every
// weight, and with several stages stage 0's bias: stage 0 then has nothing
// to differentiate):
// no error, no gradient for the frozen ones, the one-process gradient for
// the rest (freezing a parameter changes no other parameter's gradient).
TEST_P(FrozenParameters, FrozenAfterConstructionGetsNoGradient) {
  const Case c = GetParam();
  const int stages = c.pp * c.v, m = 2 * c.pp;
  const auto x = det({2 * m, kWidth}, 0.3), y = det({2 * m, kWidth}, 1.1);
  const Reference ref = reference_run(stages, x, y, m);
  auto frozen = [stages](int k) { return k % 2 == 0 || (k == 1 && stages > 1); };
  run_case(
      c, x, y, [](const std::vector<torch::Tensor>&) {},
      [&](const std::vector<torch::Tensor>& ps) {
        for (size_t k = 0; k < ps.size(); ++k)
          if (frozen(static_cast<int>(k))) ps[k].requires_grad_(false);
      },
      [&](const std::vector<torch::Tensor>& ps, int s, const PipelineRuntime& rt) {
        EXPECT_EQ(rt.parameters().size(), 2u * rt.stages().size());
        for (int k : {2 * s, 2 * s + 1}) {
          const std::string what = "stage " + std::to_string(s) + " param " + std::to_string(k);
          if (frozen(k))
            EXPECT_FALSE(ps[k].grad().defined()) << what << " is frozen";
          else
            expect_close(ps[k].grad(), ref.grads[k], what);
        }
      });
}

INSTANTIATE_TEST_SUITE_P(Schedules, FrozenParameters, ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace cohort::pipeline::frozen_parameter_test
