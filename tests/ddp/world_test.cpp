// DDP against one process with ranks as processes (under cohortrun): each
// rank trains its rows of every global batch for 20 steps, every strategy
// with and without bucket views, and ends within 1e-5 of one process on
// the whole batch (computed by every rank itself). With
// COHORT_TEST_DEVICE=cuda the models, the data and the reference live on
// the GPU; ranks as threads cannot share one there, since LibTorch runs
// every thread's CUDA backward on one thread per GPU (scripts/gpu-check.sh).
#include <gtest/gtest.h>

#include "cohort/cohort.h"
#include "tests/ddp/equivalence_case.h"

namespace cohort::testing::ddp_world_test {
namespace {

struct Case {
  SyncStrategy strategy;
  bool bucket_view;
};

class DdpWorld : public ::testing::TestWithParam<Case> {};

TEST_P(DdpWorld, TwentyStepsMatchOneProcess) {
  const auto c = GetParam();
  auto comm = world_ptr();
  torch::set_num_threads(1);
  // Every rank draws the same problem and computes the reference itself.
  const auto problem = make_equivalence_problem(comm->size(), "sgd");
  ASSERT_GT(max_abs_diff(problem.expected, problem.init), 1e-2)
      << "training must move the parameters";
  const auto got = train_equivalence_rank(comm, problem, "sgd", c.strategy, c.bucket_view);
  EXPECT_EQ(got.iterations, kEquivalenceSteps);
  EXPECT_GT(got.buckets, 2) << "bucket caps should split the model";
  EXPECT_LT(max_abs_diff(got.params, problem.expected), 1e-5) << "rank " << comm->rank();
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpWorld,
                         ::testing::Values(Case{SyncStrategy::Overlapped, false},
                                           Case{SyncStrategy::Overlapped, true},
                                           Case{SyncStrategy::Synchronous, false}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.strategy == SyncStrategy::Overlapped
                                                  ? "overlapped"
                                                  : "synchronous") +
                                  (info.param.bucket_view ? "_bucketview" : "");
                         });

}  // namespace
}  // namespace cohort::testing::ddp_world_test
