// -n MIN:MAX: an elastic job restarts at the same size while --max-restarts
// lasts, then goes on one rank smaller (never below MIN), each rank seeing
// the new WORLD_SIZE.
#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace cohort::testing::elastic_test {
namespace {

// Rank 3 fails whenever the job has 4 ranks (a lost slot); rank 2 fails
// when FAIL_RANK_2 is set, at any size.
constexpr const char* kLostSlot = R"(
  echo "attempt $COHORT_RESTART_COUNT world $WORLD_SIZE"
  if [ "$WORLD_SIZE" = 4 ] && [ "$RANK" = 3 ]; then exit 7; fi
  if [ -n "$FAIL_RANK_2" ] && [ "$RANK" = 2 ]; then exit 9; fi)";

TEST(Elastic, ShrinksPastTheRestartBudgetAndFinishes) {
  ProcessResult r =
      run_cohortrun({"-n", "2:4", "--max-restarts", "1", "--", "sh", "-c", kLostSlot});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.err, "cohortrun: restart 1/1 after rank 3 exited with code 7\n"), 1)
      << r.err;
  EXPECT_EQ(count_of(r.err,
                     "cohortrun: rank 3 failed 2 times (rank 3 exited with code 7); restarting "
                     "at world 3 (min 2) from the newest checkpoint\n"),
            1)
      << r.err;
  // Attempts 0 and 1 ran 4 ranks, attempt 2 ran 3, each told so. In a
  // failing attempt the others may be stopped before they print: only the
  // failing rank's line (printed before it exits) is certain.
  EXPECT_EQ(count_of(r.out, "[3] attempt 1 world 4\n"), 1) << r.out;
  EXPECT_EQ(r.out.find("attempt 1 world 3"), std::string::npos) << r.out;
  EXPECT_EQ(count_of(r.out, "attempt 2 world 3\n"), 3) << r.out;
  EXPECT_EQ(r.out.find("[3] attempt 2"), std::string::npos) << r.out;
}

TEST(Elastic, NeverGoesBelowTheMinimum) {
  ProcessResult r =
      run_cohortrun({"-n", "3:4", "--", "sh", "-c", kLostSlot}, Seconds(20), {"FAIL_RANK_2=1"});
  ASSERT_FALSE(r.timed_out);
  // World 4: rank 2 or 3 fails first; world 3: rank 2 fails, and 3 is the minimum.
  EXPECT_EQ(r.exit_code, 9) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting at world 3 (min 3)"), 1) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting at world"), 1) << r.err;
  // Rank 2 prints before it fails; its peers may be stopped before they do.
  EXPECT_EQ(count_of(r.out, "[2] attempt 1 world 3\n"), 1) << r.out;
  EXPECT_EQ(r.out.find("attempt 1 world 2"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("attempt 2"), std::string::npos) << r.out;
}

TEST(Elastic, FixedSizeNeverShrinks) {
  ProcessResult r = run_cohortrun({"-n", "4", "--max-restarts", "1", "--", "sh", "-c", kLostSlot});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 7) << r.err;
  EXPECT_EQ(r.err.find("restarting at world"), std::string::npos) << r.err;
}

TEST(Elastic, BadRangesAreUsageErrors) {
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"-n", "4:3", "--", "true"},
                                             {"-n", "0:2", "--", "true"},
                                             {"-n", "2:x", "--", "true"},
                                             {"-n", "2:4", "--nnodes", "2", "--master-addr",
                                              "10.0.0.1", "--master-port", "29500", "--", "true"},
                                             {"-n", "2:4", "--backend", "mpi", "--", "true"}}) {
    ProcessResult r = run_cohortrun(args);
    EXPECT_EQ(r.exit_code, 2) << args[1] << ": " << r.err;
    EXPECT_NE(r.err.find("cohortrun: -n"), std::string::npos) << r.err;
  }
}

// --nnodes MIN:MAX: the rendezvous assigns node ranks, needs the host's
// address and two ports, and a fixed -n.
TEST(Elastic, BadNodeRangesAreUsageErrors) {
  const std::vector<std::string> host = {"--master-addr", "10.0.0.1", "--master-port", "29500"};
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"-n", "1", "--nnodes", "3:2"}, "--nnodes MIN:MAX needs 1 <= MIN <= MAX"},
      {{"-n", "1", "--nnodes", "0:2"}, "--nnodes MIN:MAX needs 1 <= MIN <= MAX"},
      {{"-n", "1", "--nnodes", "2:x"}, "--nnodes (MAX of MIN:MAX) must be an integer"},
      {{"-n", "1", "--nnodes", "2:3", "--node-rank", "1"}, "drop --node-rank"},
      {{"-n", "1:2", "--nnodes", "2:3"}, "needs a fixed -n"},
      {{"-n", "1", "--nnodes", "2:3", "--rdzv-id", "a/b"}, "--rdzv-id must be"},
      {{"-n", "1", "--nnodes", "2:3", "--heartbeat-timeout", "0"},
       "--heartbeat-timeout must be a positive number"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = args;
    argv.insert(argv.end(), host.begin(), host.end());
    argv.insert(argv.end(), {"--", "true"});
    ProcessResult r = run_cohortrun(argv);
    EXPECT_EQ(r.exit_code, 2) << message << ": " << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
  ProcessResult r = run_cohortrun({"-n", "1", "--nnodes", "2:3", "--", "true"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--master-addr is required"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace cohort::testing::elastic_test
