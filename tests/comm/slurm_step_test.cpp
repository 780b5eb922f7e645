// Slurm's node list syntax and a job step's variables (cohort/core/slurm.h),
// as tables; init() under them is in init_env_test.cpp.
#include <gtest/gtest.h>

#include <map>

#include "cohort/core/error.h"
#include "cohort/core/slurm.h"

namespace cohort::slurm_step_test {
namespace {

using namespace slurm;
using Hosts = std::vector<std::string>;

TEST(SlurmNodelist, ExpandsEveryForm) {
  const std::vector<std::pair<std::string, Hosts>> cases = {
      {"node7", {"node7"}},
      {"a,b,c", {"a", "b", "c"}},
      {"host[01-04,07]", {"host01", "host02", "host03", "host04", "host07"}},
      {"a[1-2],b3", {"a1", "a2", "b3"}},
      {"n[1-2]-ib", {"n1-ib", "n2-ib"}},
      {"gpu-a100-2[8-10]", {"gpu-a100-28", "gpu-a100-29", "gpu-a100-210"}},
      {"n[008-010]", {"n008", "n009", "n010"}},
      {"n[9-11]", {"n9", "n10", "n11"}},
      {"x[3]", {"x3"}},
      {"r[1-2]c[0-1]", {"r1c0", "r1c1", "r2c0", "r2c1"}},
      {"a.b[1-2].c,d_e", {"a.b1.c", "a.b2.c", "d_e"}},
      {"[1-2]", {"1", "2"}},
  };
  for (const auto& [list, hosts] : cases) {
    EXPECT_EQ(expand_nodelist(list), hosts) << list;
  }
}

TEST(SlurmNodelist, MalformedListsAreNamed) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "it is empty"},
      {"n[1-2", "'[' without ']'"},
      {"n1-2]", "']' without '['"},
      {"n[1-[2]]", "nested '['"},
      {"n[]", "empty brackets"},
      {"n[3-1]", "range '3-1' descends"},
      {"n[a-b]", "range bound 'a' is not a number"},
      {"n[1-]", "range bound ''"},
      {"n[1,]", "range bound ''"},
      {"n[-1]", "range bound ''"},
      {"n[1-2-3]", "range bound '2-3' is not a number"},
      {"a,,b", "an empty host name"},
      {"a,", "an empty host name"},
      {"a b", "character ' '"},
      {"n[0-70000]", "more than 65536 hosts"},
      {"n[0-999]m[0-999]", "more than 65536 hosts"},
  };
  for (const auto& [list, why] : cases) {
    std::string what = "no error";
    try {
      expand_nodelist(list);
    } catch (const ConfigError& e) {
      what = e.what();
    }
    EXPECT_EQ(what, "cohort: Slurm node list '" + list + "' is malformed: " + why) << list;
  }
}

TEST(SlurmStep, DefaultPortIsInItsRange) {
  EXPECT_EQ(default_port(0, 0), 20000);
  EXPECT_EQ(default_port(4321, 3), 23213);
  EXPECT_EQ(default_port(999, 9), 29999);
  EXPECT_EQ(default_port(67108863, 4294967294ULL), 28634);
  EXPECT_NE(default_port(4321, 0), default_port(4322, 0));
  EXPECT_NE(default_port(4321, 0), default_port(4321, 1));
}

// A step as srun describes task 2 of 4 on two nodes.
std::map<std::string, std::string> srun_task() {
  return {{"SLURM_JOB_ID", "4321"},
          {"SLURM_STEP_ID", "3"},
          {"SLURM_PROCID", "2"},
          {"SLURM_NTASKS", "4"},
          {"SLURM_STEP_NUM_TASKS", "4"},
          {"SLURM_LOCALID", "0"},
          {"SLURM_JOB_NODELIST", "n[1-3]"},
          {"SLURM_STEP_NODELIST", "n[2-3]"}};
}

