// A failing rank: the launcher exits with its code, names it, and leaves no
// process of the job behind.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include "support/subprocess.h"

namespace cohort::testing::exit_code_test {
namespace {

void expect_all_gone(const std::string& dir) {
  std::vector<pid_t> pids = read_pids(dir);
  EXPECT_FALSE(pids.empty()) << "ranks recorded no pids";
  for (pid_t pid : pids) {
    EXPECT_FALSE(process_exists(pid)) << "process " << pid << " survived";
  }
}

TEST(ExitCode, PropagatesFailedRankCodeAndKillsTheOthers) {
  TempDir dir;
  // Rank 1 fails only once the others have started their background sleep
  // (a grandchild, in the rank's process group) and recorded its pid.
  const char* script = R"(
    if [ "$RANK" = 1 ]; then
      while [ ! -e "$T/pids.0" ] || [ ! -e "$T/pids.2" ]; do sleep 0.02; done
      echo "rank 1 giving up"
      exit 3
    fi
    sleep 60 & echo "$$ $!" > "$T/tmp.$RANK"; mv "$T/tmp.$RANK" "$T/pids.$RANK"
    wait)";
  ProcessResult r =
      run_cohortrun({"-n", "3", "--", "sh", "-c", script}, Seconds(20), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 10);
  EXPECT_NE(r.err.find("rank 1 exited with code 3"), std::string::npos) << r.err;
  // The report carries the rank's last output.
  EXPECT_NE(r.err.find("[1] rank 1 giving up"), std::string::npos) << r.err;
  expect_all_gone(dir.path());
}

TEST(ExitCode, RankKilledBySignalGives128PlusSignal) {
  TempDir dir;
  const char* script = R"(
    echo $$ > "$T/pid.$RANK"
    if [ "$RANK" = 2 ]; then kill -9 $$; fi
    exec sleep 60)";
  ProcessResult r =
      run_cohortrun({"-n", "3", "--", "sh", "-c", script}, Seconds(20), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 137) << r.err;
  EXPECT_NE(r.err.find("rank 2 killed by signal 9 (SIGKILL)"), std::string::npos) << r.err;
  expect_all_gone(dir.path());
}

TEST(ExitCode, AllRanksSucceedingGivesZero) {
  ProcessResult r = run_cohortrun({"-n", "4", "--", "true"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
}

TEST(ExitCode, ProgramNotFoundGives127) {
  ProcessResult r = run_cohortrun({"-n", "2", "--", "/nonexistent/program"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_NE(r.err.find("cannot exec '/nonexistent/program'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exited with code 127"), std::string::npos) << r.err;
}

TEST(ExitCode, LeftoverBackgroundProcessesAreStoppedAfterSuccess) {
  TempDir dir;
  // Detached from the pipes, so only the process-group teardown finds it.
  const char* script = R"(sleep 60 >/dev/null 2>&1 & echo $! > "$T/pid.$RANK"; exit 0)";
  ProcessResult r =
      run_cohortrun({"-n", "2", "--", "sh", "-c", script}, Seconds(20), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  expect_all_gone(dir.path());
}

// A daemonized grandchild's own child: killing the grandchild orphans the
// child to the launcher after the first kill pass, so one pass is not enough.
TEST(ExitCode, DaemonizedGrandchildrenAndTheirChildrenAreStopped) {
  TempDir dir;
  const char* script = R"(setsid sh -c 'exec </dev/null >/dev/null 2>&1; sleep 300 & )"
                       R"(echo $! > "$T/pid.tmp" && mv "$T/pid.tmp" "$T/pid.0"; wait' &)"
                       R"( while [ ! -s "$T/pid.0" ]; do sleep 0.02; done)";
  ProcessResult r =
      run_cohortrun({"-n", "1", "--", "sh", "-c", script}, Seconds(20), {"T=" + dir.path()});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  expect_all_gone(dir.path());
  for (pid_t pid : read_pids(dir.path())) ::kill(pid, SIGKILL);  // a survivor, if any
}

// Two ranks fail while the launcher is stopped, so both are waiting to be
// reaped at once: the one that failed first (rank 1) is named, not the one
// spawned first.
TEST(ExitCode, OfRanksFailingTogetherTheFirstToFailIsNamed) {
  const char* script =
      R"(echo up; if [ "$RANK" = 1 ]; then sleep 1; exit 3; fi; sleep 2.5; exit 5)";
  Subprocess launcher(cohortrun_argv({"-n", "2", "--", "sh", "-c", script}));
  ASSERT_TRUE(launcher.wait_for_stdout("up", 2, Seconds(10)));
  ::kill(launcher.pid(), SIGSTOP);
  // Both ranks exit meanwhile, rank 1 first by 1.5 s: a margin that a
  // loaded machine's late start of one rank cannot invert.
  ::usleep(3000 * 1000);
  ::kill(launcher.pid(), SIGCONT);
  ProcessResult r = launcher.finish(Seconds(20));
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("rank 1 exited with code 3"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace cohort::testing::exit_code_test
