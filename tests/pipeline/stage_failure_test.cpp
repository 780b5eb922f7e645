// A stage that throws (its forward, the last stage's loss function, its
// backward) or an output too large to describe in a shape message: every
// rank of the pipeline gets one error at the step's end, within the step's
// own time, naming the failing stage, its rank and the micro-batch with the
// original message. Never a wait for the receive timeout on the other
// ranks. The failed step leaves no gradient, and the next step matches one
// process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <ostream>
#include <sstream>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/rank_errors.h"
#include "support/tensor_checks.h"

namespace cohort::pipeline::stage_failure_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::errors_on_every_rank;
using cohort::testing::expect_close;
using cohort::testing::kNoError;

enum class Where { FirstForward, Forward, Loss, Backward, LaterStep };

const char* where_name(Where w) {
  switch (w) {
    case Where::FirstForward:
      return "FirstForward";
    case Where::Forward:
      return "Forward";
    case Where::Loss:
      return "Loss";
    case Where::Backward:
      return "Backward";
    case Where::LaterStep:
      return "LaterStep";
  }
  return "?";
}

void PrintTo(Where w, std::ostream* os) { *os << where_name(w); }

// make_schedule's name, pp, where the user's code throws.
using Case = std::tuple<std::string, int, Where>;

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::get<0>(info.param) + "_pp" + std::to_string(std::get<1>(info.param)) + "_" +
         where_name(std::get<2>(info.param));
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class StageFailure : public ::testing::TestWithParam<Case> {};

// The failing stage is stage 1 (stage 0 with one stage), a function stage
// over the MLP's block. Its F runs micro-batches in order, so in step 0 its
// call k is micro-batch k: FirstForward throws there at micro-batch 0 (no
// boundary shape known yet), Forward at micro-batch 1; Backward throws from
// a gradient hook of micro-batch 1's activations; Loss from the loss
// function at micro-batch 1; LaterStep from the forward of step 1's
// micro-batch 0, whose boundary shapes step 0 left known (receives posted
// ahead, no shape message). Each throws once: the step after is whole.
TEST_P(StageFailure, IsAnErrorOnEveryRankThenTheNextStepTrains) {
  const auto [name, pp, where] = GetParam();
  const int v = name == "interleaved" ? 2 : 1, stages = pp * v;
  const int m = name == "interleaved" && pp == 3 ? 3 : 2;
  const int failing = where == Where::Loss ? stages - 1 : std::min(1, stages - 1);
  const int failing_rank = failing % pp;
  const int failing_mb = where == Where::FirstForward || where == Where::LaterStep ? 0 : 1;
  const int failing_step = where == Where::LaterStep ? 1 : 0;
  const int failing_call = failing_step * m + failing_mb;
  const auto x = det({2 * m, kWidth}, 0.3), y = det({2 * m, kWidth}, 1.1);
  const Reference ref = reference_run(stages, x, y, m);
  std::vector<std::string> caught(pp), nested(pp);
  std::vector<double> seconds(pp);
  std::vector<int> stage_errors(pp, 0);
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto schedule = make_schedule(name, pp, v, m);
    auto model = make_mlp(stages);
    std::vector<PipelineStage> mine;
    auto armed = std::make_shared<bool>(true);
    for (int s : schedule.stages_of(r)) {
      auto layers = split_sequential(model, mlp_boundaries(stages), s);
      if (s != failing || where == Where::Loss) {
        mine.emplace_back(s, layers);
        continue;
      }
      auto calls = std::make_shared<int>(0);
      mine.emplace_back(
          s,
          [layers, calls, armed, where, failing_call](const Tensors& in) mutable {
            const bool now = *armed && (*calls)++ == failing_call;
            if (now && where != Where::Backward) {
              *armed = false;
              throw std::runtime_error("boom");
            }
            auto out = layers->forward(in[0]);
            if (now) {
              *armed = false;
              out.register_hook(
                  [](torch::Tensor) -> torch::Tensor { throw std::runtime_error("boom"); });
            }
            return Tensors{out * 1.0};
          },
          layers->parameters());
    }
    auto loss_calls = std::make_shared<int>(0);
    PipelineLossFn loss = [armed, loss_calls, where, failing_mb](const Tensors& out,
                                                                 const Tensors& t) {
      if (where == Where::Loss && *armed && (*loss_calls)++ == failing_mb) {
        *armed = false;
        throw std::runtime_error("boom");
      }
      return mse(out, t);
    };
    PipelineOptions o;
    o.timeout = std::chrono::seconds(2);
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, loss,
                       o);
    const auto params = model->parameters();
    for (int step = 0; step <= failing_step + 1; ++step) {
      model->zero_grad();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        auto result = rt.step({x}, {y});
        EXPECT_NE(step, failing_step) << "the step did not fail on rank " << r;
        for (int mb = 0; mb < m; ++mb)
          EXPECT_NEAR(result.losses[mb], ref.losses[mb], 1e-5) << "step " << step << " mb " << mb;
        for (int s : schedule.stages_of(r))
          for (int k : {2 * s, 2 * s + 1})
            expect_close(params[k].grad(), ref.grads[k],
                         "step " + std::to_string(step) + " parameter " + std::to_string(k));
      } catch (const std::exception& e) {
        caught[r] = e.what();
        seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        stage_errors[r] = dynamic_cast<const StageError*>(&e) != nullptr;
        try {
          std::rethrow_if_nested(e);
        } catch (const std::exception& inner) {
          nested[r] = inner.what();
        }
        EXPECT_EQ(step, failing_step) << e.what();
        // Nothing of the failed step is left for an optimizer to apply.
        for (const auto& p : rt.parameters())
          EXPECT_FALSE(p.grad().defined()) << "rank " << r << " after the failed step";
        if (step != failing_step) throw;
      }
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(pp, kNoError));
  // Under ZB-H1 stage 0's I computes no input gradient (none is sent), so
  // the hook runs in its W.
  const char* action = where != Where::Backward         ? "forward"
                       : name == "zbh1" && failing == 0 ? "weight backward (W)"
                                                        : "backward";
  const std::string where_text = where == Where::Loss
                                     ? "the loss function of stage " + std::to_string(failing) +
                                           " (on rank " + std::to_string(failing_rank) +
                                           ") threw for micro-batch " + std::to_string(failing_mb)
                                     : "stage " + std::to_string(failing) + " (on rank " +
                                           std::to_string(failing_rank) + ") threw in its " +
                                           action + " of micro-batch " + std::to_string(failing_mb);
  for (int r = 0; r < pp; ++r) {
    const auto& e = caught[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "PipelineRuntime on rank " + std::to_string(r) + " of group")) << e;
    EXPECT_TRUE(has(e, where_text + ": boom")) << e << "\nexpected: " << where_text;
    EXPECT_TRUE(stage_errors[static_cast<size_t>(r)]) << "rank " << r << " threw another type";
    // The rank whose code threw keeps the original for its caller.
    EXPECT_EQ(nested[static_cast<size_t>(r)], r == failing_rank ? "boom" : "") << "rank " << r;
    // A wait for a message that never comes ends at the 2 s timeout.
    EXPECT_LT(seconds[static_cast<size_t>(r)], 1.0) << "rank " << r << ": " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, StageFailure,
    ::testing::Combine(::testing::Values("gpipe", "1f1b", "zbh1", "interleaved"),
                       ::testing::Values(1, 2, 3),
                       ::testing::Values(Where::FirstForward, Where::Forward, Where::Loss,
                                         Where::Backward, Where::LaterStep)),
    case_name);

