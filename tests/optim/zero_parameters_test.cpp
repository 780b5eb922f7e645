// Which parameters ZeRO steps, against one process of plain LibTorch, on
// every engine ranks as threads run on, at worlds 1 to 3: under
// WorldSizeInvariant a layer that no leaf uses keeps its values under
// AdamW's weight decay.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "cohort/optim/zero_redundancy_optimizer.h"
#include "tests/optim/optim_test_support.h"

namespace cohort::testing::zero_parameters_test {
namespace {

struct Case {
  std::string backend;
  int world;
};

std::vector<Case> cases() {
  std::vector<std::string> backends = {"gloo"};
#ifdef COHORT_WITH_UCX
  backends.push_back("ucx");
#endif
  std::vector<Case> out;
  for (const auto& b : backends) {
    for (int w : {1, 2, 3}) out.push_back({b, w});
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.backend + "_world" + std::to_string(info.param.world);
}

// gtest prints a failing case's parameter.
void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << " world " << c.world; }

ThreadRanksOptions options_for(const Case& c) {
  ThreadRanksOptions o;
  o.backend = c.backend;
  return o;
}

// Values drawn from `seed` alone (ranks are threads: no global generator).
torch::Tensor draw(uint64_t seed, at::IntArrayRef sizes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(sizes, gen);
}

std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

void set_all(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard no_grad;
  ASSERT_EQ(params.size(), values.size());
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

// Weight decay moves a parameter that an optimizer steps with a zero
// gradient, so a wrongly defined gradient shows.
const auto kAdamW = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
constexpr int kSteps = 4;
// L = 6 leaves of 2 rows: the global batch is 12 rows at every world.
constexpr int64_t kLeaves = 6, kLeafRows = 2;
constexpr double kTolerance = 1e-5;

class ZeroParameters : public ::testing::TestWithParam<Case> {};

// ---- WorldSizeInvariant: a layer that no leaf uses ----

// OptimNet's `unused` layer takes part in no forward. One process over the
// 6 leaves (each leaf's loss its mean, the step's gradient their mean) never
// gives it a gradient, so AdamW skips it: it keeps its initial values,
// weight decay included, at stage 1 and 2.
TEST_P(ZeroParameters, WorldSizeInvariantLeavesAnUnusedLayerUnstepped) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const auto xs = draw(11, {kSteps, kLeaves, kLeafRows, 7});
  const auto ys = draw(12, {kSteps, kLeaves, kLeafRows, 1});
  OptimNet reference(/*with_unused=*/true);
  set_all(reference->parameters(), [&] {
    std::vector<torch::Tensor> v;
    uint64_t seed = 100;
    for (const auto& p : reference->parameters()) v.push_back(draw(seed++, p.sizes()) * 0.5);
    return v;
  }());
  const auto init = clone_all(reference->parameters());
  std::vector<std::string> names;
  for (const auto& p : reference->named_parameters()) names.push_back(p.key());
  {
    torch::optim::AdamW opt(reference->parameters(), kAdamW);
    for (int s = 0; s < kSteps; ++s) {
      reference->zero_grad(/*set_to_none=*/true);
      for (int64_t l = 0; l < kLeaves; ++l) {
        (torch::mse_loss(reference->forward(xs[s][l]), ys[s][l]) / kLeaves).backward();
      }
      opt.step();
    }
  }
  const auto want = clone_all(reference->parameters());
  ASSERT_EQ(names[2], "unused.weight");
  ASSERT_TRUE(want[2].equal(init[2]) && want[3].equal(init[3]));
  ASSERT_GT(max_diff(want, init), 1e-3);

  for (const int stage : {1, 2}) {
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          const int r = comm->rank();
          OptimNet net(/*with_unused=*/true);
          set_all(net->parameters(), init);
          DDPOptions options;
          options.determinism = Determinism::WorldSizeInvariant;
          options.leaves = kLeaves;
          DistributedDataParallel<OptimNet> ddp(net, comm, options);
          ZeroOptions zo;
          zo.stage = stage;
          zo.determinism = Determinism::WorldSizeInvariant;
          zo.leaves = kLeaves;
          auto zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kAdamW, zo);
          for (int s = 0; s < kSteps; ++s) {
            zero->zero_grad();
            for (int64_t k = 0; k < ddp.local_leaves(); ++k) {
              const int64_t l = ddp.first_leaf() + k;
              torch::mse_loss(ddp.forward(xs[s][l]), ys[s][l]).backward();
            }
            zero->step();
          }
          const auto got = net->parameters();
          const std::string where =
              "stage " + std::to_string(stage) + ", rank " + std::to_string(r);
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), kTolerance)
                << where << ": '" << names[i] << "'";
          }
          EXPECT_TRUE(got[2].equal(init[2]) && got[3].equal(init[3]))
              << where << ": the unused layer moved";
        },
        options_for(c));
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroParameters, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::zero_parameters_test
