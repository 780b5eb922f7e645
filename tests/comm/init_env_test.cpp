// cohort::init() reads torchrun's environment; a wrong or missing variable is
// a ConfigError that names it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <thread>

#include "cohort/cohort.h"
#include "cohort/comm/gloo/c10d_adapter.h"

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
