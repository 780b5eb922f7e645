// An exception thrown inside backward (a tensor hook between the last two
// Linears, after some buckets were launched: each parameter has a bucket of
// its own) or forward (the same layer), on every rank at the same call,
// ranks as threads over Gloo and UCX at world 1 to 3, with gradients as
// bucket views or not, and with world-size-invariant leaves (thrown in the
// first or the last of the rank's leaves). The user catches the exception,
// which reaches them unchanged, and skips the step: after 10
// SGD-with-momentum steps every parameter equals, within 1e-6 relative, that
// of one process that skipped the failing step, so neither the failed step's
// reductions nor its leaves reach a later step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/engine_worlds.h"
#include "tests/ddp/ddp_test_models.h"
#include "tests/ddp/failing_mlp.h"

namespace cohort::testing::ddp_exception_test {
namespace {

using namespace failing_mlp;
using Mlp = torch::nn::Sequential;

constexpr int64_t kLeaves = 6;

// How the DDP runs (plain or with leaves) and where the step fails: in
// forward or backward; with leaves, in the rank's first leaf or its last.
struct Mode {
  bool bucket_view = true;
  bool leaves = false;
  bool fail_in_last_leaf = false;
  Fail where = Fail::kInBackward;
  std::string name() const {
    std::string out = where == Fail::kInForward ? "in forward, "
                      : where == Fail::kOnLoss  ? "on the loss, "
                                                : "in backward, ";
    if (!leaves) return out + (bucket_view ? "gradient as bucket view" : "gradients of their own");
    return out + (fail_in_last_leaf ? "leaves, in the last" : "leaves, in the first");
  }
};

void step_once(DistributedDataParallel<Mlp>& ddp, const Batches& b, int s, const Mode& mode,
               const std::shared_ptr<Fail>& fail, int rank, int world) {
  if (!mode.leaves) {
    const int64_t n = kBatch / world;
    *fail = s == kFailStep ? mode.where : Fail::kNot;
    backward_of(torch::mse_loss(ddp.forward(rows(b.x, s, rank * n, n)), rows(b.y, s, rank * n, n)),
                *fail);
    return;
  }
  const int64_t per_leaf = kBatch / kLeaves;
  for (int64_t k = 0; k < ddp.local_leaves(); ++k) {
    const bool last = k == ddp.local_leaves() - 1;
    const bool failing = s == kFailStep && (mode.fail_in_last_leaf ? last : k == 0);
    *fail = failing ? mode.where : Fail::kNot;
    const int64_t from = (ddp.first_leaf() + k) * per_leaf;
    backward_of(
        torch::mse_loss(ddp.forward(rows(b.x, s, from, per_leaf)), rows(b.y, s, from, per_leaf)),
        *fail);
  }
}

std::map<int, std::vector<torch::Tensor>> distributed(const EngineWorld& c, const Batches& b,
                                                      const Mode& mode) {
  std::mutex mu;
  std::map<int, std::vector<torch::Tensor>> got;
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto fail = std::make_shared<Fail>(Fail::kNot);
        DDPOptions options;
        options.bucket_cap_mb = 1e-6;  // a bucket per parameter
        options.first_bucket_mb = 1e-6;
        options.gradient_as_bucket_view = mode.bucket_view;
        if (mode.leaves) {
          options.determinism = Determinism::WorldSizeInvariant;
          options.leaves = kLeaves;
        }
        DistributedDataParallel<Mlp> ddp(make_model(fail), comm, options);
        auto opt = make_sgd(ddp.parameters());
        const std::string who = "rank " + std::to_string(comm->rank());
        for (int s = 0; s < kSteps; ++s) {
          opt.zero_grad();
          try {
            step_once(ddp, b, s, mode, fail, comm->rank(), c.world);
          } catch (const LayerError& e) {
            EXPECT_EQ(s, kFailStep) << who;
            EXPECT_STREQ(e.what(), "the layer refused") << who;
            *fail = Fail::kNot;
            continue;
          }
          EXPECT_NE(s, kFailStep) << who << ": the step did not throw";
          opt.step();
        }
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = clone_all(ddp.parameters());
      },
      options_for(c));
  return got;
}

