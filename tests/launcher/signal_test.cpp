// Signals to the launcher: forwarded, ranks reaped, 128 + signal, no
// restart. And a launcher killed outright takes its ranks with it.
#include <gtest/gtest.h>
#include <signal.h>

#include <thread>

#include "support/subprocess.h"

namespace cohort::testing::signal_test {
namespace {

// Each rank records its pid and a background child's (which, as a shell's
// background job, ignores SIGINT: only the launcher's teardown stops it),
// then says it is ready.
constexpr const char* kReadyScript = R"(
  sleep 60 & echo "$$ $!" > "$T/tmp.$RANK"; mv "$T/tmp.$RANK" "$T/pids.$RANK"
  echo ready
  wait)";

void expect_stops_on(int sig, int expected_code) {
  TempDir dir;
  Subprocess launcher(
      cohortrun_argv({"-n", "3", "--max-restarts", "5", "--", "sh", "-c", kReadyScript}),
      {"T=" + dir.path()});
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 3, Seconds(10)));
  ::kill(launcher.pid(), sig);
  ProcessResult r = launcher.finish(Seconds(10));
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, expected_code) << r.err;
  EXPECT_NE(r.err.find("received " + std::string(sig == SIGINT ? "SIGINT" : "SIGTERM")),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("restart"), std::string::npos) << r.err;
  std::vector<pid_t> pids = read_pids(dir.path());
  EXPECT_EQ(pids.size(), 6u);
  for (pid_t pid : pids) {
    EXPECT_FALSE(process_exists(pid)) << "process " << pid << " survived";
  }
}

TEST(Signals, SigintIsForwardedAndGives130) { expect_stops_on(SIGINT, 130); }

TEST(Signals, SigtermIsForwardedAndGives143) { expect_stops_on(SIGTERM, 143); }

// A rank fails, and a SIGTERM comes while the other rank (which traps it)
// shuts down: it is the launcher's first, so it is not called a repeat, and
// it ends the teardown at once with SIGKILL.
TEST(Signals, FirstSigtermDuringATeardownIsNotCalledARepeat) {
  TempDir dir;
  const char* script = R"(
    if [ "$RANK" = 1 ]; then
      while [ ! -e "$T/trapped" ]; do sleep 0.05; done; exit 3
    fi
    trap 'echo terminating' TERM
    echo $$ > "$T/pid.$RANK"; touch "$T/trapped"
    while :; do sleep 0.1; done)";
  Subprocess launcher(cohortrun_argv({"-n", "2", "--", "sh", "-c", script}), {"T=" + dir.path()});
  ASSERT_TRUE(launcher.wait_for_stdout("terminating", 1, Seconds(20)));
  ::kill(launcher.pid(), SIGTERM);
  ProcessResult r = launcher.finish(Seconds(20));
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.exit_code, 143) << r.err;
  EXPECT_NE(r.err.find("received SIGTERM while the ranks shut down; killing the ranks"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("again"), std::string::npos) << r.err;
  for (pid_t pid : read_pids(dir.path())) {
    EXPECT_FALSE(process_exists(pid)) << "process " << pid << " survived";
  }
}

TEST(Signals, RanksDieWhenTheLauncherIsKilled) {
  TempDir dir;
  Subprocess launcher(cohortrun_argv({"-n", "2", "--", "sh", "-c",
                                      R"(echo $$ > "$T/pid.$RANK"; echo ready; exec sleep 60)"}),
                      {"T=" + dir.path()});
  ASSERT_TRUE(launcher.wait_for_stdout("ready", 2, Seconds(10)));
  ::kill(launcher.pid(), SIGKILL);
  ProcessResult r = launcher.finish(Seconds(10));
  EXPECT_EQ(r.exit_code, 137);
  std::vector<pid_t> pids = read_pids(dir.path());
  ASSERT_EQ(pids.size(), 2u);
  // PR_SET_PDEATHSIG acts asynchronously; the orphans go to init, which
  // may leave them zombies, so wait for "not running".
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(5);
  for (pid_t pid : pids) {
    while (process_running(pid) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_FALSE(process_running(pid)) << "rank " << pid << " outlived it";
  }
}

}  // namespace
}  // namespace cohort::testing::signal_test
