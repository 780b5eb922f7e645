// The torchrun environment each rank starts with.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/subprocess.h"

namespace cohort::testing::environment_test {
namespace {

constexpr const char* kPrintEnv =
    "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK "
    "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK "
    "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT "
    "COHORT_BACKEND=$COHORT_BACKEND COHORT_RESTART_COUNT=$COHORT_RESTART_COUNT "
    "TORCHELASTIC_RESTART_COUNT=$TORCHELASTIC_RESTART_COUNT OMP_NUM_THREADS=$OMP_NUM_THREADS "
    "COHORT_STORE_TOKEN=$COHORT_STORE_TOKEN";

using Env = std::map<std::string, std::string>;

// Rank (from the line's "[r] " prefix) -> the variables it printed.
std::map<int, Env> parse(const std::string& out) {
  std::map<int, Env> by_rank;
  for (const std::string& line : lines_of(out)) {
    int rank = -1;
    std::sscanf(line.c_str(), "[%d]", &rank);
    std::istringstream words(line.substr(line.find(']') + 1));
    Env env;
    for (std::string kv; words >> kv;) {
      env[kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
    }
    EXPECT_EQ(by_rank.count(rank), 0u) << "two lines from rank " << rank;
    by_rank[rank] = env;
  }
  return by_rank;
}

// What each of `cohortrun -n 3 -- sh -c script` ranks printed, the caller
// exporting `env`; empty (with the failure recorded) when the job failed.
std::map<int, Env> three_ranks_print(const std::string& script, const std::string& env) {
  ProcessResult r = run_cohortrun({"-n", "3", "--", "sh", "-c", script}, Seconds(20), {env});
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  if (r.timed_out || r.exit_code != 0) return {};
  std::map<int, Env> envs = parse(r.out);
  EXPECT_EQ(envs.size(), 3u) << r.out;
  return envs;
}

TEST(Environment, SingleNodeVariables) {
  // A RANK inherited from the caller must be replaced, not kept.
  std::map<int, Env> envs = three_ranks_print(kPrintEnv, "RANK=99");
  ASSERT_EQ(envs.size(), 3u);
  const std::string port = envs[0]["MASTER_PORT"];
  for (int rank = 0; rank < 3; ++rank) {
    Env& e = envs[rank];
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ(e["RANK"], std::to_string(rank));
    EXPECT_EQ(e["WORLD_SIZE"], "3");
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["MASTER_PORT"], port);
    EXPECT_EQ(e["COHORT_BACKEND"], "auto");
    EXPECT_EQ(e["COHORT_RESTART_COUNT"], "0");
    EXPECT_EQ(e["TORCHELASTIC_RESTART_COUNT"], "0");
    // One store token per job, 128 random bits in hex.
    EXPECT_EQ(e["COHORT_STORE_TOKEN"].size(), 32u);
    EXPECT_EQ(e["COHORT_STORE_TOKEN"], envs[0]["COHORT_STORE_TOKEN"]);
  }
  ASSERT_FALSE(port.empty());
  ASSERT_EQ(port.find_first_not_of("0123456789"), std::string::npos) << port;
  int p = std::stoi(port);
  EXPECT_GE(p, 1);
  EXPECT_LE(p, 65535);
}

// Rank 0 starts with the store's socket already listening on MASTER_PORT
// (COHORT_STORE_FD): no other process can take the port before rank 0
// serves on it. The kernel's table shows the listener before any rank binds
// anything; no other rank gets a descriptor number, even one the caller
// exported.
TEST(Environment, RankZeroInheritsTheStoresListeningSocket) {
  const std::string script =
      "echo fd=${COHORT_STORE_FD:-none} "
      "link=$(readlink /proc/$$/fd/${COHORT_STORE_FD:-none} 2>/dev/null | cut -c1-7) "
      "listening=$(grep -ci \"^ *[0-9]*: 0100007F:$(printf %04X $MASTER_PORT) 00000000:0000 0A\" "
      "/proc/net/tcp)";
  std::map<int, Env> envs = three_ranks_print(script, "COHORT_STORE_FD=5");
  ASSERT_EQ(envs.size(), 3u);
  EXPECT_NE(envs[0]["fd"], "none");
  EXPECT_EQ(envs[0]["link"], "socket:");
  EXPECT_EQ(envs[0]["listening"], "1");
  for (int rank : {1, 2}) EXPECT_EQ(envs[rank]["fd"], "none");
}

// The engine: --backend, else a COHORT_BACKEND the caller exported, else
// auto; an unknown name from the environment is refused like the flag's.
TEST(Environment, BackendFromTheFlagElseTheCallersEnvironment) {
  struct Case {
    std::vector<std::string> flag;
    std::vector<std::string> env;
    std::string expected;
  };
  for (const Case& c : {Case{{}, {"COHORT_BACKEND=gloo"}, "gloo"},
                        Case{{"--backend", "ucx"}, {"COHORT_BACKEND=gloo"}, "ucx"},
                        Case{{}, {"COHORT_BACKEND="}, "auto"}}) {
    std::vector<std::string> args = {"-n", "2"};
    args.insert(args.end(), c.flag.begin(), c.flag.end());
    args.insert(args.end(), {"--", "sh", "-c", kPrintEnv});
    ProcessResult r = run_cohortrun(args, Seconds(20), c.env);
    ASSERT_FALSE(r.timed_out);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::map<int, Env> envs = parse(r.out);
    ASSERT_EQ(envs.size(), 2u) << r.out;
    for (auto& [rank, e] : envs) EXPECT_EQ(e["COHORT_BACKEND"], c.expected) << "rank " << rank;
  }
  ProcessResult r = run_cohortrun({"-n", "2", "--", "true"}, Seconds(20), {"COHORT_BACKEND=tcp"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("(or COHORT_BACKEND) must be gloo, mpi, ucx, nccl or auto (got 'tcp')"),
            std::string::npos)
      << r.err;
}

// Ranks sharing the machine get one intra-op thread each unless the caller
// chose; a lone rank keeps the library's default (all cores).
TEST(Environment, OneOpenMpThreadPerRankUnlessTheCallerChose) {
  const char* inherited = std::getenv("OMP_NUM_THREADS");
  const std::string saved = inherited ? inherited : "";
  unsetenv("OMP_NUM_THREADS");
  ProcessResult shared = run_cohortrun({"-n", "2", "--", "sh", "-c", kPrintEnv}, Seconds(20));
  ProcessResult alone = run_cohortrun({"-n", "1", "--", "sh", "-c", kPrintEnv}, Seconds(20));
  ProcessResult chosen =
      run_cohortrun({"-n", "2", "--", "sh", "-c", kPrintEnv}, Seconds(20), {"OMP_NUM_THREADS=3"});
  if (inherited) setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  for (auto* r : {&shared, &alone, &chosen}) {
    ASSERT_FALSE(r->timed_out);
    ASSERT_EQ(r->exit_code, 0) << r->err;
  }
  auto s = parse(shared.out), a = parse(alone.out), c = parse(chosen.out);
  ASSERT_EQ(s.size(), 2u) << shared.out;
  ASSERT_EQ(c.size(), 2u) << chosen.out;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(s[rank]["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(c[rank]["OMP_NUM_THREADS"], "3");
  }
  EXPECT_EQ(a[0]["OMP_NUM_THREADS"], "");
}

// Node 1 of two with two ranks each: ranks 2 and 3 of 4 at ADDR:PORT.
void expect_second_node_of_two(const ProcessResult& r, const std::string& addr,
                               const std::string& port) {
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<int, Env> envs = parse(r.out);
  ASSERT_EQ(envs.size(), 2u) << r.out;
  for (int local = 0; local < 2; ++local) {
    Env& e = envs[2 + local];
    SCOPED_TRACE("rank " + std::to_string(2 + local));
    EXPECT_EQ(e["RANK"], std::to_string(2 + local));
    EXPECT_EQ(e["WORLD_SIZE"], "4");
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(local));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(e["GROUP_RANK"], "1");
    EXPECT_EQ(e["MASTER_ADDR"], addr);
    EXPECT_EQ(e["MASTER_PORT"], port);
    EXPECT_EQ(e["COHORT_STORE_TOKEN"], "") << "nodes cannot share a generated token";
  }
}

TEST(Environment, SecondNodeOfTwo) {
  // No rank connects anywhere, so node 1 can run without node 0.
  expect_second_node_of_two(
      run_cohortrun({"-n", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3",
                     "--master-port", "29511", "--", "sh", "-c", kPrintEnv}),
      "10.1.2.3", "29511");
}

// One cohortrun per node in a Slurm job step: node 1 of the step on n[1-2]
// (job 4321, step 3), as srun --ntasks-per-node=1 describes it.
const std::vector<std::string> kSlurmNode1 = {
    "SLURM_JOB_ID=4321",        "SLURM_STEP_ID=3",
    "SLURM_PROCID=1",           "SLURM_NODEID=1",
    "SLURM_STEP_NUM_TASKS=2",   "SLURM_STEP_NUM_NODES=2",
    "SLURM_NNODES=2",           "SLURM_STEP_NODELIST=n[1-2]",
    "SLURM_JOB_NODELIST=n[1-2]"};

// kSlurmNode1 with one variable set to another value (or added).
std::vector<std::string> slurm_node1_with(const std::string& entry) {
  std::vector<std::string> env;
  const std::string key = entry.substr(0, entry.find('=') + 1);
  for (const auto& e : kSlurmNode1) {
    if (e.rfind(key, 0) != 0) env.push_back(e);
  }
  env.push_back(entry);
  return env;
}

TEST(Environment, SlurmStepGivesTheNodesAndMaster) {
  // Port 20000 + 10 * (4321 mod 1000) + 3 mod 10.
  expect_second_node_of_two(
      run_cohortrun({"-n", "2", "--", "sh", "-c", kPrintEnv}, Seconds(20), kSlurmNode1), "n1",
      "23213");

  // The command line wins over the step; MASTER_PORT over the job's port.
  ProcessResult r = run_cohortrun(
      {"-n", "1", "--node-rank", "0", "--master-addr", "10.1.2.3", "--", "sh", "-c", kPrintEnv},
      Seconds(20), slurm_node1_with("MASTER_PORT=29600"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<int, Env> envs = parse(r.out);
  ASSERT_EQ(envs.count(0), 1u) << r.out;
  EXPECT_EQ(envs[0]["WORLD_SIZE"], "2");
  EXPECT_EQ(envs[0]["MASTER_ADDR"], "10.1.2.3");
  EXPECT_EQ(envs[0]["MASTER_PORT"], "29600");
}

// A launcher per node: node 0 (SLURM_NODEID 0, the step's first node)
// serves the store whatever the layout of srun's tasks, an arbitrary one
// that the environment does not describe included.
TEST(Environment, SlurmStepsMasterIsNodeZeroInAnyTaskLayout) {
  expect_second_node_of_two(run_cohortrun({"-n", "2", "--", "sh", "-c", kPrintEnv}, Seconds(20),
                                          slurm_node1_with("SLURM_DISTRIBUTION=arbitrary")),
                            "n1", "23213");
}

TEST(Environment, SlurmMisuseIsRefused) {
  // Two tasks per node would be two launchers claiming one node rank.
  ProcessResult r = run_cohortrun({"-n", "2", "--", "true"}, Seconds(20),
                                  slurm_node1_with("SLURM_STEP_NUM_TASKS=4"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("start one cohortrun per node (srun --ntasks-per-node=1)"),
            std::string::npos)
      << r.err;
  r = run_cohortrun({"-n", "2", "--", "true"}, Seconds(20),
                    slurm_node1_with("SLURM_STEP_NODELIST=n[2-1]"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("node list 'n[2-1]' is malformed: range '2-1' descends"), std::string::npos)
      << r.err;
  // A batch script (no SLURM_STEP_ID) is one node, whatever the job has.
  r = run_cohortrun({"-n", "2", "--", "sh", "-c", kPrintEnv}, Seconds(20),
                    slurm_node1_with("SLURM_STEP_ID="));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto envs = parse(r.out);
  ASSERT_EQ(envs.count(0), 1u) << r.out;
  EXPECT_EQ(envs[0]["WORLD_SIZE"], "2");
  EXPECT_EQ(envs[0]["MASTER_ADDR"], "127.0.0.1");
}

}  // namespace
}  // namespace cohort::testing::environment_test
