// Determinism::WorldSizeInvariant: an exception in one leaf's forward (a
// layer) or backward (a tensor hook inside the model, or on the loss before
// the backward reaches the model), on every rank at the same call, in the
// rank's first or last leaf of a step, ranks as threads over Gloo and UCX
// at world 1 to 3. The user catches it and skips the rest of the step:
// after 10 AdamW steps every parameter equals, within 1e-6 relative, that
// of one process that skipped the step, so none of the failed step's
// leaves reaches a later step. An evaluation forward (under NoGradGuard, or
// in eval mode) that throws between two leaves of a step is no leaf of it:
// the step goes on, and training equals one process that skipped nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "tests/fsdp/failing_model.h"

namespace cohort::leaf_exception_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;

constexpr int kFailStep = 3;
constexpr int64_t kLeaves = 6;  // kBatch / kLeaves rows each

// Ranks train with leaves; in step kFailStep the failing layer throws
// `Thrown` in the rank's first leaf or its last; `on_loss`: a hook on the
// loss throws HookError instead, before the backward reaches the model.
template <class Failing, class Thrown>
std::map<int, Named> with_leaves(const EngineWorld& c, const Batches& b, Where where,
                                 bool in_last_leaf, bool on_loss) {
  std::mutex mu;
  std::map<int, Named> got;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions options;
        options.determinism = Determinism::WorldSizeInvariant;
        options.leaves = kLeaves;
        auto fail = std::make_shared<bool>(false);
        auto model = sharded_failing_model<Failing>(comm, options, where, fail);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        const std::string who = "rank " + std::to_string(comm->rank());
        const int64_t rows = kBatch / kLeaves, leaves = model->local_leaves();
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          bool failed = false;
          for (int64_t k = 0; k < leaves && !failed; ++k) {
            const bool armed = s == kFailStep && k == (in_last_leaf ? leaves - 1 : 0);
            *fail = armed && !on_loss;
            const int64_t from = (model->first_leaf() + k) * rows;
            try {
              auto out = model->forward(b.x[s].narrow(0, from, rows));
              auto loss = torch::mse_loss(out, b.y[s].narrow(0, from, rows));
              if (armed && on_loss) {
                loss.register_hook([](const torch::Tensor&) -> torch::Tensor {
                  throw HookError("the hook refused its gradient");
                });
              }
              loss.backward();
            } catch (const Thrown&) {
              failed = true;
            }
            *fail = false;
          }
          EXPECT_EQ(failed, s == kFailStep) << who << ", step " << s;
          if (!failed) opt->step();
        }
        auto params = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = std::move(params);
      },
      cohort::testing::options_for(c));
  return got;
}

template <class Failing, class Thrown>
void expect_one_process(const EngineWorld& c, bool on_loss = false) {
  const auto b = make_batches(31);
  for (auto where : {Where::kBetweenUnits, Where::kInsideUnit}) {
    const auto want = reference_skipping<Failing>(b, where, kFailStep);
    for (bool in_last_leaf : {false, true}) {
      SCOPED_TRACE(std::string(where == Where::kBetweenUnits ? "between units" : "inside a unit") +
                   (in_last_leaf ? ", in the last leaf" : ", in the first leaf"));
      for (const auto& [rank, params] :
           with_leaves<Failing, Thrown>(c, b, where, in_last_leaf, on_loss)) {
        expect_close(params, want, 1e-6, "rank " + std::to_string(rank));
      }
    }
  }
}

// How the evaluation forward between two leaves runs.
enum class Eval { kNoGrad, kEvalMode };

// Ranks train with leaves; in step kFailStep, after the backward of the
// rank's first leaf, an evaluation forward throws LayerError (the user
// catches it) and the step's other leaves follow.
std::map<int, Named> with_failing_eval(const EngineWorld& c, const Batches& b, Where where,
                                       Eval eval) {
  std::mutex mu;
  std::map<int, Named> got;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions options;
        options.determinism = Determinism::WorldSizeInvariant;
        options.leaves = kLeaves;
        auto fail = std::make_shared<bool>(false);
        auto model = sharded_failing_model<FailingForward>(comm, options, where, fail);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        const std::string who = "rank " + std::to_string(comm->rank());
        const int64_t rows = kBatch / kLeaves, leaves = model->local_leaves();
        EXPECT_GE(leaves, 2) << who << ": no leaf after the evaluation";
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          for (int64_t k = 0; k < leaves; ++k) {
            const int64_t from = (model->first_leaf() + k) * rows;
            auto x = b.x[s].narrow(0, from, rows);
            torch::mse_loss(model->forward(x), b.y[s].narrow(0, from, rows)).backward();
            if (s != kFailStep || k != 0) continue;
            *fail = true;
            try {
              if (eval == Eval::kNoGrad) {
                torch::NoGradGuard no_grad;
                model->forward(x);
              } else {
                model->eval();
                model->forward(x);
              }
              ADD_FAILURE() << who << ": the evaluation did not throw";
            } catch (const LayerError&) {
            }
            model->train();
            *fail = false;
          }
          opt->step();
        }
        auto params = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = std::move(params);
      },
      cohort::testing::options_for(c));
  return got;
}

class FSDPLeafException : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPLeafException, TrainingGoesOnAfterAStepWhoseForwardThrew) {
  expect_one_process<FailingForward, LayerError>(GetParam());
}

TEST_P(FSDPLeafException, TrainingGoesOnAfterAStepWhoseBackwardThrew) {
  expect_one_process<FailingHook, HookError>(GetParam());
}

TEST_P(FSDPLeafException, TrainingGoesOnAfterAStepWhoseBackwardThrewOnTheLoss) {
  expect_one_process<FailingHook, HookError>(GetParam(), /*on_loss=*/true);
}

TEST_P(FSDPLeafException, AnEvaluationThrownBetweenLeavesLeavesTheStepAlone) {
  const auto b = make_batches(31);
  for (auto where : {Where::kBetweenUnits, Where::kInsideUnit}) {
    const auto want = reference_skipping<FailingForward>(b, where, /*skipped=*/-1);
    for (auto eval : {Eval::kNoGrad, Eval::kEvalMode}) {
      SCOPED_TRACE(std::string(where == Where::kBetweenUnits ? "between units" : "inside a unit") +
                   (eval == Eval::kNoGrad ? ", under NoGradGuard" : ", in eval mode"));
      for (const auto& [rank, params] : with_failing_eval(GetParam(), b, where, eval)) {
        expect_close(params, want, 1e-6, "rank " + std::to_string(rank));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPLeafException,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::leaf_exception_test
