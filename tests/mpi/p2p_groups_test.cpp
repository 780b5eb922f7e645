// Tagged point-to-point, subgroups, timeouts and debug checks on the MPI
// engine, in the world mpirun started. Tests that need peers skip at world 1.
#include <gtest/gtest.h>

#include "cohort/cohort.h"

namespace cohort::testing {
namespace {

#define NEED_PEERS(n) \
  if (world().size() < (n)) GTEST_SKIP() << "needs " << (n) << " ranks"

// Each rank sends two messages to its right neighbour, tags 7 then 3, and
// receives them from its left neighbour in the opposite order: tags, not
// arrival order, decide which buffer gets which message.
TEST(MpiP2P, TagsKeepConcurrentMessagesApart) {
  NEED_PEERS(2);
  auto& comm = world();
  const int w = comm.size(), me = comm.rank();
  const int right = (me + 1) % w, left = (me + w - 1) % w;
  auto a = torch::full({100000}, 100.0 * me + 7);  // large: not sent eagerly
  auto b = torch::full({10}, 100.0 * me + 3, torch::kBFloat16);
  auto sa = comm.send(a, right, {7});
  auto sb = comm.send(b, right, {3});
  auto rb = torch::zeros({10}, torch::kBFloat16);
  auto ra = torch::zeros({100000});
  comm.recv(rb, left, {3}).wait();
  comm.recv(ra, left, {7}).wait();
  sa.wait();
  sb.wait();
  EXPECT_TRUE(torch::equal(ra, torch::full({100000}, 100.0 * left + 7)));
  EXPECT_TRUE(torch::equal(rb, torch::full({10}, 100.0 * left + 3, torch::kBFloat16)));
}

TEST(MpiP2P, MessagesWithOneTagArriveInOrder) {
  NEED_PEERS(2);
  auto& comm = world();
  const int w = comm.size(), me = comm.rank();
  std::vector<Work> sends;
  std::vector<torch::Tensor> outgoing;
  for (int k = 0; k < 5; ++k) {
    outgoing.push_back(torch::full({3}, me * 10 + k, torch::kInt64));
    sends.push_back(comm.send(outgoing.back(), (me + 1) % w, {0}));
  }
  for (int k = 0; k < 5; ++k) {
    auto t = torch::empty({3}, torch::kInt64);
    comm.recv(t, (me + w - 1) % w, {0}).wait();
    EXPECT_EQ(t[0].item<int64_t>(), ((me + w - 1) % w) * 10 + k);
  }
  wait_all(sends);
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
    } catch (const PeerError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("recv"), std::string::npos) << m;
      EXPECT_NE(m.find("peer 0"), std::string::npos) << m;
    }
  }
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
    EXPECT_THROW(pair->barrier(), PeerError);  // the group refuses after a timeout
  }
  world().barrier().wait();  // rank 0 has timed out: now send
  if (pair && pair->rank() == 1) pair->send(torch::ones({2}), 0, {9}).wait();
  world().barrier().wait();
}

TEST(MpiGroups, NewGroupOfOddRanksReducesAmongItself) {
  NEED_PEERS(2);
  auto comm = world_ptr();
  std::vector<int> odd;
  for (int r = comm->size() - 1; r >= 1; --r) {
    if (r % 2 == 1) odd.push_back(r);  // descending: ranked in this order
  }
  auto group = comm->new_group(odd);
  if (comm->rank() % 2 == 0) {
    EXPECT_EQ(group, nullptr);
  } else {
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(group->size(), static_cast<int>(odd.size()));
    EXPECT_EQ(group->backend(), "mpi");
    // Ranked in the order given.
    EXPECT_EQ(odd[group->rank()], comm->rank());
    auto t = torch::full({4}, static_cast<float>(comm->rank()));
    group->all_reduce(t).wait();
    float sum = 0;
    for (int r : odd) sum += r;
    EXPECT_TRUE(torch::equal(t, torch::full({4}, sum)));
  }
  auto t = torch::ones({1});
  comm->all_reduce(t).wait();  // the parent keeps working
  EXPECT_EQ(t.item<float>(), static_cast<float>(comm->size()));
}

TEST(MpiGroups, SplitByParityRanksByKeyAndNests) {
  auto comm = world_ptr();
  const int me = comm->rank(), w = comm->size();
  auto sub = comm->split(me % 2, -me);  // keys reverse the order
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int r = w - 1; r >= 0; --r) {
    if (r % 2 == me % 2) members.push_back(r);
  }
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(members[sub->rank()], me);
  auto t = torch::full({3}, static_cast<double>(me), torch::kFloat64);
  sub->all_reduce(t).wait();
  double sum = 0;
  for (int r : members) sum += r;
  EXPECT_EQ(t[0].item<double>(), sum);
  auto solo = sub->split(sub->rank(), 0);  // groups of one inside the subgroup
  ASSERT_NE(solo, nullptr);
  EXPECT_EQ(solo->size(), 1);
  auto u = torch::full({2}, 3.0f);
  solo->all_reduce(u).wait();
  EXPECT_EQ(u[0].item<float>(), 3.0f);
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
      comm->broadcast(t, {0});
    } else {
      comm->all_reduce(t);
    }
    FAIL() << "different collectives passed the debug check";
  } catch (const MismatchError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 0 called broadcast"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace cohort::testing
