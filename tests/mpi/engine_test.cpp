// What only the MPI engine does, in the world mpirun started: init under
// mpirun, completion without wait, a short message and an unanswered receive as errors, debug
// checks through MPI's store. Tests that need peers skip at world 1.
#include <gtest/gtest.h>

#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdlib>
#include <vector>

#include "cohort/cohort.h"

namespace cohort::testing::engine_test {
namespace {

#define NEED_PEERS(n) \
  if (world().size() < (n)) GTEST_SKIP() << "needs " << (n) << " ranks"

TEST(MpiInit, InitChoseMpiWithMpirunsRanks) {
  EXPECT_EQ(world().backend(), "mpi");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  ASSERT_NE(size, nullptr);
  ASSERT_NE(rank, nullptr);
  EXPECT_EQ(world().size(), std::atoi(size));
  EXPECT_EQ(world().rank(), std::atoi(rank));
}

TEST(MpiAsync, IsCompletedTurnsTrueWithoutWait) {
  auto& comm = world();
  auto t = torch::ones({4096});
  auto work = comm.all_reduce(t);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!work.is_completed()) ASSERT_LT(std::chrono::steady_clock::now(), deadline);
  EXPECT_TRUE(torch::equal(t, torch::full({4096}, static_cast<float>(comm.size()))));
}

TEST(MpiAsync, DebugChecksWorkThroughTheMpiStore) {
  // A second world communicator with debug checks on, over init's store
  // (a TcpStore rank 0 hosts, found through MPI): agreeing calls pass.
  ConnectOptions co;
  co.backend = "mpi";
  co.debug_checks = true;
  co.timeout = std::chrono::seconds(20);
  co.name = "debug";
  auto store = std::make_shared<PrefixStore>("debug", world().store());
  auto comm = connect(store, world().rank(), world().size(), co);
  auto t = torch::ones({3});
  comm->all_reduce(t).wait();
  EXPECT_EQ(t[0].item<float>(), static_cast<float>(comm->size()));
}

TEST(MpiP2P, ShortMessageIsAnErrorNamingThePeer) {
  NEED_PEERS(2);
  // On a group of ranks 0 and 1, so the failure breaks only that group.
  auto pair = world_ptr()->new_group({0, 1});
  if (!pair) return;
  if (pair->rank() == 0) {
    pair->send(torch::ones({3}), 1, {5}).wait();
  } else {
    auto t = torch::zeros({4});
    try {
      pair->recv(t, 0, {5}).wait();
      FAIL() << "a 3-element message filled a 4-element tensor";
    } catch (const MismatchError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("recv"), std::string::npos) << m;
      EXPECT_NE(m.find("peer 0"), std::string::npos) << m;
      EXPECT_NE(m.find("the message (12 bytes) is shorter than the receive buffer (16 bytes, "
                       "float32)"),
                std::string::npos)
          << m;
    }
  }
}

// A message longer than its receive buffer: Open MPI reports the
// truncation from MPI_Testall (MPI_ERR_IN_STATUS), on the receive's
// communicator, whose default handler would end the job. The receiver gets a
// MismatchError naming the call, the peer and its buffer, and the job goes
// on (the world barrier after it).
TEST(MpiP2P, TruncatedMessageIsAnErrorNotAnAbort) {
  NEED_PEERS(2);
  auto pair = world_ptr()->new_group({0, 1});
  if (pair && pair->rank() == 0) {
    pair->send(torch::ones({5}), 1, {6}).wait();
  } else if (pair) {
    auto t = torch::zeros({4});
    try {
      pair->recv(t, 0, {6}).wait();
      FAIL() << "a 5-element message fit a 4-element tensor";
    } catch (const MismatchError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("recv on rank 1 of 2"), std::string::npos) << m;
      EXPECT_NE(m.find("peer 0"), std::string::npos) << m;
      EXPECT_NE(m.find("the message is larger than the receive buffer (16 bytes, float32)"),
                std::string::npos)
          << m;
    }
  }
  world().barrier().wait();
}

// cohort sets MPI_ERRORS_RETURN on MPI_COMM_WORLD too (Open MPI raises some
// errors of cohort's own requests there): a truncated message on the world
// returns MPI_ERR_TRUNCATE to the caller, where MPI's default handler
// (MPI_ERRORS_ARE_FATAL) would abort the whole job.
TEST(MpiErrors, WorldReturnsErrorsAfterInit) {
  NEED_PEERS(2);
  (void)world();  // init() has run: the handler is cohort's
  const int rank = world().rank();
  std::vector<int> buf(8, 7);
  if (rank == 1) {
    ASSERT_EQ(MPI_Send(buf.data(), 8, MPI_INT, 0, 911, MPI_COMM_WORLD), MPI_SUCCESS);
  } else if (rank == 0) {
    const int code = MPI_Recv(buf.data(), 4, MPI_INT, 1, 911, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    int error_class = MPI_SUCCESS;
    MPI_Error_class(code, &error_class);
    EXPECT_EQ(error_class, MPI_ERR_TRUNCATE);
  }
  world().barrier().wait();  // the job survived on every rank
}

// The receive nobody sends to times out with a message naming the
// operation, the rank and the peer; then the message comes, so nothing is
// left for the watchdog.
TEST(MpiP2P, UnansweredRecvIsATimeoutError) {
  NEED_PEERS(2);
  auto pair = world_ptr()->new_group({0, 1});
  if (pair && pair->rank() == 0) {
    auto t = torch::zeros({2});
    auto work = pair->recv(t, 1, {9});
    const auto start = std::chrono::steady_clock::now();
    try {
      work.wait(std::chrono::milliseconds(300));
      FAIL() << "recv finished without a sender";
    } catch (const TimeoutError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("recv on rank 0 of 2"), std::string::npos) << m;
      EXPECT_NE(m.find("peer 1"), std::string::npos) << m;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    EXPECT_THROW((void)pair->barrier(), PeerError);  // the group refuses after a timeout
  }
  world().barrier().wait();  // rank 0 has timed out: now send
  if (pair && pair->rank() == 1) pair->send(torch::ones({2}), 0, {9}).wait();
  world().barrier().wait();
}

TEST(MpiDebug, MismatchedCollectivesAreNamedBeforeMpiSeesThem) {
  NEED_PEERS(2);
  ConnectOptions co;
  co.backend = "mpi";
  co.debug_checks = true;
  co.timeout = std::chrono::seconds(20);
  co.name = "checked";
  auto comm = connect(std::make_shared<PrefixStore>("mismatch", world().store()), world().rank(),
                      world().size(), co);
  auto t = torch::ones({5});
  try {
    if (comm->rank() == 0) {
      (void)comm->broadcast(t, {0});
    } else {
      (void)comm->all_reduce(t);
    }
    FAIL() << "different collectives passed the debug check";
  } catch (const MismatchError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 0 called broadcast"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace cohort::testing::engine_test
