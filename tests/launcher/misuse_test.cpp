// Jobs started wrongly: two processes given the same RANK must be told so by
// name, not left to time out waiting for the rank nobody started.
#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace cohort::testing::misuse_test {
namespace {

TEST(Misuse, DuplicateRankIsNamed) {
#ifndef COHORT_SMOKE_BIN
  GTEST_SKIP() << "cohort_smoke is not built";
#else
  // Rank 2's process claims RANK=1 as well.
  const std::string script =
      std::string(R"(if [ "$RANK" = 2 ]; then export RANK=1; fi; exec )") + COHORT_SMOKE_BIN;
  ProcessResult r =
      run_cohortrun({"-n", "3", "--", "sh", "-c", script}, Seconds(55), {"COHORT_TIMEOUT=45"});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("RANK=1 is used by more than one process (a duplicate RANK)"),
            std::string::npos)
      << r.err;
  // Three LibTorch start-ups on two loaded cores take seconds; a timeout
  // would take 45.
  EXPECT_LT(r.seconds, 30) << "the duplicate was found only by a timeout";
#endif
}

}  // namespace
}  // namespace cohort::testing::misuse_test
