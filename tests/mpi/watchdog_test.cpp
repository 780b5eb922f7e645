// The MPI watchdog, end to end: a real `mpirun -np 2` job in which rank 1
// never joins a collective must end on its own, non-zero, within a bound,
// with messages naming the operation and the rank. Runs outside mpirun.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace {

struct Outcome {
  int status = -1;  // exit status of the shell running mpirun
  std::string output;
  double seconds = 0;
};

// `timeout` bounds the job even if the watchdog fails, so this test cannot hang.
Outcome run_job(const std::string& env, int bound_s) {
  const std::string cmd = env + " timeout -k 5 " + std::to_string(bound_s) +
                          " " MPIRUN_COMMAND " " WATCHDOG_PROBE_BIN " 2>&1";
  Outcome o;
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return o;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) o.output.append(buf, n);
  const int raw = pclose(pipe);
  o.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(MpiWatchdog, RankThatNeverJoinsEndsTheJobWithAClearMessage) {
  // Timeout 2 s, grace 1 s: the watchdog fires ~3 s in; 60 s is the bound
  // that says "it did not hang" (timeout(1) exits 124 past it).
  // The non-blocking path (COHORT_MPI_BLOCKING_BYTES=0): wait() times out first.
  const auto o = run_job(
      "COHORT_TIMEOUT=2 COHORT_MPI_ABORT_GRACE=1 COHORT_MPI_BLOCKING_BYTES=0 "
      "OPENBLAS_NUM_THREADS=1",
      60);
  SCOPED_TRACE(o.output);
  EXPECT_NE(o.status, 0);
  EXPECT_NE(o.status, 124) << "the job hung until timeout(1) killed it";
  EXPECT_LT(o.seconds, 45.0);
  EXPECT_TRUE(has(o.output, "probe: rank 0 of 2, backend mpi")) << "init() did not pick MPI";
  // The caller's TimeoutError names the collective, the rank and the peer.
  EXPECT_TRUE(has(o.output, "rank 0 caught TimeoutError: cohort: all_reduce on rank 0 of 2"));
  EXPECT_TRUE(has(o.output, "peer 1"));
  // The watchdog's abort names the MPI call and the rank.
  EXPECT_TRUE(
      has(o.output, "MPI watchdog on world rank 0: MPI_Iallreduce (all_reduce) on rank 0 of 2"));
  EXPECT_FALSE(has(o.output, "was released"));
}

TEST(MpiWatchdog, BlockingSmallCollectiveIsEndedByTheWatchdog) {
  // By default a 64-byte all_reduce takes the blocking path: rank 0 stays
  // inside MPI_Allreduce, gets no TimeoutError, and the watchdog must end
  // the job naming the blocking call.
  const auto o = run_job("COHORT_TIMEOUT=2 COHORT_MPI_ABORT_GRACE=1 OPENBLAS_NUM_THREADS=1", 60);
  SCOPED_TRACE(o.output);
  EXPECT_NE(o.status, 0);
  EXPECT_NE(o.status, 124) << "the job hung until timeout(1) killed it";
  EXPECT_LT(o.seconds, 45.0);
  EXPECT_FALSE(has(o.output, "caught TimeoutError"));
  EXPECT_TRUE(
      has(o.output, "MPI watchdog on world rank 0: MPI_Allreduce (all_reduce) on rank 0 of 2"));
  EXPECT_FALSE(has(o.output, "was released"));
  EXPECT_FALSE(has(o.output, "finished without rank 1"));
}

}  // namespace
