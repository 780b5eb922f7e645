// --timeout: a hanging job is reported and torn down, with exit code 124.
#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace cohort::testing {
namespace {

TEST(Timeout, HangingRankIsReportedAndStopped) {
  TempDir dir;
  const char* script = R"(
    if [ "$RANK" = 1 ]; then
      echo $$ > "$T/pid"; echo "stuck in step 7"; exec sleep 60
    fi)";
  ProcessResult r = run_cohortrun({"-n", "2", "--timeout", "2", "--", "sh", "-c", script},
                                  Seconds(20), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_GE(r.seconds, 1.9);
  EXPECT_LT(r.seconds, 6);
  EXPECT_NE(r.err.find("job exceeded --timeout 2 s; ranks still running: [1]"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("[1] stuck in step 7"), std::string::npos) << r.err;
  for (pid_t pid : read_pids(dir.path())) {
    EXPECT_FALSE(process_exists(pid)) << "rank " << pid << " survived";
  }
}

TEST(Timeout, RankIgnoringSigtermIsKilledAfterTheGrace) {
  TempDir dir;
  // The ignored SIGTERM is inherited by sleep: only SIGKILL stops it.
  ProcessResult r = run_cohortrun({"-n", "2", "--timeout", "0.5", "--", "sh", "-c",
                                   R"(trap '' TERM; echo $$ > "$T/pid.$RANK"; exec sleep 60)"},
                                  Seconds(20), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 124) << r.err;
  EXPECT_NE(r.err.find("ranks still running: [0, 1]"), std::string::npos) << r.err;
  EXPECT_GE(r.seconds, 3.4);  // 0.5 s timeout + 3 s grace
  EXPECT_LT(r.seconds, 8);
  for (pid_t pid : read_pids(dir.path())) {
    EXPECT_FALSE(process_exists(pid)) << "rank " << pid << " survived";
  }
}

}  // namespace
}  // namespace cohort::testing
