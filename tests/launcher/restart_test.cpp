// --max-restarts: the whole local job is restarted after a failure, with
// COHORT_RESTART_COUNT telling the ranks which attempt they are in.
#include <gtest/gtest.h>

#include <set>

#include "support/subprocess.h"

namespace cohort::testing::restart_test {
namespace {

// Rank 1 fails in attempts 0 and 1; attempt 2 succeeds.
constexpr const char* kFailTwice = R"(
  echo "attempt $COHORT_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT port $MASTER_PORT"
  if [ "$COHORT_RESTART_COUNT" -lt 2 ] && [ "$RANK" = 1 ]; then exit 5; fi)";

TEST(Restart, SucceedsOnThirdAttempt) {
  ProcessResult r = run_cohortrun({"-n", "2", "--max-restarts", "2", "--", "sh", "-c", kFailTwice});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.err, "cohortrun: restart "), 2) << r.err;
  EXPECT_NE(r.err.find("cohortrun: restart 1/2 after rank 1 exited with "
                       "code 5\n"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("cohortrun: restart 2/2 after rank 1 exited with "
                       "code 5\n"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("[1] attempt 2 2 port "), std::string::npos) << r.out;
  // The port was picked by the launcher, so each attempt gets a new one.
  std::set<std::string> ports;
  for (const std::string& line : lines_of(r.out)) {
    if (line.rfind("[1] attempt", 0) == 0) {
      ports.insert(line.substr(line.rfind(' ') + 1));
    }
  }
  EXPECT_EQ(ports.size(), 3u) << r.out;
}

TEST(Restart, GivesUpWithTheRankCodeWhenRestartsRunOut) {
  ProcessResult r = run_cohortrun({"-n", "2", "--max-restarts", "1", "--", "sh", "-c", kFailTwice});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_EQ(count_of(r.err, "cohortrun: restart "), 1) << r.err;
  EXPECT_NE(r.err.find("restart 1/1 after rank 1 exited with code 5"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("attempt 2"), std::string::npos) << r.out;
}

TEST(Restart, AfterKilledRankAndKeepsAnExplicitPort) {
  const char* script = R"(
    echo "port $MASTER_PORT"
    if [ "$COHORT_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then kill -9 $$; fi)";
  ProcessResult r = run_cohortrun(
      {"-n", "2", "--max-restarts", "2", "--master-port", "29513", "--", "sh", "-c", script});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("cohortrun: restart 1/2 after rank 1 killed by signal "
                       "9 (SIGKILL)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_of(r.err, "cohortrun: restart "), 1) << r.err;
  EXPECT_EQ(count_of(r.out, "[1] port 29513"), 2) << r.out;
}

TEST(Restart, TimeoutCountsAsAFailedAttempt) {
  const char* script = R"(
    if [ "$COHORT_RESTART_COUNT" = 0 ]; then exec sleep 60; fi)";
  ProcessResult r =
      run_cohortrun({"-n", "1", "--max-restarts", "1", "--timeout", "3", "--", "sh", "-c", script});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  // The timeout also bounds the second attempt, which must start and exit
  // within it on a loaded machine: seconds, not a fraction of one.
  EXPECT_NE(r.err.find("restart 1/1 after job exceeded --timeout 3 s"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace cohort::testing::restart_test
