// An exception thrown inside backward, on every rank at the same call, after
// some units began their backward (a tensor hook that throws), ranks as
// threads over Gloo and UCX at world 1 to 3, every unit made with
// reshard_after_forward true or false. The hook sits on the gradient
// between the two inner units (the second unit's backward is done and its
// reduce-scatter may be in flight) or inside the second unit after its
// Linear (that unit is gathered and computing). The user catches the
// exception, which reaches them unchanged, zeroes the gradients and goes
// on: after 10 AdamW steps every parameter equals, within 1e-6 relative,
// that of one process that skipped the failing step, so neither the
// failed step's gradients nor gathered copies leak into later steps;
// whether the failed step's graph is freed as the exception leaves
// backward or kept until after the next forward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "tests/fsdp/failing_model.h"

namespace cohort::backward_exception_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;

using Failing = FailingHook;

constexpr int kFailStep = 3;

// `keep_graph`: the failed step's loss lives on until the end (the graph is
// not freed when the exception leaves backward; the next forward finds the
// backward unfinished).
std::map<int, Named> sharded(const EngineWorld& c, const Batches& b, Where where, bool reshard,
                             bool keep_graph) {
  std::mutex mu;
  std::map<int, Named> got;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions options;
        options.reshard_after_forward = reshard;
        auto fail = std::make_shared<bool>(false);
        auto model = sharded_failing_model<Failing>(comm, options, where, fail);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        const std::string who = "rank " + std::to_string(comm->rank());
        torch::Tensor kept;
        for (int s = 0; s < kSteps; ++s) {
          auto x = local(b.x[s], *comm), y = local(b.y[s], *comm);
          opt->zero_grad();
          if (s == kFailStep) {
            *fail = true;
            try {
              auto loss = torch::mse_loss(model->forward(x), y);
              if (keep_graph) kept = loss;
              loss.backward();
              ADD_FAILURE() << who << ": the backward did not throw";
            } catch (const HookError& e) {
              EXPECT_STREQ(e.what(), "the hook refused its gradient") << who;
            }
            *fail = false;
            continue;
          }
          torch::mse_loss(model->forward(x), y).backward();
          opt->step();
        }
        auto params = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = std::move(params);
      },
      cohort::testing::options_for(c));
  return got;
}

class FSDPBackwardException : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPBackwardException, TrainingGoesOnAfterAStepWhoseBackwardThrew) {
  const auto c = GetParam();
  const auto b = make_batches(31);
  for (auto where : {Where::kBetweenUnits, Where::kInsideUnit}) {
    const auto want = reference_skipping<Failing>(b, where, kFailStep);
    for (bool reshard : {true, false}) {
      for (bool keep_graph : {false, true}) {
        SCOPED_TRACE(
            std::string(where == Where::kBetweenUnits ? "between units" : "inside a unit") +
            (reshard ? ", reshard_after_forward true" : ", reshard_after_forward false") +
            (keep_graph ? ", graph kept" : ", graph freed"));
        for (const auto& [rank, params] : sharded(c, b, where, reshard, keep_graph)) {
          expect_close(params, want, 1e-6, "rank " + std::to_string(rank));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPBackwardException,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::backward_exception_test
