// A forward no backward follows between training steps, ranks as threads
// over Gloo and UCX at world 1 to 3, every unit (the root too) made with
// reshard_after_forward true or false: one under NoGradGuard (an
// evaluation), or a training forward whose graph is freed without a
// backward (its loss dropped, or an exception thrown between forward and
// backward). The model ends the first sharded, and the second once its
// graph is freed, so an optimizer step after it steps the shards the
// optimizer holds, and the next forward gathers them. After 10 AdamW steps
// every parameter equals the one-process model's within 1e-6 relative, and
// each such forward's output the one-process model's at that point within
// 1e-5, whether it comes between backward and the optimizer step or after
// it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::no_grad_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;

// Where each step's evaluation forward runs.
enum class Eval {
  kBeforeStep,  // after backward, before the optimizer step
  kAfterStep,   // after the optimizer step
};

// How that forward runs.
enum class Forward {
  kNoGrad,   // under NoGradGuard
  kDropped,  // with grad, its output dropped
  kThrown,   // with grad, an exception thrown before its backward
};

// The evaluation batch of step s (other rows than the training batch).
torch::Tensor eval_batch(const Batches& b, int s) { return b.x[(s + 1) % kSteps] * 0.5; }

// `model`'s output on `x` run as `how` says, without its graph.
template <class Model>
torch::Tensor evaluate(Model& model, const torch::Tensor& x, Forward how) {
  if (how == Forward::kNoGrad) {
    torch::NoGradGuard no_grad;
    return model->forward(x);
  }
  torch::Tensor kept;
  try {
    auto out = model->forward(x);
    kept = out.detach();
    if (how == Forward::kThrown) throw std::runtime_error("between forward and backward");
  } catch (const std::runtime_error&) {
  }
  return kept;
}

struct Outcome {
  Named params;
  std::vector<torch::Tensor> evals;  // each step's evaluation output
};

// One process: the same steps on the whole batch.
Outcome reference(const Batches& b, Eval when, Forward how) {
  auto model = make_model(nullptr, {});
  init_parameters(*model, 7);
  auto opt = make_optimizer(Opt::AdamW, model->parameters());
  Outcome out;
  auto eval = [&](int s) { out.evals.push_back(evaluate(model, eval_batch(b, s), how)); };
  for (int s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
    if (when == Eval::kBeforeStep) eval(s);
    opt->step();
    if (when == Eval::kAfterStep) eval(s);
  }
  for (const auto& p : model->named_parameters()) out.params.insert(p.key(), p.value().clone());
  return out;
}

// Each rank's gathered model and evaluation outputs (its rows of them).
std::map<int, Outcome> sharded(const EngineWorld& c, const Batches& b, Eval when, Forward how,
                               bool reshard) {
  std::mutex mu;
  std::map<int, Outcome> got;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions options;
        options.reshard_after_forward = reshard;
        auto model = fully_shard(make_model(comm, options), comm, options);
        auto twin = make_model(nullptr, {});
        init_parameters(*twin, 7);
        load_from(model, *twin);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        Outcome out;
        auto eval = [&](int s) {
          out.evals.push_back(evaluate(model, local(eval_batch(b, s), *comm), how));
        };
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          torch::mse_loss(model->forward(local(b.x[s], *comm)), local(b.y[s], *comm)).backward();
          if (when == Eval::kBeforeStep) eval(s);
          opt->step();
          if (when == Eval::kAfterStep) eval(s);
        }
        out.params = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = std::move(out);
      },
      cohort::testing::options_for(c));
  return got;
}

void expect_one_process(const EngineWorld& c, Eval when, bool reshard,
                        Forward how = Forward::kNoGrad) {
  const auto b = make_batches(21);
  const auto want = reference(b, when, how);
  for (const auto& [rank, out] : sharded(c, b, when, how, reshard)) {
    const std::string who = "rank " + std::to_string(rank);
    expect_close(out.params, want.params, 1e-6, who);
    ASSERT_EQ(out.evals.size(), want.evals.size()) << who;
    for (size_t s = 0; s < want.evals.size(); ++s) {
      const int64_t n = want.evals[s].size(0) / c.world;
      const auto mine = want.evals[s].narrow(0, rank * n, n);
      EXPECT_TRUE(torch::allclose(out.evals[s], mine, 1e-5, 1e-6))
          << who << " step " << s << ": the evaluation differs by "
          << (out.evals[s] - mine).abs().max().item<double>();
    }
  }
}