std::optional<Step> step_of(const std::map<std::string, std::string>& vars) {
  return job_step([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

TEST(SlurmStep, ReadsTheStepsVariables) {
  auto vars = srun_task();
  auto s = step_of(vars);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->rank, 2);
  EXPECT_EQ(s->size, 4);
  EXPECT_EQ(s->local_rank, 0);
  EXPECT_EQ(s->hosts, (Hosts{"n2", "n3"}));  // the step's nodes, not the job's
  EXPECT_EQ(s->master_addr, "n2");
  EXPECT_EQ(s->master_port, 23213);

  // The step's task count wins over the job's; the job's node list serves
  // when the step's is missing; MASTER_ADDR and MASTER_PORT win.
  vars["SLURM_NTASKS"] = "8";
  vars.erase("SLURM_STEP_NODELIST");
  vars["MASTER_PORT"] = "29500";
  s = step_of(vars);
  EXPECT_EQ(s->size, 4);
  EXPECT_EQ(s->hosts, (Hosts{"n1", "n2", "n3"}));
  EXPECT_EQ(s->master_port, 29500);
  vars["MASTER_ADDR"] = "10.0.0.9";
  EXPECT_EQ(step_of(vars)->master_addr, "10.0.0.9");

  // One node: loopback only.
  vars = srun_task();
  vars["SLURM_STEP_NODELIST"] = "n2";
  EXPECT_EQ(step_of(vars)->master_addr, "127.0.0.1");
}

TEST(SlurmStep, OutsideAStepIsNone) {
  auto vars = srun_task();
  vars.erase("SLURM_STEP_ID");  // a batch script: SLURM_PROCID=0, SLURM_NTASKS=4
  vars["SLURM_PROCID"] = "0";
  vars.erase("SLURM_STEP_NUM_TASKS");
  EXPECT_FALSE(step_of(vars));
  // Slurm 26 names the batch script's own step (-5), as does the extern
  // step (-4); an id past Slurm's last normal one, printed unsigned, too.
  for (const char* id : {"-5", "-4", "4294967291"}) {
    vars["SLURM_STEP_ID"] = id;
    EXPECT_FALSE(step_of(vars)) << id;
  }
  vars["SLURM_STEP_ID"] = "0";
  EXPECT_TRUE(step_of(vars));
}

TEST(SlurmStep, ContradictionsAreNamed) {
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"SLURM_PROCID", "4", "SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"},
      {"SLURM_PROCID", "", "Slurm job step without SLURM_PROCID"},
      {"SLURM_PROCID", "two", "SLURM_PROCID='two' is not an integer in [0, 1048576]"},
      {"SLURM_STEP_NUM_TASKS", "0", "SLURM_STEP_NUM_TASKS='0' is not an integer in [1, 1048576]"},
      {"SLURM_LOCALID", "4", "SLURM_LOCALID='4' is not an integer in [0, 3]"},
      {"SLURM_JOB_ID", "-1", "SLURM_JOB_ID='-1' is not a Slurm id"},
      {"SLURM_JOB_ID", "", "Slurm job step without SLURM_JOB_ID"},
      {"MASTER_PORT", "0", "MASTER_PORT='0' is not an integer in [1, 65535]"},
      {"SLURM_STEP_NODELIST", "n[2-", "node list 'n[2-' is malformed: '[' without ']'"},
  };
  for (const auto& [name, value, message] : cases) {
    auto vars = srun_task();
    if (value.empty()) {
      vars.erase(name);
    } else {
      vars[name] = value;
    }
    std::string what = "no error";
    try {
      step_of(vars);
    } catch (const ConfigError& e) {
      what = e.what();
    }
    EXPECT_NE(what.find(message), std::string::npos) << name << "=" << value << ": " << what;
  }
  auto vars = srun_task();
  vars.erase("SLURM_STEP_NUM_TASKS");
  vars.erase("SLURM_NTASKS");
  EXPECT_THROW(step_of(vars), ConfigError);
}

// Every task of a step laid out as `node_of_task` says (SLURM_PROCID ->
// node index into `hosts`), with the variables slurmstepd sets on each
// (`drop` names ones left out, `extra` adds some), as job_step() reads them.
std::vector<Step> layout_steps(const std::vector<int>& node_of_task, const Hosts& hosts,
                               const std::vector<std::string>& drop = {},
                               const std::map<std::string, std::string>& extra = {}) {
  std::vector<Step> out;
  const int n = static_cast<int>(node_of_task.size());
  for (int t = 0; t < n; ++t) {
    int local = 0;
    std::string gtids;
    for (int u = 0; u < n; ++u) {
      if (node_of_task[u] != node_of_task[t]) continue;
      if (u < t) ++local;
      gtids += (gtids.empty() ? "" : ",") + std::to_string(u);
    }
    std::string list;
    for (const auto& h : hosts) list += (list.empty() ? "" : ",") + h;
    std::map<std::string, std::string> vars = {
        {"SLURM_JOB_ID", "4321"},
        {"SLURM_STEP_ID", "3"},
        {"SLURM_PROCID", std::to_string(t)},
        {"SLURM_STEP_NUM_TASKS", std::to_string(n)},
        {"SLURM_LOCALID", std::to_string(local)},
        {"SLURM_NODEID", std::to_string(node_of_task[t])},
        {"SLURMD_NODENAME", hosts[static_cast<size_t>(node_of_task[t])]},
        {"SLURM_GTIDS", gtids},
        {"SLURM_STEP_NODELIST", list}};
    for (const auto& name : drop) vars.erase(name);
    for (const auto& [name, value] : extra) vars[name] = value;
    out.push_back(*step_of(vars));
  }
  return out;
}

