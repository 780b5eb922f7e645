// An MPI job started the wrong way: ranks started by cohortrun without
// `--backend mpi` are each an MPI world of one. cohort::init must refuse
// that, saying how to launch, instead of running independent world-1 jobs.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <sstream>
#include <string>

namespace launch_test {
namespace {

// The output of `command` (stdout and stderr) and its exit status.
std::pair<std::string, int> run_shell(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {"popen failed", -1};
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) output.append(buf, n);
  const int raw = pclose(pipe);
  return {output, WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw)};
}

// Runs `script` on 2 ranks under `cohortrun --backend mpi` and checks that
// every line of both streams carries its rank's "[rank] " prefix, as under
// the Gloo path: rank r writes "out r rest" and "err r".
void expect_prefixed_lines(const std::string& script) {
  const auto [output, status] = run_shell(
      "timeout -k 5 60 " COHORTRUN_BIN " -n 2 --backend mpi -- sh -c '" + script + "' 2>&1");
  EXPECT_EQ(status, 0) << output;
  std::istringstream lines(output);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    ++count;
    const std::string r = line.substr(1, 1);
    EXPECT_TRUE(line == "[" + r + "] out " + r + " rest" || line == "[" + r + "] err " + r) << line;
  }
  EXPECT_EQ(count, 4) << output;
  for (const char* want : {"[0] out 0 rest\n", "[1] out 1 rest\n", "[0] err 0\n", "[1] err 1\n"}) {
    EXPECT_NE(output.find(want), std::string::npos) << want << " in:\n" << output;
  }
}

TEST(MpiLaunch, EveryLineHasItsRankPrefix) {
  expect_prefixed_lines("r=$OMPI_COMM_WORLD_RANK; echo \"out $r rest\"; echo \"err $r\" >&2");
}

// A partial line is joined with its rest under its rank's prefix.
TEST(MpiLaunch, APartialLineJoinsItsRest) {
  const std::string version = run_shell("mpirun --version 2>&1").first;
  if (version.find("(Open MPI) 5.") != std::string::npos) {
    // Seen with 5.0.7: "[1,1]<stdout>: out 1out 0 rest" — rank 0's partial
    // line comes untagged inside rank 1's, so no launcher can attribute it.
    GTEST_SKIP() << "Open MPI 5's mpirun does not tag a partial line";
  }
  expect_prefixed_lines(
      "r=$OMPI_COMM_WORLD_RANK; printf \"out $r\"; sleep 0.1; echo \" rest\"; echo \"err $r\" >&2");
}

TEST(MpiLaunch, RanksThatMpiSeesAsSingletonsAreRefused) {
  // `timeout` bounds the job even if init hangs.
  const std::string cmd =
      "timeout -k 5 60 " COHORTRUN_BIN
      " -n 2 -- env COHORT_BACKEND=mpi COHORT_TIMEOUT=10 " WATCHDOG_PROBE_BIN " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) output.append(buf, n);
  const int raw = pclose(pipe);
  const int status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  EXPECT_NE(status, 0) << output;
  EXPECT_NE(status, 124) << "the job hung: " << output;
  EXPECT_EQ(output.find("rank 0 of 1"), std::string::npos) << output;
  EXPECT_NE(output.find("WORLD_SIZE=2"), std::string::npos) << output;
  EXPECT_NE(output.find("cohortrun --backend mpi"), std::string::npos) << output;
  EXPECT_NE(output.find("mpirun"), std::string::npos) << output;
}

}  // namespace
}  // namespace launch_test
