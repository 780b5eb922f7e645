// ZeRO stage 2 over cohort DDP (DDP's reduction handed over: buckets of 16
// floats reduce-scattered during backward) when a backward throws after
// some reduce-scatters were launched (tests/ddp/failing_mlp.h), on every
// rank at the same call, ranks as threads over Gloo and UCX at world 1 to 3.
// The user catches what the step throws and skips the rest of it, with
// zero_grad() before each step or after each step that went through (so
// none between the failed backward and the next forward); the next forward
// ends the failed step as plain DDP's does, so only the failing step
// throws, and after 10 SGD-with-momentum steps every parameter equals,
// within 1e-6, that of one process that skipped it. Left uncaught, or
// thrown on one rank alone, it reaches the caller (as a MismatchError on
// every rank for the latter) rather than ending the program from the
// optimizer's destructor.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/engine_worlds.h"
#include "tests/ddp/ddp_test_models.h"
#include "tests/ddp/failing_mlp.h"

namespace cohort::testing::zero_ddp_exception_test {
namespace {

// Declared here: the unity build's other files see cohort::testing's kSteps.
using failing_mlp::backward_of;
using failing_mlp::Batches;
using failing_mlp::Fail;
using failing_mlp::kBatch;
using failing_mlp::kFailStep;
using failing_mlp::kSteps;
using failing_mlp::make_batches;
using failing_mlp::make_model;
using failing_mlp::reference_skipping;
using failing_mlp::rows;
using Mlp = torch::nn::Sequential;

// ZeRO-2 with SGD and momentum, buckets of 16 floats, taking DDP's
// reduction over.
std::unique_ptr<ZeroRedundancyOptimizer> make_zero(DistributedDataParallel<Mlp>& ddp) {
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);
  return ZeroRedundancyOptimizer::make<torch::optim::SGD>(
      ddp, torch::optim::SGDOptions(0.1).momentum(0.9), zo);
}

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<std::string> thrown;  // "step s: what", per step that threw
};

// kSteps steps of ZeRO-2 over DDP; step kFailStep throws in backward.
// zero_grad() before each step (`zero_grad_first`) or after each step().
Trained train(const std::shared_ptr<Communicator>& comm, const Batches& b, bool zero_grad_first) {
  auto fail = std::make_shared<Fail>(Fail::kNot);
  DistributedDataParallel<Mlp> ddp(make_model(fail), comm);
  auto zero = make_zero(ddp);
  const int64_t n = kBatch / comm->size();
  const int r = comm->rank();
  Trained out;
  for (int s = 0; s < kSteps; ++s) {
    if (zero_grad_first) zero->zero_grad();
    *fail = s == kFailStep ? Fail::kInBackward : Fail::kNot;
    try {
      backward_of(torch::mse_loss(ddp.forward(rows(b.x, s, r * n, n)), rows(b.y, s, r * n, n)),
                  *fail);
      zero->step();
      if (!zero_grad_first) zero->zero_grad();
    } catch (const std::exception& e) {
      out.thrown.push_back("step " + std::to_string(s) + ": " + e.what());
    }
    *fail = Fail::kNot;
  }
  out.params = clone_all(ddp.parameters());
  return out;
}

class ZeroDdpStepException : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(ZeroDdpStepException, TrainingGoesOnAfterAStepThatThrew) {
  const auto c = GetParam();
  const auto b = make_batches();
  const auto want = reference_skipping(b, kFailStep);
  for (bool zero_grad_first : {true, false}) {
    SCOPED_TRACE(zero_grad_first ? "zero_grad() before each step" : "zero_grad() after each step");
    auto got = results_of_ranks<Trained>(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          return train(comm, b, zero_grad_first);
        },
        options_for(c));
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world));
    for (const auto& [rank, run] : got) {
      const std::string failed = "step " + std::to_string(kFailStep) + ": the layer refused";
      EXPECT_EQ(run.thrown, std::vector<std::string>{failed}) << "rank " << rank;
      ASSERT_EQ(run.params.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(torch::allclose(run.params[i], want[i], 1e-6, 1e-6))
            << "rank " << rank << ", parameter " << i << ": off by "
            << (run.params[i] - want[i]).abs().max().item<double>();
      }
    }
  }
}

// Not caught in the loop, the exception leaves through the optimizer's
// destructor, which hands DDP its reduction back while DDP still counts
// that backward as running: it reaches the caller on every rank (the
// refused hand-back once ended the program from the destructor).
TEST_P(ZeroDdpStepException, AnExceptionLeftUncaughtReachesTheCaller) {
  const auto c = GetParam();
  const auto b = make_batches();
  std::mutex mu;
  std::map<int, std::string> caught;
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        try {
          auto fail = std::make_shared<Fail>(Fail::kNot);
          DistributedDataParallel<Mlp> ddp(make_model(fail), comm);
          auto zero = make_zero(ddp);
          const int64_t n = kBatch / comm->size();
          const int r = comm->rank();
          for (int s = 0; s < kSteps; ++s) {
            zero->zero_grad();
            *fail = s == kFailStep ? Fail::kInBackward : Fail::kNot;
            backward_of(
                torch::mse_loss(ddp.forward(rows(b.x, s, r * n, n)), rows(b.y, s, r * n, n)),
                *fail);
            zero->step();
          }
        } catch (const failing_mlp::LayerError& e) {
          std::lock_guard<std::mutex> lock(mu);
          caught[comm->rank()] = e.what();
        }
      },
      options_for(c));
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(caught[r], "the layer refused") << "rank " << r;
  }
}

// Thrown on rank 0 alone, after some reduce-scatters were launched: every
// rank is refused, naming the mismatch (rank 0 at its next forward, the
// others in their backward), and leaves through the optimizer's destructor.
TEST_P(ZeroDdpStepException, ThrownOnOneRankIsAMismatchOnEveryRank) {
  const auto c = GetParam();
  if (c.world == 1) GTEST_SKIP() << "one rank throws alone only among several";
  const auto b = make_batches();
  std::mutex mu;
  std::map<int, std::string> refused;
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto fail = std::make_shared<Fail>(Fail::kNot);
        DistributedDataParallel<Mlp> ddp(make_model(fail), comm);
        auto zero = make_zero(ddp);
        const int64_t n = kBatch / comm->size();
        const int r = comm->rank();
        for (int s = 0; s < kSteps; ++s) {
          *fail = s == kFailStep && r == 0 ? Fail::kInBackward : Fail::kNot;
          try {
            backward_of(
                torch::mse_loss(ddp.forward(rows(b.x, s, r * n, n)), rows(b.y, s, r * n, n)),
                *fail);
            zero->step();
            zero->zero_grad();
          } catch (const failing_mlp::LayerError&) {
            continue;
          } catch (const Error& e) {
            std::lock_guard<std::mutex> lock(mu);
            refused[r] = std::to_string(s) + ": " + e.what();
            return;
          }
        }
      },
      options_for(c));
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(refused.count(r)) << "rank " << r << " trained on";
    const auto& what = refused[r];
    EXPECT_NE(what.find("the ranks called different collectives"), std::string::npos)
        << "rank " << r << ": " << what;
    EXPECT_EQ(what.rfind(std::to_string(r == 0 ? kFailStep + 1 : kFailStep) + ": ", 0), 0u)
        << "rank " << r << ": " << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroDdpStepException, ::testing::ValuesIn(engine_worlds()),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::zero_ddp_exception_test
