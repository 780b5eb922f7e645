// Ranks as real processes: the contract across the process boundary, and a
// peer killed by SIGKILL mid-job. The ranks are started here directly (not by
// cohortrun, which would tear the survivors down before they could report).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "cohort/core/store/socket.h"

namespace {

using namespace std::chrono_literals;

struct RankResult {
  int exit_code = -1;  // 128+signal when killed
  std::string output;
};

uint16_t free_port() {
  auto s = cohort::net::listen_on("127.0.0.1", 0);
  return cohort::net::local_port(s);
}

// Starts `world` ranks of `program mode` and waits at most `limit` for all;
// ranks still running then are killed and reported as -1.
std::vector<RankResult> run_processes(int world, const std::string& mode,
                                      std::chrono::seconds limit) {
  const auto port = std::to_string(free_port());
  const std::string dir = ::testing::TempDir();
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (int r = 0; r < world; ++r) {
    logs.push_back(dir + "cohort_proc_" + std::to_string(::getpid()) + "_" + std::to_string(r));
    pid_t pid = ::fork();
    if (pid == 0) {
      FILE* f = std::freopen(logs.back().c_str(), "w", stderr);
      (void)f;
      ::dup2(::fileno(stderr), STDOUT_FILENO);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("COHORT_TIMEOUT", "20", 1);
      ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
      ::execl(CONTRACT_PROCESS_BIN, CONTRACT_PROCESS_BIN, mode.c_str(), nullptr);
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<RankResult> results(static_cast<size_t>(world));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int left = world;
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    for (int r = 0; r < world; ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pids[r] = 0;
        --left;
      }
    }
    std::this_thread::sleep_for(20ms);  // polling child exits
  }
  for (int r = 0; r < world; ++r) {
    if (pids[r] > 0) {
      ::kill(pids[r], SIGKILL);
      ::waitpid(pids[r], nullptr, 0);
    }
    std::ifstream in(logs[r]);
    std::stringstream ss;
    ss << in.rdbuf();
    results[r].output = ss.str();
    std::remove(logs[r].c_str());
  }
  return results;
}

class ProcessContract : public ::testing::TestWithParam<int> {};

TEST_P(ProcessContract, EveryRankChecksEveryResult) {
  auto results = run_processes(GetParam(), "contract", 90s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("0 failures"), std::string::npos) << results[r].output;
  }
}

INSTANTIATE_TEST_SUITE_P(Gloo, ProcessContract, ::testing::Values(2, 3));

TEST(ProcessFailure, SurvivorsOfAKilledRankFailWithANamedError) {
  const auto start = std::chrono::steady_clock::now();
  auto results = run_processes(3, "dead-peer", 30s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 25s);
  EXPECT_EQ(results[1].exit_code, 128 + SIGKILL);
  for (int r : {0, 2}) {
    EXPECT_EQ(results[r].exit_code, 3) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("all_reduce on rank " + std::to_string(r) + " of 3"),
              std::string::npos) << results[r].output;
  }
}

}  // namespace
