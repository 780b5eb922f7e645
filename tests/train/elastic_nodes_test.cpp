// A multi-node elastic job end to end: three "nodes" (network namespaces on
// one bridge), each running `cohortrun -n 1 --nnodes 2:3` with elastic_job.
// Rank 0 holds at step 12 in the world of 3; the test then loses node 2
// (SIGKILL of its launcher, or SIGSTOP of it and its rank: a hang that only
// the heartbeat reveals), the job goes on at world 2 from the step-10
// checkpoint, holds at step 17, node 2 comes back (a new launcher, or the
// stopped one continued) and the job grows back to world 3 from the step-15
// checkpoint. The final parameters must equal a reference that runs the same
// schedule on one node: 3 ranks to step 10, 2 ranks to 15, 3 ranks to 40.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "support/netns.h"
#include "train_fixtures.h"

namespace elastic_nodes_test {
namespace {

using cohort::testing::BridgedNamespaces;
using cohort::testing::ProcessResult;
using cohort::testing::Seconds;
using cohort::testing::Subprocess;
using cohort::testing::TempDir;

constexpr const char* kPort = "29611";

std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> params;
  torch::load(params, path);
  return params;
}

// Waits (bounded) for elastic_job's marker that rank 0 holds at a step.
bool wait_for_file(const std::string& path, Seconds limit) {
  const auto deadline = cohort::testing::Clock::now() + limit;
  while (!std::filesystem::exists(path)) {
    if (cohort::testing::Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The launcher's children (its ranks), from /proc.
std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<pid_t> kids;
  for (pid_t kid; in >> kid;) kids.push_back(kid);
  return kids;
}

std::vector<std::string> node_command(const std::string& dir) {
  return {COHORTRUN_PATH,
          "-n",
          "1",
          "--nnodes",
          "2:3",
          "--master-addr",
          BridgedNamespaces::address(0),
          "--master-port",
          kPort,
          "--rdzv-id",
          "elastic-nodes-test",
          "--heartbeat-timeout",
          "3",
          "--rdzv-last-call",
          "1",
          "--rdzv-timeout",
          "60",
          "--max-restarts",
          "3",
          "--backend",
          "gloo",
          "--",
          ELASTIC_JOB_PATH,
          "--dir",
          dir,
          "--hold",
          "12@3,17@2",
          "--out",
          dir + "/final.pt"};
}

enum class Loss { kKill, kHang };

// Runs the 3 -> 2 -> 3 job, losing node 2 as `loss` says; returns node 0's
// output (stdout + stderr) after checking every launcher's exit.
std::string run_job(const BridgedNamespaces& ns, const std::string& dir, Loss loss) {
  const std::vector<std::string> env = {"COHORT_STORE_TOKEN=elastic-nodes-" +
                                        std::to_string(::getpid())};
  std::vector<std::unique_ptr<Subprocess>> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(std::make_unique<Subprocess>(ns.exec_in(i, node_command(dir)), env));
  }
  // `ip netns exec` execs the command: the pid is node 2's launcher.
  const pid_t lost = nodes[2]->pid();
  EXPECT_TRUE(wait_for_file(dir + "/held-12-world-3", Seconds(60))) << "never reached world 3";
  std::vector<pid_t> stopped;
  if (loss == Loss::kKill) {
    ::kill(lost, SIGKILL);  // its rank dies with it (the launcher's death signal)
  } else {
    stopped = children_of(lost);
    stopped.push_back(lost);
    for (pid_t p : stopped) ::kill(p, SIGSTOP);
  }
  EXPECT_TRUE(wait_for_file(dir + "/held-17-world-2", Seconds(60))) << "never went on at world 2";
  std::unique_ptr<Subprocess> back;
  if (loss == Loss::kKill) {
    back = std::make_unique<Subprocess>(ns.exec_in(2, node_command(dir)), env);
  } else {
    for (pid_t p : stopped) ::kill(p, SIGCONT);  // it wakes up and rejoins
  }
  std::string host_output;
  for (int i = 0; i < 3; ++i) {
    Subprocess& node = (i == 2 && back) ? *back : *nodes[i];
    ProcessResult r = node.finish(Seconds(90));
    SCOPED_TRACE("node " + std::to_string(i));
    EXPECT_FALSE(r.timed_out) << r.out << r.err;
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    if (i == 0) host_output = r.out + r.err;
  }
  if (back) {
    EXPECT_EQ(nodes[2]->finish(Seconds(10)).exit_code, 128 + SIGKILL);
  }
  return host_output;
}

TEST(ElasticNodes, ThreeTwoThreeAfterAKillAndAfterAHangMatchTheReference) {
  std::string why;
  std::unique_ptr<BridgedNamespaces> ns = BridgedNamespaces::create(3, &why);
  if (!ns) GTEST_SKIP() << "cannot set up three network namespaces: " << why;

  TempDir reference("cohort-elastic-nodes-ref");
  const std::string job = ELASTIC_JOB_PATH;
  const std::vector<std::pair<std::string, std::vector<std::string>>> schedule = {
      {"3", {"--max-steps", "10"}},
      {"2", {"--max-steps", "15"}},
      {"3", {"--out", reference / "final.pt"}}};
  for (const auto& [ranks, extra] : schedule) {
    std::vector<std::string> args = {"-n", ranks, "--", job, "--dir", reference.str()};
    args.insert(args.end(), extra.begin(), extra.end());
    ProcessResult r = cohort::testing::run_cohortrun(args, Seconds(60));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  const auto want = load_params(reference / "final.pt");

  for (Loss loss : {Loss::kKill, Loss::kHang}) {
    SCOPED_TRACE(loss == Loss::kKill ? "SIGKILL" : "SIGSTOP");
    TempDir dir("cohort-elastic-nodes");
    const std::string out = run_job(*ns, dir.str(), loss);
    EXPECT_NE(out.find("hosting the store on 10.77.0.1:29611"), std::string::npos) << out;
    EXPECT_NE(out.find("[0] resumed from step 10 at world 2"), std::string::npos) << out;
    EXPECT_NE(out.find("[0] resumed from step 15 at world 3"), std::string::npos) << out;
    EXPECT_NE(out.find("a node is waiting to join"), std::string::npos) << out;
    EXPECT_NE(out.find("[0] final step 40"), std::string::npos) << out;
    if (loss == Loss::kHang) {
      // Nothing exited: only the missing heartbeat tells.
      EXPECT_NE(out.find("sent no heartbeat for 3 s"), std::string::npos) << out;
    }
    const auto got = load_params(dir / "final.pt");
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const double rel = ((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>();
      EXPECT_LE(rel, 1e-5) << "parameter " << i;
    }
  }
}

}  // namespace
}  // namespace elastic_nodes_test
