// Ranks that build or run a fully sharded model differently
// (agreement_cases.h), ranks as processes in the world init() finds (under
// mpirun for MPI, under cohortrun for Gloo and UCX), with COHORT_DEBUG off:
// each rank's own call throws, naming what differs and the odd rank, within
// 5 s; no rank aborts, and the world stays usable for the next case.
#include <gtest/gtest.h>

#include <chrono>

#include "cohort/cohort.h"
#include "tests/fsdp/agreement_cases.h"

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

}  // namespace
}  // namespace cohort::testing::fsdp_world_test
