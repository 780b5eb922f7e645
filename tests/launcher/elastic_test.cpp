// -n MIN:MAX: an elastic job restarts at the same size while --max-restarts
// lasts, then goes on one rank smaller (never below MIN), each rank seeing
// the new WORLD_SIZE.
#include <gtest/gtest.h>

#include <memory>
#include <regex>

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

// Each rank asks the launchers' store (the port before MASTER_PORT) to let
// it in without a token, prints the status byte of the answer (0 in, 2
// refused) and its own token, then runs the smoke job (an all_reduce over
// the ranks' store, which requires that token) where it is built.
std::string probe_then_smoke() {
  std::string script = R"sh(
    exec 3<>/dev/tcp/127.0.0.1/$((MASTER_PORT - 1)) || exit 3
    printf '\005\000\000\000\007\000\000\000\000' >&3
    echo "tokenless client: status $(head -c 5 <&3 | od -An -tu1 | awk '{print $5}')"
    exec 3<&-
    echo "token $COHORT_STORE_TOKEN")sh";
#ifdef COHORT_SMOKE_BIN
  script += std::string("\n    exec ") + COHORT_SMOKE_BIN;
#endif
  return script;
}

// --nnodes MIN:MAX with every launcher on this machine (a loopback
// --master-addr) and no COHORT_STORE_TOKEN: the host makes a token and
// leaves it for the other launchers of this machine; the launchers' store
// refuses a client without it, every rank gets it, and two launchers still
// form one job.
TEST(Elastic, OneMachineRendezvousRequiresAGeneratedToken) {
  const int free = free_port_pair();
  ASSERT_GT(free, 0) << "no two free ports in a row on 127.0.0.1";
  const std::string port = std::to_string(free);
  std::vector<std::unique_ptr<Subprocess>> launchers;
  for (int node = 0; node < 2; ++node) {
    launchers.push_back(std::make_unique<Subprocess>(
        cohortrun_argv({"-n", "1", "--nnodes", "1:2", "--master-addr", "127.0.0.1", "--master-port",
                        port, "--rdzv-id", "token-" + port, "--rdzv-last-call", "30", "--timeout",
                        "60", "--", "bash", "-c", probe_then_smoke()}),
        // Two launchers of one machine are two "nodes" on loopback.
        std::vector<std::string>{"COHORT_BIND_ADDR=127.0.0.1"}));
  }
  std::string tokens[2];
  for (int node = 0; node < 2; ++node) {
    ProcessResult r = launchers[node]->finish(Seconds(90));
    SCOPED_TRACE("launcher " + std::to_string(node));
    ASSERT_FALSE(r.timed_out) << r.out << r.err;
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(count_of(r.out, "tokenless client: status 2\n"), 1) << r.out << r.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(token ([0-9a-f]{32})\.generation-0\n)")))
        << r.out;
    tokens[node] = m[1];
#ifdef COHORT_SMOKE_BIN
    EXPECT_EQ(count_of(r.out, " of 2 got 3.0, expected 3.0"), 1) << r.out << r.err;
#endif
  }
  EXPECT_EQ(tokens[0], tokens[1]);
}

// -n MIN:MAX on one node: cohortrun starts every rank itself and hands them
// a fresh token; rank 0's store refuses a client without it (rank 1 asks
// before it joins), and the job runs.
TEST(Elastic, OneNodeElasticStoreRequiresTheToken) {
#ifndef COHORT_SMOKE_BIN
  GTEST_SKIP() << "cohort_smoke is not built";
#else
  const std::string script = std::string(R"sh(
    if [ "$RANK" = 1 ]; then
      exec 3<>/dev/tcp/127.0.0.1/$MASTER_PORT || exit 3
      printf '\005\000\000\000\007\000\000\000\000' >&3
      echo "tokenless client: status $(head -c 5 <&3 | od -An -tu1 | awk '{print $5}')"
      exec 3<&-
    fi
    exec )sh") + COHORT_SMOKE_BIN;
  ProcessResult r = run_cohortrun({"-n", "1:2", "--", "bash", "-c", script}, Seconds(60));
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count_of(r.out, "[1] tokenless client: status 2\n"), 1) << r.out << r.err;
  EXPECT_EQ(count_of(r.out, " of 2 got 3.0, expected 3.0"), 2) << r.out;
#endif
}

}  // namespace
}  // namespace cohort::testing::elastic_test
