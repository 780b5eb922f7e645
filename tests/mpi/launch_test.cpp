// An MPI job started the wrong way: ranks started by cohortrun without
// `--backend mpi` are each an MPI world of one. cohort::init must refuse
// that, saying how to launch, instead of running independent world-1 jobs.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace {

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
