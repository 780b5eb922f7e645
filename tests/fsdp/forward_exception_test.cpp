// An exception thrown inside the root's forward, on every rank at the same
// call, after units were gathered (a layer's shape error, a user's check in
// forward), ranks as threads over Gloo and UCX at world 1 to 3, every unit
// made with reshard_after_forward true or false. The failing layer sits
// between the two inner units (the root's parameters are gathered, the
// first unit has run, the second's all-gather is in flight) or inside the
// second unit after its Linear (that unit is gathered too). The user
// catches the exception, which reaches them unchanged, and goes on: the
// model is left with every unit sharded and nothing in flight, so an
// optimizer step after it steps the shards the optimizer holds, and the
// next forward gathers them. After 10 AdamW steps every parameter equals,
// within 1e-6 relative, that of one process that skipped the failing call.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "tests/fsdp/failing_model.h"

namespace cohort::forward_exception_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;

using Failing = FailingForward;

// How the user goes on after catching the exception.
enum class Then {
  kStep,      // the failed forward came after the step's backward: the step follows
  kNextStep,  // the failed forward was the step's own: the step is skipped
};

// The step whose call fails.
constexpr int kFailStep = 3;

// The shared model with this file's failing layer.
Sequential make_failing_model(const std::shared_ptr<Communicator>& comm, FullyShardOptions options,
                              Where where, const std::shared_ptr<bool>& fail) {
  return cohort::testing::fsdp_test::make_failing_model<Failing>(comm, options, where, fail);
}

// The inner units of `seq`.
std::vector<FullyShardImpl*> inner_units(const Sequential& seq) {
  std::vector<FullyShardImpl*> out;
  for (const auto& m : seq->children()) {
    if (auto* unit = dynamic_cast<FullyShardImpl*>(m.get())) out.push_back(unit);
  }
  return out;
}

// Runs `model` on `x` (with `loss_of`'s backward if given) with the failing
// layer armed; expects the layer's own exception.
template <class Model>
void failing_call(Model& model, const std::shared_ptr<bool>& fail, const torch::Tensor& x,
                  const torch::Tensor& y, bool backward, const std::string& who) {
  *fail = true;
  try {
    auto out = model->forward(x);
    if (backward) torch::mse_loss(out, y).backward();
    ADD_FAILURE() << who << ": the forward did not throw";
  } catch (const LayerError& e) {
    EXPECT_STREQ(e.what(), "the layer refused its input") << who;
  }
  *fail = false;
}

// One process: the same steps on the whole batch, without the failing call.
Named reference(const Batches& b, Where where, Then then) {
  return reference_skipping<Failing>(b, where, then == Then::kNextStep ? kFailStep : -1);
}

// Each rank's gathered model after the steps with the failing call.
std::map<int, Named> sharded(const EngineWorld& c, const Batches& b, Where where, Then then,
                             bool reshard) {
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
        for (int s = 0; s < kSteps; ++s) {
          auto x = local(b.x[s], *comm), y = local(b.y[s], *comm);
          opt->zero_grad();
          if (then == Then::kNextStep && s == kFailStep) {
            failing_call(model, fail, x, y, /*backward=*/true, who);
            continue;
          }
          torch::mse_loss(model->forward(x), y).backward();
          if (then == Then::kStep && s == kFailStep) {
            failing_call(model, fail, x * 0.5, y, /*backward=*/false, who);
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

void expect_one_process(const EngineWorld& c, Then then) {
  const auto b = make_batches(31);
  for (auto where : {Where::kBetweenUnits, Where::kInsideUnit}) {
    const auto want = reference(b, where, then);
    for (bool reshard : {true, false}) {
      SCOPED_TRACE(std::string(where == Where::kBetweenUnits ? "between units" : "inside a unit") +
                   (reshard ? ", reshard_after_forward true" : ", reshard_after_forward false"));
      for (const auto& [rank, params] : sharded(c, b, where, then, reshard)) {
        expect_close(params, want, 1e-6, "rank " + std::to_string(rank));
      }
    }
  }
}

class FSDPForwardException : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPForwardException, AnOptimizerStepAfterItStepsTheShards) {
  expect_one_process(GetParam(), Then::kStep);
}

TEST_P(FSDPForwardException, TrainingGoesOnAfterAStepWhoseForwardThrew) {
  expect_one_process(GetParam(), Then::kNextStep);
}

// Once the exception is caught every unit is sharded, with no all-gather in
// flight, whatever the forward had gathered.
TEST_P(FSDPForwardException, LeavesEveryUnitSharded) {
  const auto c = GetParam();
  for (auto where : {Where::kBetweenUnits, Where::kInsideUnit}) {
    SCOPED_TRACE(where == Where::kBetweenUnits ? "between units" : "inside a unit");
    cohort::testing::run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          FullyShardOptions keep;
          keep.reshard_after_forward = false;
          auto fail = std::make_shared<bool>(false);
          auto seq = make_failing_model(comm, keep, where, fail);
          auto model = fully_shard(seq, comm, keep);
          const auto units = inner_units(seq);
          ASSERT_EQ(units.size(), 2u);
          const auto b = make_batches(2);
          const auto x = local(b.x[0], *comm), y = local(b.y[0], *comm);
          failing_call(model, fail, x, y, /*backward=*/false,
                       "rank " + std::to_string(comm->rank()));
          EXPECT_TRUE(model->param_group().will_gather()) << "the root";
          for (size_t i = 0; i < units.size(); ++i)
            EXPECT_TRUE(units[i]->param_group().will_gather()) << "inner unit " << i;
        },
        cohort::testing::options_for(c));
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPForwardException,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

class FSDPForwardExceptionOnOneRank : public ::testing::TestWithParam<EngineWorld> {};

// Rank 1 alone throws and goes on to the next step while the others run
// that step's backward: the ranks are out of step, which the schedule's
// check finds at the next collective, on every rank, well within the
// communicator's timeout (20 s): rank 1's unwinding waits only for the
// all-gather every rank issued.
TEST_P(FSDPForwardExceptionOnOneRank, IsAScheduleMismatchOnEveryRank) {
  const auto c = GetParam();
  const auto start = std::chrono::steady_clock::now();
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto fail = std::make_shared<bool>(false);
        auto seq = make_failing_model(comm, {}, Where::kBetweenUnits, fail);
        auto model = fully_shard(seq, comm);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        const auto b = make_batches(5);
        const std::string who = "rank " + std::to_string(comm->rank());
        std::string error;
        try {
          for (int s = 0; s < 3; ++s) {
            auto x = local(b.x[s], *comm), y = local(b.y[s], *comm);
            opt->zero_grad();
            if (comm->rank() == 1 && s == 1) {
              failing_call(model, fail, x, y, /*backward=*/true, who);
              continue;
            }
            torch::mse_loss(model->forward(x), y).backward();
            opt->step();
          }
        } catch (const Error& e) {
          error = e.what();
        }
        EXPECT_NE(error.find("at different points of the fully sharded model's schedule"),
                  std::string::npos)
            << who << ": " << (error.empty() ? "no error" : error);
      },
      cohort::testing::options_for(c));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPForwardExceptionOnOneRank,
                         ::testing::ValuesIn(cohort::testing::engine_worlds({3})),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::forward_exception_test
