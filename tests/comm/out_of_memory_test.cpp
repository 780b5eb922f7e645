// Ranks that run out of memory under a data limit fail with the allocation
// named, and cohortrun exits non-zero: never a hang. Ranks are processes
// (OUT_OF_MEMORY_BIN, started by cohortrun); each caps its own data segment.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "support/subprocess.h"

namespace cohort::testing::out_of_memory_test {
namespace {

using Param = std::tuple<std::string, int>;  // backend, world size

class OutOfMemory : public ::testing::TestWithParam<Param> {};

TEST_P(OutOfMemory, FailsWithTheAllocationNamed) {
  const auto& [backend, world] = GetParam();
  // A hang shows as cohortrun's 40 s job limit (or, failing that, our 60 s);
  // failing takes LibTorch's start-up and a few dozen steps.
  auto r = run_cohortrun({"-n", std::to_string(world), "--backend", backend, "--timeout", "40",
                          "--", OUT_OF_MEMORY_BIN},
                         Seconds(60), {"COHORT_TIMEOUT=30"});
  const std::string output = r.out + r.err;
  ASSERT_FALSE(r.timed_out) << output;
  // 3: a rank that ran out (the program's code); 2: its peers, which see it
  // leave mid-collective, when cohortrun reports one of them. Never a signal.
  EXPECT_TRUE(r.exit_code == 3 || (world > 1 && r.exit_code == 2)) << r.exit_code << "\n" << output;
  EXPECT_NE(output.find("out of memory: "), std::string::npos) << output;
  EXPECT_NE(output.find("can't allocate memory"), std::string::npos) << output;
  EXPECT_EQ(output.find("killed by signal"), std::string::npos) << output;
  EXPECT_EQ(output.find("terminate called"), std::string::npos) << output;
  EXPECT_EQ(output.find("exceeded --timeout"), std::string::npos) << output;
}

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Gloo, OutOfMemory,
                         ::testing::Combine(::testing::Values("gloo"), ::testing::Values(1, 3)),
                         name_of);
#ifdef COHORT_WITH_UCX
INSTANTIATE_TEST_SUITE_P(Ucx, OutOfMemory,
                         ::testing::Combine(::testing::Values("ucx"), ::testing::Values(1, 3)),
                         name_of);
#endif

}  // namespace
}  // namespace cohort::testing::out_of_memory_test
