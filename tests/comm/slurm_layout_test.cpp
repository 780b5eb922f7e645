// The tasks of a Slurm job step on two nodes, as processes started with
// srun's variables set by hand, under each layout srun can make: every task
// of the step rendezvous without MASTER_ADDR, or every task refuses at
// once; none is left waiting for a store nobody serves.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cohort/core/store/socket.h"
#include "support/subprocess.h"

namespace cohort::testing::slurm_layout_test {
namespace {

// Two node names that resolve to this host, so both "nodes" are reachable.
const std::vector<std::string> kNodes = {"127.0.0.1", "localhost"};

struct Layout {
  std::string name;
  std::vector<int> node_of_task;  // SLURM_PROCID -> SLURM_NODEID
  std::vector<std::string> extra;
};

// Task `t`'s variables as slurmstepd sets them: its node, its index there
// (SLURM_LOCALID) and the node's task ids (SLURM_GTIDS).
std::vector<std::string> task_env(const Layout& l, int t, const std::string& port,
                                  const std::string& backend) {
  const int node = l.node_of_task[t];
  int local = 0;
  std::string gtids;
  for (int u = 0; u < static_cast<int>(l.node_of_task.size()); ++u) {
    if (l.node_of_task[u] != node) continue;
    if (u < t) ++local;
    gtids += (gtids.empty() ? "" : ",") + std::to_string(u);
  }
  std::vector<std::string> e{"SLURM_JOB_ID=77",
                             "SLURM_STEP_ID=0",
                             "SLURM_STEP_NUM_TASKS=" + std::to_string(l.node_of_task.size()),
                             "SLURM_PROCID=" + std::to_string(t),
                             "SLURM_LOCALID=" + std::to_string(local),
                             "SLURM_NODEID=" + std::to_string(node),
                             "SLURMD_NODENAME=" + kNodes[node],
                             "SLURM_GTIDS=" + gtids,
                             "SLURM_STEP_NODELIST=" + kNodes[0] + "," + kNodes[1],
                             "MASTER_PORT=" + port,
                             "COHORT_BIND_ADDR=127.0.0.1",
                             "COHORT_BACKEND=" + backend,
                             "COHORT_TIMEOUT=10",
                             "OPENBLAS_NUM_THREADS=1"};
  e.insert(e.end(), l.extra.begin(), l.extra.end());
  return e;
}

class SlurmLayouts : public ::testing::TestWithParam<std::string> {};

TEST_P(SlurmLayouts, EveryTaskRendezvousWithoutMasterAddr) {
  const std::vector<Layout> layouts = {
      {"block", {0, 0, 1}, {}},
      {"cyclic", {0, 1, 0}, {"SLURM_DISTRIBUTION=cyclic"}},
      // A topology plugin's order: task 0 on the second node of the list.
      {"topology", {1, 1, 0}, {}},
      {"topology, one task a node", {1, 0}, {}},
      // Laid out by a list this environment does not hold.
      {"arbitrary", {1, 0, 0}, {"SLURM_DISTRIBUTION=arbitrary"}},
  };
  for (const auto& l : layouts) {
    // A port free now; the task serving the store binds it a moment later.
    const auto port = std::to_string(net::local_port(net::listen_on("127.0.0.1", 0)));
    std::vector<std::unique_ptr<Subprocess>> tasks;
    for (int t = 0; t < static_cast<int>(l.node_of_task.size()); ++t) {
      tasks.push_back(std::make_unique<Subprocess>(std::vector<std::string>{INIT_LOOP_BIN, "1"},
                                                   task_env(l, t, port, GetParam())));
    }
    for (size_t t = 0; t < tasks.size(); ++t) {
      const auto r = tasks[t]->finish(Seconds(30));
      EXPECT_EQ(r.exit_code, 0) << l.name << ": task " << t << " after " << r.seconds << " s:\n"
                                << r.err;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, SlurmLayouts,
                         ::testing::Values(
#ifdef COHORT_WITH_UCX
                             "ucx",
#endif
                             "gloo"));

}  // namespace
}  // namespace cohort::testing::slurm_layout_test
