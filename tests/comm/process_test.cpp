// A peer killed by SIGKILL mid-job, with ranks as real processes. They are
// started here directly (not by cohortrun, which would tear the survivors
// down before they could report). The contract across processes is
// tests/contract (contract_processes_*).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include "cohort/core/store/socket.h"
#include "support/subprocess.h"

namespace cohort::testing::process_test {
namespace {

void set_inheritable(int fd, bool inheritable) {
  const int flags = ::fcntl(fd, F_GETFD);
  ::fcntl(fd, F_SETFD, inheritable ? flags & ~FD_CLOEXEC : flags | FD_CLOEXEC);
}

// Starts `world` ranks of `argv` with the torchrun environment (and `env`).
// Rank 0 serves the store on a socket this process opened (COHORT_STORE_FD,
// as cohortrun does), so a test running beside this one cannot take the
// port between the pick and rank 0's start.
std::vector<std::unique_ptr<Subprocess>> start_ranks(const std::vector<std::string>& argv,
                                                     int world,
                                                     const std::vector<std::string>& env = {}) {
  auto listener = net::listen_on("127.0.0.1", 0);
  const auto port = std::to_string(net::local_port(listener));
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> e{"RANK=" + std::to_string(r),
                               "WORLD_SIZE=" + std::to_string(world),
                               "LOCAL_RANK=" + std::to_string(r),
                               "LOCAL_WORLD_SIZE=" + std::to_string(world),
                               "MASTER_ADDR=127.0.0.1",
                               "MASTER_PORT=" + port,
                               "COHORT_TIMEOUT=20",
                               "OPENBLAS_NUM_THREADS=1"};
    if (r == 0) e.push_back("COHORT_STORE_FD=" + std::to_string(listener.fd()));
    e.insert(e.end(), env.begin(), env.end());
    // Only rank 0 inherits the listener (the process tests run one at a time).
    set_inheritable(listener.fd(), r == 0);
    ranks.push_back(std::make_unique<Subprocess>(argv, e));
  }
  set_inheritable(listener.fd(), false);
  return ranks;
}

// start_ranks, then each rank's result; a rank still running after `limit`
// is killed.
std::vector<ProcessResult> run_ranks_as_processes(const std::vector<std::string>& argv, int world,
                                                  Seconds limit,
                                                  const std::vector<std::string>& env = {}) {
  auto ranks = start_ranks(argv, world, env);
  std::vector<ProcessResult> results;
  const auto deadline = Clock::now() + limit;
  for (auto& p : ranks) {
    results.push_back(p->finish(std::max(Seconds(0), Seconds(deadline - Clock::now()))));
  }
  return results;
}

TEST(ProcessFailure, SurvivorsOfAKilledRankFailWithANamedError) {
  const auto start = Clock::now();
  // Three LibTorch start-ups and a 5 s operation timeout; a hang would show
  // as the 20 s COHORT_TIMEOUT or the 90 s limit.
  auto results = run_ranks_as_processes({DEAD_PEER_BIN}, 3, Seconds(90));
  EXPECT_LT(Clock::now() - start, Seconds(60));
  EXPECT_EQ(results[1].exit_code, 128 + SIGKILL);
  for (int r : {0, 2}) {
    EXPECT_EQ(results[r].exit_code, 3) << "rank " << r << ":\n" << results[r].err;
    EXPECT_NE(results[r].err.find("all_reduce on rank " + std::to_string(r) + " of 3"),
              std::string::npos)
        << results[r].err;
  }
}

// A peer SIGKILLed while transfers are outstanding (64 MiB all_reduces,
// rendezvous sized; bursts of 64 small ones issued before the first wait),
// then the survivor drops its group and finalizes: its error names the dead
// peer, finalize() returns, and UCX prints no warning at exit about requests
// never returned to its pools ("not returned to mpool", seen once after a
// dead peer). Not reproduced here with UCX 1.13 (nor with close() freeing
// unfinished requests at once, the older close): a guard.
TEST(ProcessFailure, PeerKilledMidTransferLeavesNoUcxWarningsAtExit) {
#ifndef COHORT_WITH_UCX
  GTEST_SKIP() << "built without UCX";
#endif
  const auto start = Clock::now();
  std::vector<std::pair<std::string, std::vector<std::unique_ptr<Subprocess>>>> jobs;
  for (std::string mode : {"large", "burst"}) {
    jobs.emplace_back(mode, start_ranks({DEAD_TRANSFER_BIN, mode}, 2, {"COHORT_BACKEND=ucx"}));
  }
  for (auto& [mode, ranks] : jobs) {
    const auto survivor = ranks[0]->finish(Seconds(60));
    EXPECT_EQ(ranks[1]->finish(Seconds(10)).exit_code, 128 + SIGKILL) << mode;
    EXPECT_EQ(survivor.exit_code, 3) << mode << ":\n" << survivor.err;
    EXPECT_NE(survivor.err.find("on rank 0 of 2 (group world, peer 1)"), std::string::npos)
        << mode << ":\n"
        << survivor.err;
    EXPECT_EQ(survivor.err.find("mpool"), std::string::npos) << mode << ":\n" << survivor.err;
  }
  EXPECT_LT(Clock::now() - start, Seconds(30));
}

// Ranks that stop answering (SIGSTOP, as a debugger or job control does)
// while the others run a collective: each survivor's timeout names them, and
// no survivor, whichever neighbour it was waiting for, whether they stopped
// before the collective or inside it, past its signature check. UCX asks its
// peers whether they still answer; Gloo and MPI name the peers whose
// signature check never came, and Gloo those whose mark in the store never
// came once the collective itself timed out (under mpirun:
// tests/mpi/watchdog_test.cpp). A rank SIGKILLed instead goes unnoticed by
// UCX on shared memory until the timeout; its probe then says from /proc
// that the process is gone, not stopped.
struct Stopped {
  std::string backend;
  int world;
  std::vector<int> stopped;
  bool inside = false;  // stopped inside the engine's collective, past its check
  bool killed = false;  // SIGKILLed rather than stopped
};

class StoppedRanks : public ::testing::TestWithParam<Stopped> {};

TEST_P(StoppedRanks, SurvivorsNameThem) {
  const auto& c = GetParam();
  std::vector<std::string> argv{STOPPED_PEER_BIN};
  if (c.inside) argv.push_back("--inside");
  if (c.killed) argv.push_back("--kill");
  std::string named = c.stopped.size() == 1 ? "rank " : "ranks [";
  for (size_t i = 0; i < c.stopped.size(); ++i) {
    argv.push_back(std::to_string(c.stopped[i]));
    named += (i ? ", " : "") + std::to_string(c.stopped[i]);
  }
  named += c.stopped.size() == 1 ? "" : "]";
  // Gloo asks through the store, which rank 0 serves here.
  const bool host_stopped = c.backend == "gloo" && c.inside && c.stopped == std::vector<int>{0};
  named += host_stopped ? " (the store's host) did not answer" : " did not answer";
  const auto start = Clock::now();
  auto ranks = start_ranks(argv, c.world, {"COHORT_BACKEND=" + c.backend});
  for (int r = 0; r < c.world; ++r) {
    if (std::count(c.stopped.begin(), c.stopped.end(), r)) continue;
    const auto result = ranks[r]->finish(Seconds(60));
    EXPECT_EQ(result.exit_code, 3) << "rank " << r << ":\n" << result.out << result.err;
    EXPECT_NE(result.out.find(named), std::string::npos) << result.out << result.err;
    // The probes tell from /proc that a silent peer on this machine is
    // stopped or gone (UCX's from the rendezvous, Gloo's from the store: the
    // store's host, stopped, cannot be asked for its pid; Gloo's check, which
    // names a rank stopped before the collective, does not look).
    if (c.backend == "ucx" || (c.inside && !host_stopped)) {
      const bool one = c.stopped.size() == 1;
      const std::string state = c.killed ? "on this machine) exited or was killed"
                                         : (one ? "on this machine) is stopped (SIGSTOP"
                                                : "on this machine) are stopped (SIGSTOP");
      EXPECT_NE(result.out.find(state), std::string::npos) << result.out;
    }
    for (int q = 0; q < c.world; ++q) {
      if (c.stopped.size() == 1 && q == c.stopped[0]) continue;
      EXPECT_EQ(result.out.find("rank " + std::to_string(q) + " did not answer"), std::string::npos)
          << result.out;
    }
  }
  EXPECT_LT(Clock::now() - start, Seconds(45));
  for (int r : c.stopped) {
    ::kill(ranks[r]->pid(), SIGKILL);
    // A stopped rank that exited instead says why (once under load: an error
    // in init() before it reached its stop).
    const auto result = ranks[r]->finish(Seconds(10));
    EXPECT_EQ(result.exit_code, 128 + SIGKILL) << "rank " << r << ":\n" << result.out << result.err;
  }
}

std::vector<Stopped> stopped_cases() {
  std::vector<Stopped> cases;
  for (std::string backend : {
#ifdef COHORT_WITH_UCX
           "ucx",
#endif
           "gloo"}) {
    cases.push_back({backend, 2, {1}});
    cases.push_back({backend, 3, {1}});
    cases.push_back({backend, 3, {0}});
    if (backend != "ucx") cases.push_back({backend, 3, {1, 2}});
    // Inside: Gloo asks through the store, whose server is rank 0 here: a
    // stopped rank 0 is named as the store's host whose replies stopped
    // (liveness_probe.h). With two survivors, rank 0 (the store's host)
    // waits for the other's probe before it returns, and so exits only
    // after it.
    cases.push_back({backend, 3, {1}, true});
    cases.push_back({backend, 3, {0}, true});
    if (backend != "ucx") cases.push_back({backend, 3, {1, 2}, true});
  }
#ifdef COHORT_WITH_UCX
  // Gloo needs no probe for a killed rank: the kernel closes its sockets,
  // and the survivors fail at once with the closed connection.
  cases.push_back({"ucx", 2, {1}, false, true});
  cases.push_back({"ucx", 3, {1}, false, true});
#endif
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Engines, StoppedRanks, ::testing::ValuesIn(stopped_cases()),
                         [](const ::testing::TestParamInfo<Stopped>& info) {
                           std::string name = info.param.backend + "_world" +
                                              std::to_string(info.param.world) + "_stopped";
                           for (int r : info.param.stopped) name += std::to_string(r);
                           if (info.param.killed) name += "_killed";
                           return info.param.inside ? name + "_inside" : name;
                         });

// Subgroups built until the descriptors run out (a limit of 256, as
// `ulimit -n 256`): UCX says "Endpoint timeout" or "No resources", so the
// error must name the limit, on every rank (the one that failed tells the
// others through the store), well before the 30 s timeout.
TEST(ProcessFailure, OutOfDescriptorsIsNamedOnEveryRank) {
#ifndef COHORT_WITH_UCX
  GTEST_SKIP() << "built without UCX";
#endif
  for (int world : {2, 3}) {
    const auto start = Clock::now();
    auto results = run_ranks_as_processes({FD_LIMIT_BIN, "256"}, world, Seconds(120),
                                          {"COHORT_BACKEND=ucx", "COHORT_TIMEOUT=30"});
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(results[r].exit_code, 3) << "rank " << r << " of " << world << ":\n"
                                         << results[r].err;
      EXPECT_NE(results[r].err.find("file descriptors open of its limit of 256 (ulimit -n)"),
                std::string::npos)
          << results[r].err;
    }
    EXPECT_LT(Clock::now() - start, Seconds(25)) << "world " << world;
  }
}

