// --timeout: a hanging job is reported and torn down, with exit code 124.
#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace cohort::testing::timeout_test {
namespace {

TEST(Timeout, HangingRankIsReportedAndStopped) {
  TempDir dir;
  const char* script = R"(
    if [ "$RANK" = 1 ]; then
      echo $$ > "$T/pid"; echo "stuck in step 7"; exec sleep 60
    fi)";
  // 5 s: rank 1 must have printed its line before the timeout, even when it
  // starts late on a loaded machine.
  ProcessResult r = run_cohortrun({"-n", "2", "--timeout", "5", "--", "sh", "-c", script},
                                  Seconds(40), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_GE(r.seconds, 4.9);
  EXPECT_LT(r.seconds, 30);  // rank 1 sleeps 60 s: only the timeout ends it sooner
  EXPECT_NE(r.err.find("job exceeded --timeout 5 s; ranks still running: [1]"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("[1] stuck in step 7"), std::string::npos) << r.err;
  for (pid_t pid : read_pids(dir.path())) {
    EXPECT_FALSE(process_exists(pid)) << "rank " << pid << " survived";
  }
}

TEST(Timeout, RankIgnoringSigtermIsKilledAfterTheGrace) {
  TempDir dir;
  // The ignored SIGTERM is inherited by sleep: only SIGKILL stops it.
  // 2 s: both shells must have run `trap` before the SIGTERM comes.
  ProcessResult r = run_cohortrun({"-n", "2", "--timeout", "2", "--", "sh", "-c",
                                   R"(trap '' TERM; echo $$ > "$T/pid.$RANK"; exec sleep 60)"},
                                  Seconds(40), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_NE(r.err.find("ranks still running: [0, 1]"), std::string::npos) << r.err;
  EXPECT_GE(r.seconds, 4.9);  // 2 s timeout + 3 s grace
  EXPECT_LT(r.seconds, 30);   // the ranks sleep 60 s: SIGKILL ended them
  for (pid_t pid : read_pids(dir.path())) {
    EXPECT_FALSE(process_exists(pid)) << "rank " << pid << " survived";
  }
}

}  // namespace
}  // namespace cohort::testing::timeout_test
