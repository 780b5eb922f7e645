// The MPI watchdog, end to end: a real `mpirun -np 2` job in which rank 1
// never joins a collective must end on its own, non-zero, within a bound,
// with messages naming the operation and the rank. Runs outside mpirun.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "support/subprocess.h"

namespace cohort::testing::watchdog_test {
namespace {

struct Outcome {
  int status = -1;     // mpirun's exit status (124: killed at the bound)
  std::string output;  // stdout and stderr
  double seconds = 0;
};

// `bound_s` bounds the job even if the watchdog fails, so this test cannot
// hang. `env` holds "K=V" words.
Outcome run_job(const std::string& env, int bound_s) {
  std::vector<std::string> argv, extra_env;
  std::istringstream command(MPIRUN_COMMAND), vars(env);
  for (std::string word; command >> word;) argv.push_back(word);
  argv.push_back(WATCHDOG_PROBE_BIN);
  for (std::string word; vars >> word;) extra_env.push_back(word);
  const auto r = run_process(argv, Seconds(bound_s), extra_env);
  return {r.timed_out ? 124 : r.exit_code, r.out + r.err, r.seconds};
}

// The watchdog's abort of a collective whose peer never called it.
constexpr const char* kCheckAbort =
    "MPI watchdog on world rank 0: MPI_Ialltoall (the signature check of collective #1) on rank 0 "
    "of 2";

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(MpiWatchdog, RankThatNeverJoinsEndsTheJobWithAClearMessage) {
  // Timeout 2 s, grace 5 s: the watchdog fires ~7 s in, long after rank 0
  // has printed its TimeoutError however loaded the machine; 60 s is the
  // bound that says "it did not hang" (run_job reports 124 past it).
  // The non-blocking path (COHORT_MPI_BLOCKING_BYTES=0): wait() times out first.
  const auto o = run_job(
      "COHORT_TIMEOUT=2 COHORT_MPI_ABORT_GRACE=5 COHORT_MPI_BLOCKING_BYTES=0 "
      "OPENBLAS_NUM_THREADS=1",
      60);
  SCOPED_TRACE(o.output);
  EXPECT_NE(o.status, 0);
  EXPECT_NE(o.status, 124) << "the job hung until the bound killed it";
  EXPECT_LT(o.seconds, 45.0);
  EXPECT_TRUE(has(o.output, "probe: rank 0 of 2, backend mpi")) << "init() did not pick MPI";
  // The caller's TimeoutError names the collective, the rank and the peer.
  EXPECT_TRUE(has(o.output, "rank 0 caught TimeoutError: cohort: all_reduce on rank 0 of 2"));
  EXPECT_TRUE(has(o.output, "peer 1"));
  // The watchdog's abort names the MPI call and the rank: the collective's
  // signature check, the first thing a collective sends.
  EXPECT_TRUE(has(o.output, kCheckAbort));
  EXPECT_FALSE(has(o.output, "was released"));
}

TEST(MpiWatchdog, BlockingSmallCollectiveIsEndedByTheWatchdog) {
  // By default a 64-byte all_reduce takes the blocking path (MPI_Allreduce),
  // but its non-blocking signature check comes first: rank 0 gets a
  // TimeoutError naming the check instead of staying inside MPI_Allreduce,
  // and the watchdog ends the job naming the check.
  const auto o = run_job("COHORT_TIMEOUT=2 COHORT_MPI_ABORT_GRACE=1 OPENBLAS_NUM_THREADS=1", 60);
  SCOPED_TRACE(o.output);
  EXPECT_NE(o.status, 0);
  EXPECT_NE(o.status, 124) << "the job hung until the bound killed it";
  EXPECT_LT(o.seconds, 45.0);
  EXPECT_TRUE(has(o.output, "rank 0 caught TimeoutError: cohort: all_reduce on rank 0 of 2"));
  EXPECT_TRUE(has(o.output, "the signature check of collective #1"));
  EXPECT_TRUE(has(o.output, kCheckAbort));
  EXPECT_FALSE(has(o.output, "was released"));
  EXPECT_FALSE(has(o.output, "finished without rank 1"));
}

}  // namespace
}  // namespace cohort::testing::watchdog_test