// init() -> all_reduce -> finalize() in a loop, as a job that rebuilds its
// default group does. Every cycle's rank 0 hosts a new store on the same
// MASTER_PORT: a rank must not reach the previous cycle's store (it would
// find its own rank already claimed there, or lose the connection when that
// store closes). 150 cycles take 5-8 s per case here; before finalize()
// waited for the old store to close, UCX failed within 100 (cycles 15-55).
// COHORT_INIT_LOOP_CYCLES sets the count for a longer soak: with 1000,
// the four cases take about 140 s together, inside ctest's 240 s for the
// suite; more cycles want the binary run directly (--gtest_filter).
class InitFinalizeLoop : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(InitFinalizeLoop, EveryCycleConnectsAndReduces) {
  const auto& [backend, world] = GetParam();
  const char* env_cycles = std::getenv("COHORT_INIT_LOOP_CYCLES");
  const std::string cycles = env_cycles ? env_cycles : "150";
  // 200 s per 150 cycles: below ctest's limit by default, so that a hang
  // is reported here with each rank's output.
  const auto limit = Seconds(200 * std::max(1, std::stoi(cycles) / 150));
  auto results =
      run_ranks_as_processes({INIT_LOOP_BIN, cycles}, world, limit, {"COHORT_BACKEND=" + backend});
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].err;
  }
  EXPECT_NE(results[0].out.find("cycles " + cycles + " in"), std::string::npos) << results[0].out;
}

INSTANTIATE_TEST_SUITE_P(Engines, InitFinalizeLoop,
                         ::testing::Combine(::testing::Values(
#ifdef COHORT_WITH_UCX
                                                "ucx",
#endif
                                                "gloo"),
                                            ::testing::Values(2, 3)));

}  // namespace
}  // namespace cohort::testing::process_test