class DDPStepException : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DDPStepException, TrainingGoesOnAfterAStepThatThrew) {
  const auto b = make_batches();
  const auto want = reference_skipping(b, kFailStep);
  for (const Mode& mode :
       {Mode{true}, Mode{false}, Mode{true, true, false}, Mode{true, true, true},
        Mode{true, false, false, Fail::kInForward}, Mode{true, true, false, Fail::kInForward},
        Mode{true, true, true, Fail::kInForward}, Mode{true, false, false, Fail::kOnLoss},
        Mode{true, true, false, Fail::kOnLoss}, Mode{true, true, true, Fail::kOnLoss}}) {
    SCOPED_TRACE(mode.name());
    for (const auto& [rank, params] : distributed(GetParam(), b, mode)) {
      ASSERT_EQ(params.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(torch::allclose(params[i], want[i], 1e-6, 1e-6))
            << "rank " << rank << ", parameter " << i << ": off by "
            << (params[i] - want[i]).abs().max().item<double>();
      }
    }
  }
}

// Thrown on rank 0 alone (in backward after buckets launched, in forward,
// or on the loss before any gradient): that rank's next buckets must not
// be averaged with the others' earlier ones. Every rank is refused, naming
// the mismatch: rank 0 at its next forward, the others in their backward.
TEST_P(DDPStepException, ThrownOnOneRankIsAMismatchOnEveryRank) {
  const auto c = GetParam();
  if (c.world == 1) GTEST_SKIP() << "one rank throws alone only among several";
  const auto b = make_batches();
  for (Fail where : {Fail::kInBackward, Fail::kInForward, Fail::kOnLoss}) {
    SCOPED_TRACE((Mode{true, false, false, where}.name()));
    std::mutex mu;
    std::map<int, std::string> refused;
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          auto fail = std::make_shared<Fail>(Fail::kNot);
          DDPOptions options;
          options.bucket_cap_mb = 1e-6;
          options.first_bucket_mb = 1e-6;
          DistributedDataParallel<Mlp> ddp(make_model(fail), comm, options);
          auto opt = make_sgd(ddp.parameters());
          const int64_t n = kBatch / c.world;
          const int r = comm->rank();
          for (int s = 0; s < kSteps; ++s) {
            opt.zero_grad();
            *fail = s == kFailStep && r == 0 ? where : Fail::kNot;
            try {
              backward_of(
                  torch::mse_loss(ddp.forward(rows(b.x, s, r * n, n)), rows(b.y, s, r * n, n)),
                  *fail);
            } catch (const LayerError&) {
              continue;
            } catch (const Error& e) {
              std::lock_guard<std::mutex> lock(mu);
              refused[r] = std::to_string(s) + ": " + e.what();
              return;
            }
            opt.step();
          }
        },
        options_for(c));
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(refused.count(r)) << "rank " << r << " trained on";
      const auto& what = refused[r];
      EXPECT_NE(what.find("barrier"), std::string::npos) << "rank " << r << ": " << what;
      EXPECT_NE(what.find("the ranks called different collectives"), std::string::npos)
          << "rank " << r << ": " << what;
      EXPECT_EQ(what.rfind(std::to_string(r == 0 ? kFailStep + 1 : kFailStep) + ": ", 0), 0u)
          << "rank " << r << ": " << what;
      if (r == 0) {
        const std::string why = where == Fail::kInBackward
                                    ? "the last backward threw (its step was dropped)"
                                    : "the last training forward had no backward through DDP";
        EXPECT_NE(what.find("on rank 0 of " + std::to_string(c.world) + ", " + why),
                  std::string::npos)
            << what;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DDP, DDPStepException, ::testing::ValuesIn(engine_worlds()),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::ddp_exception_test
