// N-rank DDP (N = 2, 3, 4) trained for 20 steps ends at the same parameters
// (within 1e-5) as single-process training on the concatenated batch, for
// SGD with momentum and Adam, for each strategy and with gradients as
// bucket views. Tiny bucket caps give several buckets per model, so the
// launch order and the bucket boundaries are exercised too. With
// COHORT_TEST_DEVICE=cuda the models, the data and the reference live on
// the GPU.
#include <gtest/gtest.h>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"
#include "tests/ddp/equivalence_case.h"

namespace cohort::testing::equivalence_test {
namespace {

constexpr int kSteps = kEquivalenceSteps;

struct Case {
  int world;
  std::string optimizer;
  SyncStrategy strategy;
  bool bucket_view;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  std::string s = "world" + std::to_string(c.world) + "_" + c.optimizer;
  s += c.strategy == SyncStrategy::Overlapped ? "_overlapped" : "_synchronous";
  if (c.bucket_view) s += "_bucketview";
  return s;
}

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, TwentyStepsMatchSingleProcess) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  const auto problem = make_equivalence_problem(c.world, c.optimizer);
  // The test is only meaningful if training moved the parameters.
  ASSERT_GT(max_abs_diff(problem.expected, problem.init), 1e-2);

  std::vector<EquivalenceRank> got(c.world);
  run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    got[comm->rank()] =
        train_equivalence_rank(comm, problem, c.optimizer, c.strategy, c.bucket_view);
  });
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(got[r].iterations, kSteps) << "rank " << r;
    EXPECT_GT(got[r].buckets, 2) << "bucket caps should split the model";
    EXPECT_LT(max_abs_diff(got[r].params, problem.expected), 1e-5) << "rank " << r;
  }
}

// LibTorch's Module::load gives every parameter the loaded storage (set_());
// a checkpoint restored into a DDP-wrapped model mid-training must keep the
// ranks equivalent to single-process training.
class ReloadMidTraining : public ::testing::TestWithParam<bool> {};

TEST_P(ReloadMidTraining, ModuleLoadKeepsEquivalence) {
  const bool bucket_view = GetParam();
  constexpr int kWorld = 2;
  torch::set_num_threads(1);
  torch::manual_seed(12);
  auto reference = make_ddp_mlp();
  const auto init = clone_all(reference->parameters());
  const auto xs = torch::randn({kSteps, kWorld * kRowsPerRank, 8});
  const auto ys = torch::randn({kSteps, kWorld * kRowsPerRank, 4});
  torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    torch::mse_loss(reference->forward(xs[s]), ys[s]).backward();
    opt.step();
  }
  const auto expected = clone_all(reference->parameters());
  ASSERT_GT(max_abs_diff(expected, init), 1e-2);

  std::vector<std::vector<torch::Tensor>> got(kWorld);
  run_ranks_shared(kWorld, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto model = make_ddp_mlp();
    if (r == 0) copy_parameters(*model, init);
    DDPOptions options;
    options.bucket_cap_mb = 0.0005;
    options.first_bucket_mb = 0.0002;
    options.gradient_as_bucket_view = bucket_view;
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
    torch::optim::SGD ropt(ddp.parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < kSteps; ++s) {
      if (s == kSteps / 2) {
        // Save and load back through the archive, as resuming does.
        torch::serialize::OutputArchive out;
        model->save(out);
        std::ostringstream bytes;
        out.save_to(bytes);
        std::istringstream in_bytes(bytes.str());
        torch::serialize::InputArchive in;
        in.load_from(in_bytes);
        model->load(in);
      }
      ropt.zero_grad();
      auto x = xs[s].narrow(0, r * kRowsPerRank, kRowsPerRank);
      auto y = ys[s].narrow(0, r * kRowsPerRank, kRowsPerRank);
      torch::mse_loss(ddp.forward(x), y).backward();
      ropt.step();
    }
    got[r] = clone_all(ddp.parameters());
    EXPECT_EQ(ddp.stats().iterations, kSteps) << "rank " << r;
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_LT(max_abs_diff(got[r], expected), 1e-5) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, ReloadMidTraining, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "bucketview" : "copy"; });

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int world : {2, 3, 4}) {
    for (std::string optimizer : {"sgd", "adam"}) {
      out.push_back({world, optimizer, SyncStrategy::Overlapped, false});
      out.push_back({world, optimizer, SyncStrategy::Synchronous, false});
      out.push_back({world, optimizer, SyncStrategy::Overlapped, true});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Ddp, Equivalence, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::equivalence_test
