// Jobs started wrongly: two processes given the same RANK must be told so by
// name, not left to time out waiting for the rank nobody started; a job of
// several nodes on a loopback --master-addr is warned of at start.
#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace cohort::testing::misuse_test {
namespace {

TEST(Misuse, DuplicateRankIsNamed) {
#ifndef COHORT_SMOKE_BIN
  GTEST_SKIP() << "cohort_smoke is not built";
#else
  // Rank 2's process claims RANK=1 as well.
  const std::string script =
      std::string(R"(if [ "$RANK" = 2 ]; then export RANK=1; fi; exec )") + COHORT_SMOKE_BIN;
  ProcessResult r =
      run_cohortrun({"-n", "3", "--", "sh", "-c", script}, Seconds(55), {"COHORT_TIMEOUT=45"});
  ASSERT_FALSE(r.timed_out) << r.err;
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("RANK=1 is used by more than one process (a duplicate RANK)"),
            std::string::npos)
      << r.err;
  // Three LibTorch start-ups on two loaded cores take seconds; a timeout
  // would take 45.
  EXPECT_LT(r.seconds, 30) << "the duplicate was found only by a timeout";
#endif
}

constexpr const char* kLoopbackWarning =
    "is a loopback address: launchers on this machine can form the job, but nodes on other "
    "machines cannot reach it; ";

// Node 1 of 2 on each loopback form: no rank connects anywhere, so it runs
// without node 0, and warns that ranks on another machine would time out.
TEST(Misuse, LoopbackMasterOfSeveralNodesIsWarnedOf) {
  for (const std::string addr : {"127.0.0.1", "127.1.2.3", "::1", "localhost"}) {
    ProcessResult r =
        run_cohortrun({"-n", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr", addr,
                       "--master-port", "29511", "--", "true"});
    EXPECT_EQ(r.exit_code, 0) << addr << ": " << r.err;
    const auto at =
        r.err.find("cohortrun: warning: --master-addr " + addr + " " + kLoopbackWarning +
                   "their ranks would wait for rank 0 on their own machine");
    EXPECT_EQ(at, 0u) << addr << ": " << r.err;
  }
}

// --nnodes 1:2 on loopback: this launcher hosts the rendezvous, runs alone
// once the last call passed, and said first that launchers on other
// machines would run as separate jobs.
TEST(Misuse, LoopbackRendezvousIsWarnedOfBeforeItStarts) {
  const std::string port = std::to_string(free_port_pair());
  ProcessResult r = run_cohortrun({"-n", "1", "--nnodes", "1:2", "--master-addr", "127.0.0.1",
                                   "--master-port", port, "--rdzv-last-call", "0.1", "--rdzv-id",
                                   "loopback-warning", "--", "true"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const auto warning = r.err.find(std::string("cohortrun: warning: --master-addr 127.0.0.1 ") +
                                  kLoopbackWarning + "they would run as separate jobs");
  EXPECT_EQ(warning, 0u) << r.err;
  EXPECT_NE(r.err.find("generation 0: node 0 of 1"), std::string::npos) << r.err;
}

// No warning on one node, nor on an address other machines may reach.
TEST(Misuse, NoWarningForOneNodeOrARoutableMaster) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"-n", "2", "--", "true"},
        std::vector<std::string>{"-n", "2", "--nnodes", "1", "--master-addr", "127.0.0.1", "--",
                                 "true"},
        std::vector<std::string>{"-n", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                 "10.1.2.3", "--master-port", "29511", "--", "true"}}) {
    ProcessResult r = run_cohortrun(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace cohort::testing::misuse_test
