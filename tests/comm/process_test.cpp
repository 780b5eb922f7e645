// A peer killed by SIGKILL mid-job, with ranks as real processes. They are
// started here directly (not by cohortrun, which would tear the survivors
// down before they could report). The contract across processes is
// tests/contract (contract_processes_*).
#include <gtest/gtest.h>
#include <signal.h>

#include <memory>

#include "cohort/core/store/socket.h"
#include "support/subprocess.h"

namespace cohort::testing::process_test {
namespace {

uint16_t free_port() {
  auto s = net::listen_on("127.0.0.1", 0);
  return net::local_port(s);
}

// Runs `world` ranks of DEAD_PEER_BIN with the torchrun environment; each
// is killed if still running after `limit`.
std::vector<ProcessResult> run_ranks_as_processes(int world, Seconds limit) {
  const auto port = std::to_string(free_port());
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{DEAD_PEER_BIN},
        std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world),
                                 "LOCAL_RANK=" + std::to_string(r),
                                 "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                 "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port,
                                 "COHORT_TIMEOUT=20", "OPENBLAS_NUM_THREADS=1"}));
  }
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
  auto results = run_ranks_as_processes(3, Seconds(90));
  EXPECT_LT(Clock::now() - start, Seconds(60));
  EXPECT_EQ(results[1].exit_code, 128 + SIGKILL);
  for (int r : {0, 2}) {
    EXPECT_EQ(results[r].exit_code, 3) << "rank " << r << ":\n" << results[r].err;
    EXPECT_NE(results[r].err.find("all_reduce on rank " + std::to_string(r) + " of 3"),
              std::string::npos)
        << results[r].err;
  }
}

}  // namespace
}  // namespace cohort::testing::process_test
