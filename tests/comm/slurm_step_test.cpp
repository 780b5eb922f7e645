// Slurm's node list syntax and a job step's variables (cohort/core/slurm.h),
// as tables; init() under them is in init_env_test.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
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

// A hostfile with `text`, removed with this object.
struct Hostfile {
  explicit Hostfile(const std::string& text)
      : path(::testing::TempDir() + "cohort_hostfile_" + std::to_string(::getpid()) + "_" +
             std::to_string(count++)) {
    std::ofstream(path) << text;
  }
  ~Hostfile() { std::remove(path.c_str()); }
  static inline int count = 0;
  std::string path;
};

// Task 0 serves the store: under srun --distribution=arbitrary it runs on
// the first host of SLURM_HOSTFILE, which need not be the step's first
// node; block, cyclic and plane layouts start on the first node.
TEST(SlurmStep, TheMasterIsTask0sHost) {
  auto vars = srun_task();  // task 2 of 4 on n2 n3
  for (const char* dist : {"block", "cyclic", "plane", "block:cyclic"}) {
    vars["SLURM_DISTRIBUTION"] = dist;
    EXPECT_EQ(step_of(vars)->master_addr, "n2") << dist;
  }
  Hostfile hosts("# task 0 on n3\nn3\nn2\nn3,n2\n");
  vars["SLURM_HOSTFILE"] = hosts.path;
  EXPECT_EQ(step_of(vars)->master_addr, "n2");  // a hostfile alone is not the layout
  for (const char* dist : {"arbitrary", "arbitrary,pack", "hostfile"}) {
    vars["SLURM_DISTRIBUTION"] = dist;
    EXPECT_EQ(step_of(vars)->master_addr, "n3") << dist;
  }
  Hostfile repeated("n3*2,n2*2\n");
  vars["SLURM_HOSTFILE"] = repeated.path;
  EXPECT_EQ(step_of(vars)->master_addr, "n3");

  // Where the step does not say (no hostfile, one unreadable or naming no
  // node of the step), no master rather than a guess.
  Hostfile none("# none\n\n");
  Hostfile other("n9\nn2\n");
  for (const std::string& file :
       {std::string(), ::testing::TempDir() + "no_such_hostfile", none.path, other.path}) {
    if (file.empty()) {
      vars.erase("SLURM_HOSTFILE");
    } else {
      vars["SLURM_HOSTFILE"] = file;
    }
    EXPECT_EQ(step_of(vars)->master_addr, "") << file;
  }
  // MASTER_ADDR, and one node, need no layout.
  vars["MASTER_ADDR"] = "10.0.0.9";
  EXPECT_EQ(step_of(vars)->master_addr, "10.0.0.9");
  vars.erase("MASTER_ADDR");
  vars["SLURM_STEP_NODELIST"] = "n2";
  EXPECT_EQ(step_of(vars)->master_addr, "127.0.0.1");
}

// What a task sees of its own node contradicts a layout that starts on the
// first node (a topology plugin orders a default layout by switches): task
// 0 elsewhere, or the first node's tasks without task 0.
TEST(SlurmStep, ATaskThatSeesTask0ElsewhereHasNoMaster) {
  auto vars = srun_task();
  vars["SLURM_PROCID"] = "0";
  vars["SLURM_NODEID"] = "1";  // on n3
  EXPECT_EQ(step_of(vars)->master_addr, "");
  vars["SLURM_NODEID"] = "0";
  EXPECT_EQ(step_of(vars)->master_addr, "n2");
  vars["SLURM_PROCID"] = "2";
  vars["SLURM_GTIDS"] = "2,3";  // n2's tasks
  EXPECT_EQ(step_of(vars)->master_addr, "");
  vars["SLURM_GTIDS"] = "2,0";
  EXPECT_EQ(step_of(vars)->master_addr, "n2");
  vars["SLURM_NODEID"] = "1";
  vars["SLURM_GTIDS"] = "2,3";  // n3's: nothing seen of task 0
  EXPECT_EQ(step_of(vars)->master_addr, "n2");
  // A hostfile the step was not laid out by (srun -w overrides it).
  Hostfile hosts("n3\nn2\nn3\nn2\n");
  vars["SLURM_DISTRIBUTION"] = "arbitrary";
  vars["SLURM_HOSTFILE"] = hosts.path;
  vars["SLURM_PROCID"] = "0";
  vars["SLURM_NODEID"] = "0";
  EXPECT_EQ(step_of(vars)->master_addr, "");
}

// Why there is no master, asking for MASTER_ADDR; node 0's host (a
// launcher whose node rank is SLURM_NODEID) is the first node whatever the
// task layout.
TEST(SlurmStep, NoMasterSaysWhy) {
  auto vars = srun_task();
  vars["SLURM_DISTRIBUTION"] = "arbitrary";
  Hostfile malformed("n2 n3\n");
  Hostfile other("n9\n");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"",
       "srun --distribution=arbitrary placed the tasks as a list says, and SLURM_HOSTFILE, "
       "which would name task 0's host, is unset"},
      {"/nonexistent/hosts", "SLURM_HOSTFILE '/nonexistent/hosts' cannot be read here: "},
      {malformed.path,
       "SLURM_HOSTFILE '" + malformed.path + "' begins with 'n2 n3', not a host name"},
      {other.path, "SLURM_HOSTFILE's first host n9 is not a node of this step"},
  };
  for (const auto& [file, why] : cases) {
    if (file.empty()) {
      vars.erase("SLURM_HOSTFILE");
    } else {
      vars["SLURM_HOSTFILE"] = file;
    }
    const auto s = step_of(vars);
    EXPECT_EQ(s->master_unknown.rfind(why, 0), 0u) << s->master_unknown;
    EXPECT_NE(s->master_unknown.find("set MASTER_ADDR to the host of task 0 (SLURM_PROCID=0)"),
              std::string::npos)
        << s->master_unknown;
    EXPECT_EQ(s->node0_addr, "n2");
  }
  vars = srun_task();
  vars["SLURM_PROCID"] = "0";
  vars["SLURM_NODEID"] = "1";
  EXPECT_EQ(step_of(vars)->master_unknown.rfind(
                "task 0 runs on n3, not on n2 where the other tasks look for it", 0),
            0u);
  vars["SLURM_PROCID"] = "1";
  vars["SLURM_NODEID"] = "0";
  vars["SLURM_GTIDS"] = "1,2";
  EXPECT_EQ(step_of(vars)->master_unknown.rfind(
                "task 0 does not run on n2, where the other tasks look for it (its tasks "
                "are SLURM_GTIDS=1,2)",
                0),
            0u);
  vars["MASTER_ADDR"] = "10.0.0.9";
  EXPECT_EQ(step_of(vars)->master_unknown, "");
  EXPECT_EQ(step_of(vars)->node0_addr, "10.0.0.9");
}

}  // namespace
}  // namespace cohort::slurm_step_test
