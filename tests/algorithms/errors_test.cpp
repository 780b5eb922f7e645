// The algorithms' own error behaviour (their results are the contract
// suite's: tests/contract runs every case under every algorithm).
#include <gtest/gtest.h>

#include "support/thread_ranks.h"

namespace cohort::testing::errors_test {
namespace {

// A peer that never joins (alive, elsewhere): the wait times out within the operation's
// timeout, and the message names the operation, the algorithm's step and
// the peer it waited for.
TEST(AlgorithmErrors, TimeoutNamesTheStepAndThePeer) {
  ThreadRanksOptions o;
  o.algorithm = Algorithm::Ring;
  run_ranks(
      2,
      [](Communicator& comm) {
        auto t = torch::ones({100});
        comm.all_reduce(t).wait();  // both ranks: the executors exist
        if (comm.rank() == 1) {
          // Alive but absent (a departed peer would be a PeerError instead).
          comm.store()->wait({"timed_out"}, std::chrono::seconds(15));
          return;
        }
        AllReduceOptions ao;
        ao.timeout = std::chrono::milliseconds(800);
        const auto start = std::chrono::steady_clock::now();
        try {
          comm.all_reduce(t, ao).wait();
          ADD_FAILURE() << "no timeout";
        } catch (const TimeoutError& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find("all_reduce on rank 0 of 2"), std::string::npos) << what;
          // The first step that waits for the peer is the collective's
          // signature check, before the ring's first message.
          EXPECT_NE(what.find("the check of collective"), std::string::npos) << what;
          EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
        comm.store()->set_string("timed_out", "1");
      },
      o);
}

}  // namespace
}  // namespace cohort::testing::errors_test
