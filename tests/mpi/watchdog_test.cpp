// The MPI watchdog, end to end: a real `mpirun -np 2` job in which rank 1
// never joins a collective must end on its own, non-zero, within a bound,
// with messages naming the operation and the rank. Runs outside mpirun.
#include <gtest/gtest.h>
#include <signal.h>

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
    "MPI watchdog on world rank 0: MPI_Isend/MPI_Irecv (the signature check of collective #1) on "
    "rank 0 of 2";

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
  EXPECT_TRUE(has(o.output, "rank 0 caught TimeoutError after "));
  EXPECT_TRUE(has(o.output, "cohort: all_reduce on rank 0 of 2"));
  EXPECT_TRUE(has(o.output, "peer 1"));
  // The watchdog's abort names the MPI call and the rank: the collective's
  // signature check, the first thing a collective sends.
  EXPECT_TRUE(has(o.output, kCheckAbort));
  EXPECT_FALSE(has(o.output, "was released"));
}

// How long rank 0's wait took before its TimeoutError ("caught TimeoutError
// after N ms"), or -1.
long caught_after_ms(const std::string& output) {
  const std::string key = "caught TimeoutError after ";
  const auto at = output.find(key);
  return at == std::string::npos ? -1 : std::stol(output.substr(at + key.size()));
}

TEST(MpiWatchdog, BlockingSmallCollectiveEndsInTheCallersTimeoutError) {
  // By default a 64-byte all_reduce takes the blocking path (MPI_Allreduce,
  // which a waiter cannot time out), but its non-blocking signature check
  // comes first: rank 0 gets, at its 2 s timeout, a TimeoutError naming the
  // operation and the peer that never called, instead of staying inside
  // MPI_Allreduce until the watchdog ends the job (timeout + 1 s grace).
  const auto o = run_job("COHORT_TIMEOUT=2 COHORT_MPI_ABORT_GRACE=1 OPENBLAS_NUM_THREADS=1", 60);
  SCOPED_TRACE(o.output);
  EXPECT_NE(o.status, 0);
  EXPECT_NE(o.status, 124) << "the job hung until the bound killed it";
  EXPECT_LT(o.seconds, 45.0);
  EXPECT_TRUE(has(o.output, "cohort: all_reduce on rank 0 of 2 (group world, peer 1)"));
  EXPECT_TRUE(has(o.output, "the signature check of collective #1"));
  EXPECT_TRUE(has(o.output, "rank 1 did not answer within 2000 ms"));
  // At the timeout, not before; well before the watchdog's abort would
  // (the bound is loose: a loaded machine delays the waiter's polling).
  const auto ms = caught_after_ms(o.output);
  EXPECT_GE(ms, 2000);
  EXPECT_LT(ms, 2900);
  EXPECT_TRUE(has(o.output, kCheckAbort));
  EXPECT_FALSE(has(o.output, "was released"));
  EXPECT_FALSE(has(o.output, "finished without rank 1"));
}

// Ranks stopped (SIGSTOP) before a collective, under mpirun: every survivor's
// TimeoutError names them (the MPI case of tests/comm/process_test.cpp's
// StoppedRanks; the same program).
struct Stopped {
  int world;
  std::vector<int> stopped;
  bool inside = false;  // stopped inside MPI's own collective, past its check
};

class MpiStoppedRanks : public ::testing::TestWithParam<Stopped> {};

TEST_P(MpiStoppedRanks, SurvivorsNameThem) {
  const auto& c = GetParam();
  std::vector<std::string> argv{MPIEXEC, MPIEXEC_NUMPROC_FLAG, std::to_string(c.world)};
  std::istringstream flags(MPIRUN_FLAGS);
  for (std::string word; flags >> word;) argv.push_back(word);
  argv.push_back(STOPPED_PEER_BIN);
  argv.push_back("--hold");  // a survivor's exit would end the job before the others print
  if (c.inside) argv.push_back("--inside");
  std::string named = c.stopped.size() == 1 ? "rank " : "ranks [";
  for (size_t i = 0; i < c.stopped.size(); ++i) {
    argv.push_back(std::to_string(c.stopped[i]));
    named += (i ? ", " : "") + std::to_string(c.stopped[i]);
  }
  named += c.stopped.size() == 1 ? " did not answer" : "] did not answer";
  Subprocess job(argv, {"COHORT_TIMEOUT=20", "COHORT_MPI_ABORT_GRACE=5", "OPENBLAS_NUM_THREADS=1",
                        "OMPI_MCA_rmaps_base_oversubscribe=1"});
  const int survivors = c.world - static_cast<int>(c.stopped.size());
  const bool reported = job.wait_for_stdout("survivor error", survivors, Seconds(90));
  job.wait_for_stdout("stopping pid", static_cast<int>(c.stopped.size()), Seconds(1));
  // The stopped ranks end only when killed: by pid, as they printed it;
  // then mpirun ends the job.
  std::istringstream lines(job.out_so_far());
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("stopping pid ", 0) == 0) ::kill(std::stoi(line.substr(13)), SIGKILL);
  }
  const auto r = job.finish(Seconds(30));
  SCOPED_TRACE(r.out + r.err);
  EXPECT_TRUE(reported) << "not every survivor reported";
  EXPECT_EQ(count_of(r.out, named), survivors);
  for (int q = 0; q < c.world; ++q) {
    if (c.stopped.size() == 1 && q == c.stopped[0]) continue;
    EXPECT_FALSE(has(r.out, "rank " + std::to_string(q) + " did not answer"));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, MpiStoppedRanks,
                         ::testing::Values(Stopped{2, {1}}, Stopped{3, {1}}, Stopped{3, {0}},
                                           Stopped{3, {1, 2}}, Stopped{3, {1}, true},
                                           Stopped{3, {0}, true}),
                         [](const ::testing::TestParamInfo<Stopped>& info) {
                           std::string name =
                               "world" + std::to_string(info.param.world) + "_stopped";
                           for (int r : info.param.stopped) name += std::to_string(r);
                           return info.param.inside ? name + "_inside" : name;
                         });

}  // namespace
}  // namespace cohort::testing::watchdog_test
