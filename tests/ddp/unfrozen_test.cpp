// Parameters whose requires_grad changes after DDP was built: one frozen
// when DDP was built and unfrozen at step 3 (frozen again at step 6), one
// trainable when it was built and frozen at step 2 (unfrozen again at step
// 5). DDP reduces the parameters that require grad at each forward, so after
// 8 SGD-with-momentum steps every rank's parameters are bitwise the same and
// equal, within 1e-6, one process's on the ranks' rows together with the
// same freezing: ranks as threads over Gloo and UCX at worlds 1 and 3, with
// gradients as bucket views or not, a bucket per parameter,
// find_unused_parameters, and world-size-invariant leaves. DDP used to keep
// the set of its construction: the unfrozen weight was trained on each
// rank's own gradient, and the frozen one was refused at the next forward as
// a parameter without gradient. Ranks that change different parameters, or
// a rank that changes one alone, get an error on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::ddp_unfrozen_test {
namespace {

using Mlp = torch::nn::Sequential;

constexpr int kSteps = 8;
constexpr int64_t kLeaves = 3, kRows = 2;  // rows per leaf
// make_ddp_mlp()'s parameters: 0 is the first weight, 2 the second.
constexpr size_t kLate = 0, kEarly = 2;

// Whether parameter i requires grad at step s (built as at step -1).
bool trainable(size_t i, int s) {
  if (i == kLate) return s >= 3 && s < 6;   // frozen when DDP was built
  if (i == kEarly) return s < 2 || s >= 5;  // trainable when DDP was built
  return true;
}

void set_flags(torch::nn::Module& net, int s) {
  auto ps = net.parameters();
  for (size_t i = 0; i < ps.size(); ++i) ps[i].set_requires_grad(trainable(i, s));
}

using Mode = DdpMode;

// The bucket modes and per-leaf determinism.
std::vector<Mode> modes() {
  auto out = ddp_bucket_modes();
  DdpMode leaves{"leaves", {}};
  leaves.options.determinism = Determinism::WorldSizeInvariant;
  leaves.options.leaves = kLeaves;
  out.push_back(leaves);
  return out;
}

struct Data {
  std::vector<torch::Tensor> init;
  torch::Tensor x, y;  // [steps, leaves * rows, features]
};

Data make_data() {
  torch::manual_seed(7);
  Data d;
  d.init = clone_all(make_ddp_mlp()->parameters());
  d.x = torch::randn({kSteps, kLeaves * kRows, 8});
  d.y = torch::randn({kSteps, kLeaves * kRows, 4});
  return d;
}

Mlp make_net(const Data& d) {
  auto net = make_ddp_mlp();
  copy_parameters(*net, d.init);
  set_flags(*net, -1);
  return net;
}

// SGD with momentum; gradients set to none before each step, so a frozen
// parameter is not stepped.
torch::optim::SGD make_sgd(const std::vector<torch::Tensor>& ps) {
  return torch::optim::SGD(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::vector<torch::Tensor> one_process(const Data& d) {
  auto net = make_net(d);
  auto opt = make_sgd(net->parameters());
  for (int s = 0; s < kSteps; ++s) {
    set_flags(*net, s);
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    torch::mse_loss(net->forward(d.x[s]), d.y[s]).backward();
    opt.step();
  }
  return clone_all(net->parameters());
}

struct Trained {
  std::vector<torch::Tensor> params;
  std::string thrown;         // "step s: what" of the first refused step
  bool reduces_late = false;  // DDP reduced kLate while it was trainable
};

// One step on this rank's rows: one backward, or one per leaf it owns.
void step_once(DistributedDataParallel<Mlp>& ddp, const Data& d, int s, int rank, int world,
               bool leaves) {
  if (!leaves) {
    const int64_t n = kLeaves * kRows / world;
    torch::mse_loss(ddp.forward(d.x[s].narrow(0, rank * n, n)), d.y[s].narrow(0, rank * n, n))
        .backward();
    return;
  }
  for (int64_t k = 0; k < ddp.local_leaves(); ++k) {
    const int64_t from = (ddp.first_leaf() + k) * kRows;
    torch::mse_loss(ddp.forward(d.x[s].narrow(0, from, kRows)), d.y[s].narrow(0, from, kRows))
        .backward();
  }
}

Trained train(const Data& d, const Mode& mode, const std::shared_ptr<Communicator>& comm) {
  auto net = make_net(d);
  DistributedDataParallel<Mlp> ddp(net, comm, mode.options);
  auto opt = make_sgd(ddp.parameters());
  const auto late = net->parameters()[kLate];
  const bool leaves = mode.options.determinism == Determinism::WorldSizeInvariant;
  Trained out;
  for (int s = 0; s < kSteps; ++s) {
    set_flags(*net, s);
    try {
      for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
      step_once(ddp, d, s, comm->rank(), comm->size(), leaves);
      opt.step();
    } catch (const std::exception& e) {
      if (out.thrown.empty()) out.thrown = "step " + std::to_string(s) + ": " + e.what();
    }
    if (trainable(kLate, s)) {
      for (const auto& p : ddp.reducer().parameters()) out.reduces_late |= p.is_same(late);
    }
  }
  out.params = clone_all(net->parameters());
  return out;
}

class DdpUnfrozen : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DdpUnfrozen, ReducesTheParametersThatRequireGradAtEachForward) {
  const auto c = GetParam();
  const auto d = make_data();
  const auto want = one_process(d);
  // The weight unfrozen late moved while it was trainable.
  ASSERT_GT((want[kLate] - d.init[kLate]).abs().max().item<double>(), 1e-3);
  for (const auto& mode : modes()) {
    auto got = results_of_ranks<Trained>(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          return train(d, mode, comm);
        },
        options_for(c));
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world)) << mode.name;
    for (const auto& [rank, trained] : got) {
      const std::string where = mode.name + ", rank " + std::to_string(rank);
      EXPECT_EQ(trained.thrown, "") << where;
      EXPECT_TRUE(trained.reduces_late) << where;
      EXPECT_LT(max_abs_diff(trained.params, want), 1e-6) << where;
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(torch::equal(trained.params[i], got[0].params[i]))
            << where << ": parameter " << i << " differs from rank 0's by "
            << (trained.params[i] - got[0].params[i]).abs().max().item<double>();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpUnfrozen, ::testing::ValuesIn(engine_worlds({1, 3})),
                         engine_world_name);

// At world 3: rank 1 alone unfreezes the frozen weight, or every rank
// unfreezes one but rank 0 another. Either way every rank throws at that
// step (no rank waits for a peer until its timeout): DDP cannot reduce
// parameters that differ across ranks.
class DdpUnfrozenDisagreement : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DdpUnfrozenDisagreement, IsAnErrorOnEveryRank) {
  const auto c = GetParam();
  const auto d = make_data();
  for (const bool alone : {true, false}) {
    const auto seen = errors_on_every_rank(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          auto net = make_ddp_mlp();
          copy_parameters(*net, d.init);
          net->parameters()[kLate].set_requires_grad(false);
          net->parameters()[1].set_requires_grad(false);
          DistributedDataParallel<Mlp> ddp(net, comm);
          const int r = comm->rank();
          for (int s = 0; s < 3; ++s) {
            if (s == 2) {
              if (alone) {
                if (r == 1) net->parameters()[kLate].set_requires_grad(true);
              } else {
                net->parameters()[r == 0 ? kLate : 1].set_requires_grad(true);
              }
            }
            step_once(ddp, d, s, r, comm->size(), false);
          }
        },
        [&] {
          auto o = options_for(c);
          o.timeout = std::chrono::seconds(5);
          return o;
        }());
    for (size_t r = 0; r < seen.size(); ++r) {
      const std::string where = std::string(alone ? "alone" : "different parameters") + ", rank " +
                                std::to_string(r) + ": " + seen[r];
      EXPECT_NE(seen[r], kNoError) << where;
      EXPECT_EQ(seen[r].find("imeout"), std::string::npos) << where;
      EXPECT_EQ(seen[r].find("timed out"), std::string::npos) << where;
      if (!alone) {
        EXPECT_NE(seen[r].find("ranks disagree on the parameters whose requires_grad changed"),
                  std::string::npos)
            << where;
      } else if (r == 1) {
        EXPECT_NE(seen[r].find("requires grad now: '0.weight') but not on every rank"),
                  std::string::npos)
            << where;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpUnfrozenDisagreement, ::testing::ValuesIn(engine_worlds({3})),
                         engine_world_name);

// With world-size-invariant leaves the set may change only between steps:
// unfreezing between two leaves of a rank is refused at the next leaf's
// forward, on every rank (6 leaves of one row: 2 a rank at world 3).
class DdpUnfrozenLeaves : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DdpUnfrozenLeaves, BetweenTheLeavesOfAStepIsRefusedOnEveryRank) {
  const auto c = GetParam();
  const auto d = make_data();
  const auto seen = errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto net = make_net(d);
        DDPOptions o;
        o.determinism = Determinism::WorldSizeInvariant;
        o.leaves = 2 * kLeaves;
        DistributedDataParallel<Mlp> ddp(net, comm, o);
        for (int64_t k = 0; k < ddp.local_leaves(); ++k) {
          if (k == 1) net->parameters()[kLate].set_requires_grad(true);
          const int64_t row = ddp.first_leaf() + k;
          torch::mse_loss(ddp.forward(d.x[0].narrow(0, row, 1)), d.y[0].narrow(0, row, 1))
              .backward();
        }
      },
      [&] {
        auto o = options_for(c);
        o.timeout = std::chrono::seconds(5);
        return o;
      }());
  for (size_t r = 0; r < seen.size(); ++r) {
    EXPECT_NE(seen[r].find("requires grad now: '0.weight'), but with determinism "
                           "WorldSizeInvariant the parameters may change only between steps"),
              std::string::npos)
        << "rank " << r << ": " << seen[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpUnfrozenLeaves, ::testing::ValuesIn(engine_worlds({1, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::ddp_unfrozen_test