class OversizedShapeMessage : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// Stage 0 sends 16 two-dimensional tensors: 1 + 16 * (2 + 2) = 65 values,
// one more than a shape message holds. Before, rank 0 alone threw and the
// others waited for the timeout.
TEST_P(OversizedShapeMessage, IsAnErrorOnEveryRank) {
  const auto [name, pp] = GetParam();
  const int v = name == "interleaved" ? 2 : 1, stages = pp * v;
  const int m = name == "interleaved" && pp == 3 ? 3 : 2;
  std::vector<double> seconds(pp);
  std::vector<int> invalid(pp, 0);
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto schedule = make_schedule(name, pp, v, m);
    auto model = make_mlp(stages);
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(r)) {
      auto layers = split_sequential(model, mlp_boundaries(stages), s);
      if (s != 0) {
        mine.emplace_back(
            s, [layers](const Tensors& in) mutable { return Tensors{layers->forward(in[0])}; },
            layers->parameters());
        continue;
      }
      mine.emplace_back(
          0,
          [layers](const Tensors& in) mutable {
            auto out = layers->forward(in[0]);
            return Tensors(16, out);
          },
          layers->parameters());
    }
    PipelineOptions o;
    o.timeout = std::chrono::seconds(2);
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse,
                       o);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      rt.step({det({2 * m, kWidth}, 0.3)}, {det({2 * m, kWidth}, 1.1)});
    } catch (const std::exception& e) {
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      invalid[r] = dynamic_cast<const InvalidArgument*>(&e) != nullptr;
      throw;
    }
  });
  for (int r = 0; r < pp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "PipelineRuntime on rank " + std::to_string(r) + " of group")) << e;
    EXPECT_TRUE(has(e,
                    "stage 0 on rank 0, sending micro-batch 0 to rank 1: too many tensors or "
                    "dimensions to describe (65 > 64 values)"))
        << e;
    EXPECT_LT(seconds[static_cast<size_t>(r)], 1.0) << "rank " << r << ": " << e;
    EXPECT_TRUE(invalid[static_cast<size_t>(r)]) << "rank " << r << " threw another type";
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, OversizedShapeMessage,
                         ::testing::Combine(::testing::Values("gpipe", "1f1b", "zbh1",
                                                              "interleaved"),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_pp" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace cohort::pipeline::stage_failure_test
