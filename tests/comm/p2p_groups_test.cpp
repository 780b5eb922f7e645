// Tagged point-to-point and subgroups, ranks as threads.
#include <gtest/gtest.h>

#include "support/thread_ranks.h"

namespace cohort::testing {
namespace {

class P2P : public ::testing::TestWithParam<int> {};

// Each rank sends two messages to its right neighbour, tags 7 then 3, and
// receives them from its left neighbour in the opposite tag order: tags, not
// arrival order, must decide which buffer gets which message.
TEST_P(P2P, TagsKeepMessagesApart) {
  run_ranks(GetParam(), [](Communicator& comm) {
    const int w = comm.size(), me = comm.rank();
    const int right = (me + 1) % w, left = (me + w - 1) % w;
    auto a = torch::full({1000}, 100.0 * me + 7);
    auto b = torch::full({10}, 100.0 * me + 3, torch::kBFloat16);
    auto sa = comm.send(a, right, {7});
    auto sb = comm.send(b, right, {3});
    auto rb = torch::zeros({10}, torch::kBFloat16);
    auto ra = torch::zeros({1000});
    comm.recv(rb, left, {3}).wait();
    comm.recv(ra, left, {7}).wait();
    sa.wait();
    sb.wait();
    EXPECT_TRUE(torch::equal(ra, torch::full({1000}, 100.0 * left + 7)));
    EXPECT_TRUE(torch::equal(rb, torch::full({10}, 100.0 * left + 3, torch::kBFloat16)));
  });
}

TEST_P(P2P, MessagesWithOneTagArriveInOrder) {
  run_ranks(GetParam(), [](Communicator& comm) {
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
  });
}

INSTANTIATE_TEST_SUITE_P(Gloo, P2P, ::testing::Values(2, 3, 4));

TEST(P2PErrors, SelfAndOutOfRangePeersAreRefused) {
  run_ranks(2, [](Communicator& comm) {
    auto t = torch::zeros({2});
    EXPECT_THROW(comm.send(t, comm.rank()), InvalidArgument);
    EXPECT_THROW(comm.recv(t, 5), InvalidArgument);
    EXPECT_THROW(comm.send(t, 1 - comm.rank(), {-1}), InvalidArgument);
  });
}

TEST(Groups, NewGroupOfOddRanksReducesAmongItself) {
  run_ranks_shared(5, [](std::shared_ptr<Communicator> comm) {
    auto odd = comm->new_group({3, 1});
    if (comm->rank() % 2 == 0) {
      EXPECT_EQ(odd, nullptr);
    } else {
      ASSERT_NE(odd, nullptr);
      EXPECT_EQ(odd->size(), 2);
      EXPECT_EQ(odd->rank(), comm->rank() == 3 ? 0 : 1);  // ranked in the order given
      auto t = torch::full({4}, static_cast<float>(comm->rank()));
      odd->all_reduce(t).wait();
      EXPECT_TRUE(torch::equal(t, torch::full({4}, 4.0f)));
    }
    // The parent keeps working after a subgroup was made.
    auto t = torch::ones({1});
    comm->all_reduce(t).wait();
    EXPECT_EQ(t.item<float>(), 5.0f);
  });
}

TEST(Groups, SplitByColorRanksByKey) {
  run_ranks_shared(5, [](std::shared_ptr<Communicator> comm) {
    const int me = comm->rank();
    // Colors 0 and 1 by parity; rank 4 opts out; keys reverse the order.
    const int color = me == 4 ? -1 : me % 2;
    auto sub = comm->split(color, -me);
    if (me == 4) {
      EXPECT_EQ(sub, nullptr);
      return;
    }
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), 2);
    EXPECT_EQ(sub->rank(), me >= 2 ? 0 : 1);
    auto t = torch::full({3}, static_cast<double>(me), torch::kFloat64);
    sub->all_reduce(t).wait();
    EXPECT_EQ(t[0].item<double>(), me % 2 == 0 ? 2.0 : 4.0);
    // Nested: a group of one inside the subgroup.
    auto solo = sub->split(sub->rank(), 0);
    ASSERT_NE(solo, nullptr);
    EXPECT_EQ(solo->size(), 1);
    auto u = torch::full({2}, 3.0f);
    solo->all_reduce(u).wait();
    EXPECT_EQ(u[0].item<float>(), 3.0f);
  });
}

TEST(Groups, BadRanksAreRefused) {
  run_ranks_shared(2, [](std::shared_ptr<Communicator> comm) {
    EXPECT_THROW(comm->new_group({0, 0}), InvalidArgument);
    EXPECT_THROW(comm->new_group({0, 2}), InvalidArgument);
    EXPECT_THROW(comm->new_group({}), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::testing