class FSDPNoGradForward : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPNoGradForward, AnOptimizerStepAfterItStepsTheShards) {
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward true" : "reshard_after_forward false");
    expect_one_process(GetParam(), Eval::kBeforeStep, reshard);
  }
}

TEST_P(FSDPNoGradForward, AfterTheStepTheNextForwardSeesTheStep) {
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward true" : "reshard_after_forward false");
    expect_one_process(GetParam(), Eval::kAfterStep, reshard);
  }
}

// The model ends the forward sharded: every parameter is this rank's rows.
TEST_P(FSDPNoGradForward, LeavesEveryUnitSharded) {
  const auto c = GetParam();
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions keep;
        keep.reshard_after_forward = false;
        auto seq = make_model(comm, keep);
        auto model = fully_shard(seq, comm, keep);
        {
          torch::NoGradGuard no_grad;
          model->forward(local(make_batches(2).x[0], *comm));
        }
        EXPECT_FALSE(model->param_group().is_unsharded());
        for (size_t i : {2, 4})
          EXPECT_FALSE(seq->ptr<FullyShardImpl>(i)->param_group().is_unsharded());
        const int64_t rows = (5 + c.world - 1) / c.world;  // the root's 5-row tied weight
        EXPECT_EQ(model->named_parameters()["0.w"].size(0),
                  std::max<int64_t>(0, std::min<int64_t>(rows, 5 - comm->rank() * rows)));
      },
      cohort::testing::options_for(c));
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPNoGradForward,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

class FSDPForwardWithoutBackward : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPForwardWithoutBackward, AnOptimizerStepAfterADroppedLossStepsTheShards) {
  for (auto when : {Eval::kBeforeStep, Eval::kAfterStep}) {
    for (bool reshard : {true, false}) {
      SCOPED_TRACE(std::string(when == Eval::kBeforeStep ? "before" : "after") + " the step, " +
                   (reshard ? "reshard_after_forward true" : "reshard_after_forward false"));
      expect_one_process(GetParam(), when, reshard, Forward::kDropped);
    }
  }
}

TEST_P(FSDPForwardWithoutBackward, AnOptimizerStepAfterAnExceptionStepsTheShards) {
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward true" : "reshard_after_forward false");
    expect_one_process(GetParam(), Eval::kBeforeStep, reshard, Forward::kThrown);
  }
}

// Every unit is sharded once the graph is freed, not before: a backward
// may still come while the output lives.
TEST_P(FSDPForwardWithoutBackward, LeavesEveryUnitShardedOnceItsGraphIsFreed) {
  const auto c = GetParam();
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions keep;
        keep.reshard_after_forward = false;
        auto seq = make_model(comm, keep);
        auto model = fully_shard(seq, comm, keep);
        auto units = [&] {
          std::vector<bool> unsharded{model->param_group().is_unsharded()};
          for (size_t i : {2, 4})
            unsharded.push_back(seq->ptr<FullyShardImpl>(i)->param_group().is_unsharded());
          return unsharded;
        };
        auto out = model->forward(local(make_batches(2).x[0], *comm));
        EXPECT_EQ(units(), std::vector<bool>(3, true));
        out = torch::Tensor();
        EXPECT_EQ(units(), std::vector<bool>(3, false));
      },
      cohort::testing::options_for(c));
}

// Rank 0 keeps a training forward's output (no backward) past the next
// forward, the others drop theirs: rank 0 skips the all-gathers of the
// units that output keeps gathered. The error on every rank says so rather
// than blaming control flow.
TEST_P(FSDPForwardWithoutBackward, AnOutputKeptOnOneRankIsNamedAtTheNextForward) {
  const auto c = GetParam();
  if (c.world < 2) GTEST_SKIP() << "needs a rank that keeps and one that drops";
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto model = fully_shard(make_model(comm, {}), comm, {});
        const auto x = local(make_batches(2).x[0], *comm);
        auto kept = model->forward(x);
        if (comm->rank() != 0) kept = torch::Tensor();
        try {
          torch::mse_loss(model->forward(x), torch::zeros({1})).backward();
          ADD_FAILURE() << "rank " << comm->rank() << ": the second forward went on";
        } catch (const MismatchError& e) {
          const std::string m = e.what();
          for (const char* words :
               {"different points of the fully sharded model's schedule",
                "the output of an earlier training forward that no backward ran through",
                "rank 0: units still gathered"}) {
            EXPECT_NE(m.find(words), std::string::npos) << "'" << words << "' in " << m;
          }
          EXPECT_EQ(m.find("control flow"), std::string::npos) << m;
        }
      },
      cohort::testing::options_for(c));
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPForwardWithoutBackward,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::no_grad_test