// The step's tasks meet, or all refuse at once: every task names the same
// store, exactly one serves it, on that host. Returns why not, else "".
std::string rendezvous_flaw(const std::vector<Step>& tasks, const std::vector<int>& node_of_task,
                            const Hosts& hosts) {
  int servers = 0, refusing = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const auto& s = tasks[t];
    if (!s.master_unknown.empty()) {
      ++refusing;
      continue;
    }
    if (s.master_addr != tasks[0].master_addr)
      return "task " + std::to_string(t) + " dials " + s.master_addr;
    if (!s.serves_store) continue;
    ++servers;
    const auto& host = hosts[static_cast<size_t>(node_of_task[t])];
    if (s.master_addr != host && s.master_addr != "127.0.0.1") {
      return "task " + std::to_string(t) + " serves on " + host + ", not " + s.master_addr;
    }
  }
  if (refusing == static_cast<int>(tasks.size())) return "";
  if (refusing > 0) return std::to_string(refusing) + " tasks refuse and the others wait";
  if (servers != 1) return std::to_string(servers) + " tasks serve the store";
  return "";
}

// Block, cyclic and plane layouts start on the first node; an arbitrary one
// (SLURM_HOSTFILE, which may be unreadable on some nodes) or one a topology
// plugin ordered need not. The store is on the first node, served by its
// first task, wherever task 0 runs: no layout leaves a task waiting.
TEST(SlurmStep, EveryLayoutMeetsOnTheFirstNode) {
  const Hosts hosts = {"n2", "n3", "n4"};
  const std::vector<std::pair<std::string, std::vector<int>>> layouts = {
      {"block", {0, 0, 1, 1, 2, 2}},   {"cyclic", {0, 1, 2, 0, 1, 2}},
      {"plane=2", {0, 0, 1, 1, 2, 0}}, {"topology", {1, 1, 0, 0, 2, 2}},
      {"topology 2", {2, 0, 1}},       {"arbitrary", {2, 1, 1, 0, 0, 2}},
      {"uneven", {1, 0, 0, 0, 2}},
  };
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"srun's variables", {}},
      {"without SLURMD_NODENAME", {"SLURMD_NODENAME"}},
      {"without SLURM_GTIDS", {"SLURM_GTIDS"}},
  };
  for (const auto& [name, nodes] : layouts) {
    for (const auto& [variant, drop] : variants) {
      const auto tasks = layout_steps(nodes, hosts, drop);
      EXPECT_EQ(rendezvous_flaw(tasks, nodes, hosts), "") << name << ", " << variant;
      for (const auto& s : tasks) {
        EXPECT_EQ(s.master_addr, "n2") << name << ", " << variant;
        EXPECT_EQ(s.master_unknown, "") << name << ", " << variant;
      }
      // MASTER_ADDR: task 0 serves there, as under torchrun.
      const auto given = layout_steps(nodes, hosts, drop, {{"MASTER_ADDR", "10.0.0.9"}});
      for (size_t t = 0; t < given.size(); ++t) {
        EXPECT_EQ(given[t].master_addr, "10.0.0.9");
        EXPECT_EQ(given[t].serves_store, t == 0) << name << ", task " << t;
      }
    }
  }
  // One node: task 0 serves on loopback.
  const auto one = layout_steps({0, 0, 0}, {"n2"});
  EXPECT_EQ(rendezvous_flaw(one, {0, 0, 0}, {"n2"}), "");
  EXPECT_TRUE(one[0].serves_store);
  EXPECT_EQ(one[1].master_addr, "127.0.0.1");
}

// Where a task cannot tell whether it serves, every task of the step says
// so alike (srun sets these variables on every task or on none), asking
// for MASTER_ADDR.
TEST(SlurmStep, AnUnknownServerIsRefusedByEveryTask) {
  const Hosts hosts = {"n2", "n3"};
  const std::vector<int> nodes = {1, 0, 0, 1};
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"SLURM_LOCALID"},
       "SLURM_LOCALID is unset, which says which task of the first node serves the store"},
      {{"SLURMD_NODENAME", "SLURM_NODEID"},
       "SLURMD_NODENAME and SLURM_NODEID are unset, which say whether this task runs on n2"},
      {{"SLURM_STEP_NODELIST"},
       "SLURM_STEP_NODELIST is unset, and the job's first node need not run a task of it"},
  };
  for (const auto& [drop, why] : cases) {
    const auto tasks = layout_steps(nodes, hosts, drop, {{"SLURM_JOB_NODELIST", "n[2-3]"}});
    EXPECT_EQ(rendezvous_flaw(tasks, nodes, hosts), "") << why;
    for (const auto& s : tasks) {
      EXPECT_EQ(s.master_unknown, "cohort: Slurm job step on 2 nodes: " + why +
                                      "; set MASTER_ADDR to the host of task 0 (SLURM_PROCID=0)");
    }
  }
  // A node the step's list does not hold (a heterogeneous step's).
  const auto other = layout_steps(nodes, hosts, {}, {{"SLURMD_NODENAME", "n9"}});
  EXPECT_NE(other[0].master_unknown.find("this task's node n9 is not in SLURM_STEP_NODELIST"),
            std::string::npos)
      << other[0].master_unknown;
}

}  // namespace
}  // namespace cohort::slurm_step_test
