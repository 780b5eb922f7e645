// ZeRO stage 2, alone and over cohort DDP (buckets of 16 floats, SGD with
// momentum), ranks as threads over Gloo and UCX, when step() is refused
// because a second backward ran before it outside no_sync(): every rank
// refuses (InvalidArgument; the ranks that ran it name it, the others name
// those ranks) and drops that step's gradients. A user who catches the
// refusal and goes on without zero_grad() then trains as one process that
// skipped the step (every parameter within 1e-6 after 10 steps); the
// gradients left in .grad used to be added into the next step. At world 1
// nothing is reduced during backward, so the two backwards accumulate as in
// LibTorch and the step takes their sum.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
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

namespace cohort::testing::zero_refused_step_test {
namespace {

// Declared here: the unity build's other files see cohort::testing's kSteps.
using failing_mlp::Batches;
using failing_mlp::Fail;
using failing_mlp::kBatch;
using failing_mlp::kSteps;
using failing_mlp::make_batches;
using failing_mlp::make_model;
using failing_mlp::rows;
using Mlp = torch::nn::Sequential;

constexpr int kTwiceStep = 3;  // the step with a second backward

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<std::string> thrown;  // "step s: what", per step that threw
};

// kSteps steps of ZeRO-2 (over DDP with `ddp`), zero_grad() after each
// step that went through only; at kTwiceStep the ranks `twice(rank)` run a
// second forward and backward on the same rows before step().
Trained train(const std::shared_ptr<Communicator>& comm, const Batches& b, bool with_ddp,
              const std::function<bool(int)>& twice) {
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  auto model = make_model(std::make_shared<Fail>(Fail::kNot));
  std::unique_ptr<DistributedDataParallel<Mlp>> ddp;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  if (with_ddp) {
    ddp = std::make_unique<DistributedDataParallel<Mlp>>(model, comm);
    zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(*ddp, sgd, zo);
  } else {
    zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(model->parameters(), comm, sgd, zo);
  }
  const int64_t n = kBatch / comm->size();
  const int r = comm->rank();
  const auto backward = [&](int s) {
    auto x = rows(b.x, s, r * n, n);
    torch::mse_loss(ddp ? ddp->forward(x) : model->forward(x), rows(b.y, s, r * n, n)).backward();
  };
  Trained out;
  for (int s = 0; s < kSteps; ++s) {
    try {
      backward(s);
      if (s == kTwiceStep && twice(r)) backward(s);
      zero->step();
      zero->zero_grad();
    } catch (const std::exception& e) {
      out.thrown.push_back("step " + std::to_string(s) + ": " + e.what());
    }
  }
  zero.reset();  // before DDP, whose reduction it holds
  out.params = clone_all(model->parameters());
  return out;
}

// One process, the whole batch: step kTwiceStep left out (`skip`) or with
// its backward run twice.
std::vector<torch::Tensor> reference(const Batches& b, bool skip) {
  auto model = make_model(std::make_shared<Fail>(Fail::kNot));
  auto opt = failing_mlp::make_sgd(model->parameters());
  for (int s = 0; s < kSteps; ++s) {
    if (s == kTwiceStep && skip) continue;
    opt.zero_grad();
    for (int k = 0; k < (s == kTwiceStep ? 2 : 1); ++k) {
      torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
    }
    opt.step();
  }
  return clone_all(model->parameters());
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::map<int, Trained> run(const EngineWorld& c, const Batches& b, bool with_ddp,
                           const std::function<bool(int)>& twice) {
  std::mutex mu;
  std::map<int, Trained> got;
  auto options = options_for(c);
  options.timeout = std::chrono::seconds(10);  // a rank left waiting fails soon
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        Trained t;
        try {
          t = train(comm, b, with_ddp, twice);
        } catch (const std::exception& e) {
          t.thrown.push_back(std::string("left the loop: ") + e.what());
        }
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = std::move(t);
      },
      options);
  return got;
}

void expect_params(const Trained& run, const std::vector<torch::Tensor>& want, int rank) {
  ASSERT_EQ(run.params.size(), want.size()) << "rank " << rank;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::allclose(run.params[i], want[i], 1e-6, 1e-6))
        << "rank " << rank << ", parameter " << i << ": off by "
        << (run.params[i] - want[i]).abs().max().item<double>();
  }
}

class ZeroRefusedStep : public ::testing::TestWithParam<EngineWorld> {};

// Every rank runs the second backward.
TEST_P(ZeroRefusedStep, GoesOnWithoutZeroGradAsIfTheStepWereSkipped) {
  const auto c = GetParam();
  const auto b = make_batches();
  const auto want = reference(b, /*skip=*/c.world > 1);
  for (bool with_ddp : {false, true}) {
    SCOPED_TRACE(with_ddp ? "over DDP" : "alone");
    const auto got = run(c, b, with_ddp, [](int) { return true; });
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world));
    for (const auto& [rank, trained] : got) {
      if (c.world == 1) {
        EXPECT_TRUE(trained.thrown.empty()) << trained.thrown.front();
      } else {
        ASSERT_EQ(trained.thrown.size(), 1u) << "rank " << rank << ": " << trained.thrown.back();
        const auto& what = trained.thrown.front();
        EXPECT_TRUE(has(what, "step " + std::to_string(kTwiceStep) + ": ")) << what;
        EXPECT_TRUE(has(what, "a parameter got a second gradient before step()")) << what;
      }
      expect_params(trained, want, rank);
    }
  }
}

// The last rank alone runs the second backward: the others, which could
// step, are refused with it (they would otherwise wait for it in the
// step's all-gather while it went on to its next backward's
// reduce-scatters).
TEST_P(ZeroRefusedStep, ASecondBackwardOnOneRankIsRefusedOnEveryRank) {
  const auto c = GetParam();
  if (c.world == 1) GTEST_SKIP() << "one rank alone only among several";
  const auto b = make_batches();
  const auto want = reference(b, /*skip=*/true);
  const int last = c.world - 1;
  for (bool with_ddp : {false, true}) {
    SCOPED_TRACE(with_ddp ? "over DDP" : "alone");
    const auto got = run(c, b, with_ddp, [&](int r) { return r == last; });
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world));
    for (const auto& [rank, trained] : got) {
      ASSERT_EQ(trained.thrown.size(), 1u) << "rank " << rank << ": " << trained.thrown.back();
      const auto& what = trained.thrown.front();
      EXPECT_TRUE(has(what, "step " + std::to_string(kTwiceStep) + ": ")) << what;
      EXPECT_TRUE(has(what, rank == last
                                ? "a parameter got a second gradient before step()"
                                : "rank " + std::to_string(last) + " cannot take this step"))
          << "rank " << rank << ": " << what;
      expect_params(trained, want, rank);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroRefusedStep, ::testing::ValuesIn(engine_worlds({1, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::zero_refused_step_test
