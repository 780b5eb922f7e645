// A stage whose output shape does not follow from stage 0's input shape (it
// changes between the micro-batches of one step, or between two steps with
// the same input shape) is not supported: the rank sending it refuses the
// send, and every rank of the pipeline gets that refusal at the step's end,
// within the step's own time, never a wait for the timeout. The next step
// (every stage's output back to its shape) matches one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <ostream>
#include <sstream>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/rank_errors.h"
#include "support/tensor_checks.h"

namespace cohort::pipeline::shape_change_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::errors_on_every_rank;
using cohort::testing::expect_close;
using cohort::testing::kNoError;

enum class Change { WithinAStep, BetweenSteps };

void PrintTo(Change c, std::ostream* os) {
  *os << (c == Change::WithinAStep ? "WithinAStep" : "BetweenSteps");
}

// make_schedule's name, pp, what changes.
using Case = std::tuple<std::string, int, Change>;

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::ostringstream change;
  PrintTo(std::get<2>(info.param), &change);
  return std::get<0>(info.param) + "_pp" + std::to_string(std::get<1>(info.param)) + "_" +
         change.str();
}

class ShapeChange : public ::testing::TestWithParam<Case> {};

// Stage 0 (rank 0, sending to stage 1 on rank 1) is the MLP's first block
// as a function stage that drops its output's last row in some calls. Its
// F runs micro-batches in order, so call k of step i is micro-batch k - i·m.
// WithinAStep: step 0's micro-batch 1 is one row short. BetweenSteps: step
// 0 is whole, every micro-batch of step 1 (same input shape) is short. The
// last step is whole again.
TEST_P(ShapeChange, IsAnErrorOnEveryRankThenTheNextStepTrains) {
  const auto [name, pp, change] = GetParam();
  const int v = name == "interleaved" ? 2 : 1, stages = pp * v;
  const int m = name == "interleaved" ? pp : 2;
  const auto x = det({2 * m, kWidth}, 0.3), y = det({2 * m, kWidth}, 1.1);
  const Reference ref = reference_run(stages, x, y, m);
  const int refused_step = change == Change::WithinAStep ? 0 : 1;
  const int refused_mb = change == Change::WithinAStep ? 1 : 0;
  auto short_call = [m, change](int call) {
    return change == Change::WithinAStep ? call == 1 : call / m == 1;
  };
  std::vector<std::string> refused(pp);
  std::vector<double> seconds(pp);
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto schedule = make_schedule(name, pp, v, m);
    auto model = make_mlp(stages);
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(r)) {
      auto layers = split_sequential(model, mlp_boundaries(stages), s);
      if (s > 0) {
        mine.emplace_back(s, layers);
        continue;
      }
      auto calls = std::make_shared<int>(0);
      mine.emplace_back(
          0,
          [layers, calls, short_call](const Tensors& in) mutable {
            auto out = layers->forward(in[0]);
            return Tensors{short_call((*calls)++) ? out.narrow(0, 0, out.size(0) - 1) : out};
          },
          layers->parameters());
    }
    PipelineOptions o;
    o.timeout = std::chrono::seconds(2);
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse,
                       o);
    const auto params = model->parameters();
    for (int step = 0; step <= refused_step + 1; ++step) {
      model->zero_grad();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        auto result = rt.step({x}, {y});
        for (int mb = 0; mb < m; ++mb)
          EXPECT_NEAR(result.losses[mb], ref.losses[mb], 1e-5) << "step " << step << " mb " << mb;
        for (int s : schedule.stages_of(r))
          for (int k : {2 * s, 2 * s + 1})
            expect_close(params[k].grad(), ref.grads[k],
                         "step " + std::to_string(step) + " parameter " + std::to_string(k));
      } catch (const InvalidArgument& e) {
        refused[r] = e.what();
        seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_EQ(step, refused_step) << e.what();
      }
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(pp, kNoError));
  const std::string what = "stage 0 on rank 0, sending micro-batch " + std::to_string(refused_mb) +
                           " to rank 1: outputs [Float[1, 6]], expected [Float[2, 6]]";
  for (int r = 0; r < pp; ++r) {
    const auto& e = refused[static_cast<size_t>(r)];
    EXPECT_NE(e.find("PipelineRuntime on rank " + std::to_string(r) + " of group"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find(what), std::string::npos) << e << "\nexpected: " << what;
    // A wait for a message that never comes ends at the 2 s timeout.
    EXPECT_LT(seconds[static_cast<size_t>(r)], 1.0) << "rank " << r << ": " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, ShapeChange,
    ::testing::Combine(::testing::Values("gpipe", "1f1b", "zbh1", "interleaved"),
                       ::testing::Values(2, 3),
                       ::testing::Values(Change::WithinAStep, Change::BetweenSteps)),
    case_name);

}  // namespace
}  // namespace cohort::pipeline::shape_change_test
