// Ranks that build or run a fully sharded model differently
// (agreement_cases.h), ranks as processes in the world init() finds (under
// mpirun for MPI, under cohortrun for Gloo and UCX), with COHORT_DEBUG off:
// each rank's own call throws, naming what differs and the odd rank, within
// 5 s; no rank aborts, and the world stays usable for the next case.
#include <gtest/gtest.h>

#include <chrono>

#include "cohort/cohort.h"
#include "tests/fsdp/agreement_cases.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::fsdp_world_test {
namespace {

using namespace fsdp_test;
using Clock = std::chrono::steady_clock;

class FSDPWorld : public ::testing::TestWithParam<size_t> {};

TEST_P(FSDPWorld, EveryRankNamesWhatDiffers) {
  const auto& c = agreement_cases()[GetParam()];
  auto comm = world_ptr();
  if (comm->size() < c.min_world) GTEST_SKIP() << "needs " << c.min_world << " ranks";
  const auto start = Clock::now();
  std::string error = "no error";
  try {
    c.run(comm);
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
  for (const auto& want : c.expect(comm->size())) {
    EXPECT_NE(error.find(want), std::string::npos) << "lacks \"" << want << "\": " << error;
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPWorld, ::testing::Range<size_t>(0, agreement_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return agreement_cases()[info.param].name;
                         });

// The golden case with ranks as processes: fully_shard at this world
// trains 10 steps and gathers the one-process parameters within 1e-6
// (golden_test.cpp's case, AdamW, resharding after forward). With
// COHORT_TEST_DEVICE=cuda on the GPU, where ranks as threads cannot share
// one (scripts/gpu-check.sh).
TEST(FSDPWorldGolden, ParametersEqualOneProcess) {
  auto comm = world_ptr();
  if (kBatch % comm->size() != 0) GTEST_SKIP() << "the batch of " << kBatch << " needs 1-4 ranks";
  const auto batches = make_batches(11);
  const auto expected = reference(Opt::AdamW, batches);
  auto bare = make_model(comm, {true, {}});
  auto twin = make_model(nullptr, {});
  init_parameters(*twin, 7);
  auto model = fully_shard(bare, comm, {true, {}});
  load_from(model, *twin);
  auto optimizer = make_optimizer(Opt::AdamW, model->parameters());
  train_steps(model, *optimizer, batches, *comm, 1);
  expect_close(model->full_state_dict(), expected, 1e-6, "rank " + std::to_string(comm->rank()));
}

}  // namespace
}  // namespace cohort::testing::fsdp_world_test
