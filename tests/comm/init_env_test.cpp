// cohort::init() reads torchrun's environment, and a Slurm job step's when
// torchrun's is absent; a wrong or missing variable is a ConfigError that
// names it.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <thread>

#include "cohort/cohort.h"
#include "cohort/comm/gloo/c10d_adapter.h"
#include "cohort/core/slurm.h"
#include "cohort/core/store/tcp_store.h"

namespace cohort::init_env_test {
namespace {

using namespace std::chrono_literals;

// Sets variables for one test and restores the old values after.
class EnvGuard {
 public:
  void set(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~EnvGuard() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::string init_error(EnvGuard&) {
  try {
    init();
    finalize();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(InitEnv, MissingRankIsNamed) {
  EnvGuard env;
  env.set("WORLD_SIZE", "2");
  env.set("RANK", nullptr);
  EXPECT_NE(init_error(env).find("RANK is not set"), std::string::npos);
}

TEST(InitEnv, NonIntegerWorldSizeIsNamed) {
  EnvGuard env;
  env.set("WORLD_SIZE", "two");
  EXPECT_NE(init_error(env).find("WORLD_SIZE='two' is not an integer"), std::string::npos);
}

TEST(InitEnv, RankOutsideWorldIsNamed) {
  EnvGuard env;
  env.set("WORLD_SIZE", "2");
  env.set("RANK", "2");
  EXPECT_NE(init_error(env).find("RANK=2 is outside [0, 1]"), std::string::npos);
}

TEST(InitEnv, MissingMasterAddrIsNamed) {
  EnvGuard env;
  env.set("WORLD_SIZE", "1");
  env.set("RANK", "0");
  env.set("MASTER_ADDR", nullptr);
  EXPECT_NE(init_error(env).find("MASTER_ADDR is not set"), std::string::npos);
}

TEST(InitEnv, BadPortAndTimeoutAreNamed) {
  EnvGuard env;
  env.set("WORLD_SIZE", "1");
  env.set("RANK", "0");
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", "70000");
  EXPECT_NE(init_error(env).find("MASTER_PORT=70000 is outside"), std::string::npos);
  env.set("MASTER_PORT", "29500");
  env.set("COHORT_TIMEOUT", "-3");
  EXPECT_NE(init_error(env).find("COHORT_TIMEOUT='-3' is not a positive number"),
            std::string::npos);
  // Not finite, overflowing a deadline, or rounding to 0 ms.
  for (const char* bad : {"inf", "nan", "1e10", "1e-9", "0"}) {
    env.set("COHORT_TIMEOUT", bad);
    const std::string err = init_error(env);
    EXPECT_NE(err.find("COHORT_TIMEOUT='" + std::string(bad) +
                       "' is not a positive number of "
                       "seconds between 0.001 and 2592000"),
              std::string::npos)
        << bad << ": " << err;
  }
  env.set("COHORT_TIMEOUT", nullptr);
  env.set("COHORT_BACKEND", "carrier-pigeon");
  EXPECT_NE(init_error(env).find("backend 'carrier-pigeon' is not available"), std::string::npos);
}

TEST(InitEnv, SingleRankJobInitializesAndReduces) {
  EnvGuard env;
  env.set("WORLD_SIZE", "1");
  env.set("RANK", "0");
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", "0");  // rank 0 hosts the store: any free port
  env.set("COHORT_BACKEND", nullptr);
  env.set("COHORT_DEBUG", "detail");
  EXPECT_THROW(init(), ConfigError) << "port 0 is outside [1, 65535]";
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:0";
  auto comm = init(o);
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(&world(), comm.get());
  auto t = torch::full({3}, 2.5);
  world().all_reduce(t, {ReduceOp::Avg}).wait();
  EXPECT_EQ(t[0].item<float>(), 2.5f);
  EXPECT_THROW(init(o), ConfigError);  // twice is an error
  finalize();
  EXPECT_FALSE(is_initialized());
  EXPECT_THROW(world(), ConfigError);
}

// With no backend asked for, init() takes "auto": UCX when this build has
// it, else Gloo, and COHORT_DEBUG=detail says which and why.
TEST(InitEnv, DefaultBackendIsAutoAndDebugSaysWhy) {
  EnvGuard env;
  env.set("WORLD_SIZE", "1");
  env.set("RANK", "0");
  env.set("COHORT_BACKEND", nullptr);
  env.set("COHORT_DEBUG", "detail");
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:0";
  ::testing::internal::CaptureStderr();
  auto comm = init(o);
  const std::string err = ::testing::internal::GetCapturedStderr();
#ifdef COHORT_WITH_UCX
  const std::string expected = "ucx";
#else
  const std::string expected = "gloo";
#endif
  EXPECT_EQ(comm->backend(), expected);
  EXPECT_NE(err.find("backend auto is " + expected + ": "), std::string::npos) << err;
  finalize();
}

// A trace folder that cannot be written is found by init(), before the job
// runs, not when the trace is flushed at exit.
TEST(InitEnv, UnwritableTraceFolderIsRefusedAtInit) {
  const auto file = ::testing::TempDir() + "cohort_trace_file_" + std::to_string(::getpid());
  std::ofstream(file) << "a file, not a folder";
  EnvGuard env;
  env.set("WORLD_SIZE", "1");
  env.set("RANK", "0");
  env.set("COHORT_BACKEND", nullptr);
  env.set("COHORT_TRACE", (file + "/trace").c_str());
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:0";
  std::string what = "no error";
  try {
    init(o);
    finalize();
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("cannot write the trace " + file + "/trace/rank-0.json"), std::string::npos)
      << what;
  EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
  EXPECT_FALSE(is_initialized());
  std::remove(file.c_str());
}

// A Slurm job id whose step 0's default port is free on loopback now.
int job_with_free_port() {
  for (int i = 0; i < 1000; ++i) {
    const int job = (::getpid() + i) % 1000;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(slurm::default_port(job, 0)));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (free) return job;
  }
  throw std::runtime_error("no free port in [20000, 29999]");
}

// Task `procid` of a step of `ntasks` on one node, as srun starts it, and
// nothing from torchrun or mpirun. A failure waits 5 s, not 30 minutes.
void set_slurm_step(EnvGuard& env, int job, const char* ntasks, const char* procid) {
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                           "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "COHORT_BACKEND"}) {
    env.set(name, nullptr);
  }
  env.set("COHORT_TIMEOUT", "5");
  env.set("SLURM_JOB_ID", std::to_string(job).c_str());
  env.set("SLURM_STEP_ID", "0");
  env.set("SLURM_STEP_NUM_TASKS", ntasks);
  env.set("SLURM_PROCID", procid);
  env.set("SLURM_LOCALID", procid);
  env.set("SLURM_STEP_NODELIST", "node[07]");
}

TEST(InitSlurm, TaskOfAStepIsItsRankUnlessALauncherSaysOtherwise) {
  EnvGuard env;
  const int job = job_with_free_port();
  set_slurm_step(env, job, "1", "0");
  auto comm = init();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  // One node: the store listens on loopback, at the job's port.
  auto store = std::dynamic_pointer_cast<TcpStore>(comm->store());
  ASSERT_TRUE(store);
  EXPECT_EQ(store->port(), slurm::default_port(job, 0));
  auto t = torch::full({2}, 1.5);
  comm->all_reduce(t).wait();
  EXPECT_EQ(t[1].item<float>(), 1.5f);
  finalize();

  // Inside a step of 4, torchrun's variables (cohortrun's ranks) win.
  set_slurm_step(env, job, "4", "2");
  env.set("RANK", "0");
  env.set("WORLD_SIZE", "1");
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:0";
  comm = init(o);
  EXPECT_EQ(comm->size(), 1);
  finalize();
  // Under mpirun the SLURM_ variables are the batch step's: not read.
  env.set("RANK", nullptr);
  env.set("WORLD_SIZE", nullptr);
  env.set("OMPI_COMM_WORLD_SIZE", "4");
  env.set("COHORT_BACKEND", "gloo");  // not the MPI engine: that would MPI_Init this process
  EXPECT_NE(init_error(env).find("WORLD_SIZE is not set"), std::string::npos);
}

// local_rank(): the launcher nearest to the process says it.
TEST(InitSlurm, LocalRankComesFromTheNearestLauncher) {
  EnvGuard env;
  set_slurm_step(env, job_with_free_port(), "4", "3");
  env.set("LOCAL_RANK", nullptr);
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", nullptr);
  EXPECT_EQ(local_rank(), 3);  // srun, a task per rank
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  EXPECT_EQ(local_rank(), 1);  // mpirun inside the allocation
  env.set("LOCAL_RANK", "2");
  EXPECT_EQ(local_rank(), 2);  // cohortrun or torchrun
  env.set("LOCAL_RANK", "x");
  EXPECT_THROW(local_rank(), ConfigError);
  env.set("LOCAL_RANK", nullptr);
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", nullptr);
  env.set("SLURM_STEP_ID", nullptr);  // a batch script: not a task of a step
  EXPECT_EQ(local_rank(), 0);
}

// The batch script has SLURM_PROCID=0 and SLURM_NTASKS=4 but is one
// process: as rank 0 of 4 it would wait for ranks nobody starts.
TEST(InitSlurm, BatchScriptIsNotRankZeroOfMany) {
  EnvGuard env;
  set_slurm_step(env, job_with_free_port(), "4", "0");
  env.set("SLURM_STEP_ID", nullptr);
  env.set("SLURM_STEP_NUM_TASKS", nullptr);
  env.set("SLURM_NTASKS", "4");
  const std::string err = init_error(env);
  EXPECT_NE(err.find("not in a job step"), std::string::npos) << err;
  EXPECT_NE(err.find("srun PROGRAM"), std::string::npos) << err;
}

// A step on several nodes whose tasks cannot tell which of them serves the
// store (no SLURMD_NODENAME nor SLURM_NODEID): refused at once, asking for
// MASTER_ADDR, rather than dialling a store nobody serves until COHORT_TIMEOUT.
TEST(InitSlurm, AnUnknownServerIsRefusedAtOnce) {
  EnvGuard env;
  set_slurm_step(env, job_with_free_port(), "2", "1");
  // Nodes whose names resolve here: a guess would be dialled until the timeout.
  env.set("SLURM_STEP_NODELIST", "127.0.0.1,localhost");
  env.set("SLURMD_NODENAME", nullptr);
  env.set("SLURM_NODEID", nullptr);
  env.set("COHORT_BIND_ADDR", "127.0.0.1");
  const auto start = std::chrono::steady_clock::now();
  const std::string err = init_error(env);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_NE(err.find("SLURMD_NODENAME and SLURM_NODEID are unset, which say whether this task "
                     "runs on 127.0.0.1; set MASTER_ADDR"),
            std::string::npos)
      << err;
}

TEST(InitSlurm, ContradictionIsNamed) {
  EnvGuard env;
  set_slurm_step(env, job_with_free_port(), "4", "4");
  const std::string err = init_error(env);
  EXPECT_NE(err.find("SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"), std::string::npos)
      << err;
}

TEST(InitFile, FileRendezvousWithThreeRanks) {
  auto path = ::testing::TempDir() + "cohort_init_file_" + std::to_string(::getpid());
  std::remove(path.c_str());
  // Three ranks in threads cannot share the one default group, so this goes
  // through the same file store and connect() that init() uses.
  std::vector<std::thread> ts;
  std::vector<float> got(3);
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r] {
      auto comm = connect(make_file_store(path, 3, 10s), r, 3, {});
      auto t = torch::full({2}, static_cast<float>(r));
      comm->all_reduce(t, {ReduceOp::Max}).wait();
      got[r] = t[0].item<float>();
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(got, (std::vector<float>{2, 2, 2}));
}

}  // namespace
}  // namespace cohort::init_env_test
