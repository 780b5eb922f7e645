// Every algorithm across real processes: 2, 3 and 4 ranks started by
// cohortrun, on Gloo and (when this build has it) on MPI through mpirun.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "cohort/comm/engine_registry.h"

namespace {

struct Run {
  int exit_code;
  std::string output;
};

Run run_job(const std::string& backend, int world) {
  const std::string log = ::testing::TempDir() + "algo_process_" + backend + std::to_string(world);
  // `timeout` bounds the whole job: a hang fails the test, never stalls it.
  // Adaptive calibrates three operations; up to 1 MiB keeps that to a few
  // seconds (the sizes above run the same code).
  const std::string cmd = "OPENBLAS_NUM_THREADS=1 COHORT_TIMEOUT=30 "
                          "COHORT_CALIBRATION_MAX_BYTES=1048576 timeout 100 " +
                          std::string(COHORTRUN_BIN) + " -n " + std::to_string(world) +
                          " --backend " + backend + " -- " + ALGO_PROCESS_BIN + " > " + log +
                          " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

class AlgorithmProcesses : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(AlgorithmProcesses, EveryAlgorithmMatchesTheFormulas) {
  const auto& [backend, world] = GetParam();
  const auto built = cohort::available_backends();
  if (std::find(built.begin(), built.end(), backend) == built.end()) {
    GTEST_SKIP() << "backend " << backend << " is not built";
  }
  if (backend == "mpi" && std::system("command -v mpirun > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "mpirun is not on PATH";
  }
  auto r = run_job(backend, world);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ok"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Cohortrun, AlgorithmProcesses,
                         ::testing::Combine(::testing::Values("gloo", "mpi"),
                                            ::testing::Values(2, 3, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
