// Communicator::stats(): byte counts against closed forms for every
// collective, engine-run (the model in comm_stats.h) and algorithm-run
// (cohort's point-to-point, counted exactly), over world 1..4 and element
// counts 0, 1 and a multiple of every world size.
#include <gtest/gtest.h>

#include "cohort/observability/counting_engine.h"
#include "support/thread_ranks.h"

namespace cohort::testing::comm_stats_test {
namespace {

constexpr int64_t kCounts[] = {0, 1, 1200};  // 1200: divisible by 1..4

struct Param {
  int world;
};

class CommStatsTest : public ::testing::TestWithParam<Param> {
 protected:
  int world() const { return GetParam().world; }
};

uint64_t f32_bytes(int64_t n) { return static_cast<uint64_t>(n) * 4; }

// Every rank's (sent, received) of one kind, gathered to compare sums.
std::pair<uint64_t, uint64_t> totals_over_ranks(Communicator& comm, const OpStats& mine) {
  auto t = torch::tensor(
      {static_cast<int64_t>(mine.bytes_sent), static_cast<int64_t>(mine.bytes_received)});
  std::vector<torch::Tensor> all(static_cast<size_t>(comm.size()));
  for (auto& a : all) a = torch::empty({2}, torch::kLong);
  comm.all_gather(all, t).wait();
  uint64_t s = 0, r = 0;
  for (auto& a : all) {
    s += static_cast<uint64_t>(a[0].item<int64_t>());
    r += static_cast<uint64_t>(a[1].item<int64_t>());
  }
  return {s, r};
}

TEST_P(CommStatsTest, EngineAllReduceIsTheRingClosedForm) {
  run_ranks(world(), [&](Communicator& comm) {
    for (auto n : kCounts) {
      comm.reset_stats();
      auto t = torch::ones({n});
      comm.all_reduce(t, {ReduceOp::Sum, kDefaultTimeout, Algorithm::Engine}).wait();
      auto s = comm.stats()[OpKind::AllReduce];
      const int p = comm.size();
      const uint64_t expect = n == 0 || p == 1 ? 0 : 2 * (p - 1) * f32_bytes(n) / p;
      EXPECT_EQ(s.calls, 1u);
      EXPECT_EQ(s.completed, 1u);
      EXPECT_EQ(s.bytes_sent, expect) << "n " << n;
      EXPECT_EQ(s.bytes_received, expect) << "n " << n;
      EXPECT_GE(s.seconds_in_flight, s.seconds_waiting);
      EXPECT_EQ(comm.stats().total().calls, 1u);
    }
  });
}

// cohort's algorithms are counted at their sends and receives: ring and
// (at powers of two) halving-doubling move 2(p-1)n/p per rank when n
// divides; any algorithm's bytes sent over all ranks equal those received,
// and the ring's total is 2(p-1)n whatever the split.
TEST_P(CommStatsTest, AlgorithmAllReduceCountsPointToPointExactly) {
  for (auto algo : {Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::Tree}) {
    run_ranks(world(), [&](Communicator& comm) {
      const int p = comm.size();
      for (auto n : kCounts) {
        comm.reset_stats();
        auto t = torch::ones({n});
        comm.all_reduce(t, {ReduceOp::Sum, kDefaultTimeout, algo}).wait();
        auto s = comm.stats()[OpKind::AllReduce];
        ASSERT_TRUE(torch::allclose(t, torch::full({n}, static_cast<float>(p))));
        const uint64_t b = f32_bytes(n);
        const bool closed = algo == Algorithm::Ring || (p & (p - 1)) == 0;
        if (n % p == 0 && closed && algo != Algorithm::Tree) {
          EXPECT_EQ(s.bytes_sent, 2 * (p - 1) * b / p) << to_string(algo) << " n " << n;
          EXPECT_EQ(s.bytes_received, 2 * (p - 1) * b / p) << to_string(algo) << " n " << n;
        }
        auto [sent, received] = totals_over_ranks(comm, s);
        EXPECT_EQ(sent, received) << to_string(algo);
        if (algo == Algorithm::Ring) {
          EXPECT_EQ(sent, p == 1 ? 0 : 2 * (p - 1) * b) << "n " << n;
        }
        if (p > 1 && n > 0) {
          EXPECT_GT(sent, 0u) << to_string(algo);
        }
      }
    });
  }
}

TEST_P(CommStatsTest, ReduceScatterAndAllGatherMoveEveryOtherBlock) {
  for (auto algo : {Algorithm::Engine, Algorithm::Ring}) {
    run_ranks(world(), [&](Communicator& comm) {
      const int p = comm.size();
      for (auto n : kCounts) {  // n elements per rank
        comm.reset_stats();
        auto out = torch::empty({n});
        comm.reduce_scatter_tensor(out, torch::ones({n * p}),
                                   {ReduceOp::Sum, kDefaultTimeout, algo})
            .wait();
        auto gathered = torch::empty({n * p});
        comm.all_gather_into_tensor(gathered, torch::ones({n}), {kDefaultTimeout, algo}).wait();
        const uint64_t each = n == 0 ? 0 : (p - 1) * f32_bytes(n);
        auto rs = comm.stats()[OpKind::ReduceScatterTensor];
        auto ag = comm.stats()[OpKind::AllGatherIntoTensor];
        EXPECT_EQ(rs.bytes_sent, each) << to_string(algo) << " n " << n;
        EXPECT_EQ(rs.bytes_received, each) << to_string(algo) << " n " << n;
        EXPECT_EQ(ag.bytes_sent, each) << to_string(algo) << " n " << n;
        EXPECT_EQ(ag.bytes_received, each) << to_string(algo) << " n " << n;
      }
    });
  }
}

TEST_P(CommStatsTest, RootedCollectivesFollowTheirClosedForms) {
  run_ranks(world(), [&](Communicator& comm) {
    const int p = comm.size(), r = comm.rank(), root = p - 1;
    for (auto n : kCounts) {
      comm.reset_stats();
      const uint64_t b = f32_bytes(n);
      auto t = torch::ones({n});
      comm.broadcast(t, {root}).wait();
      comm.reduce(t, {root}).wait();
      std::vector<torch::Tensor> outs;
      if (r == root) {
        for (int i = 0; i < p; ++i) outs.push_back(torch::empty({n}));
      }
      comm.gather(outs, t, {root}).wait();
      comm.scatter(t, outs, {root}).wait();
      auto out = torch::empty({n * p});
      comm.all_to_all_single(out, torch::ones({n * p})).wait();
      auto st = comm.stats();
      // Binomial tree: over all ranks, p-1 copies of n move.
      auto bc = totals_over_ranks(comm, st[OpKind::Broadcast]);
      EXPECT_EQ(bc.first, n == 0 ? 0 : (p - 1) * b);
      EXPECT_EQ(bc.second, n == 0 ? 0 : (p - 1) * b);
      EXPECT_EQ(st[OpKind::Broadcast].bytes_received, r == root || n == 0 ? 0 : b);
      EXPECT_EQ(st[OpKind::Reduce].bytes_sent, r == root || n == 0 ? 0 : b);
      auto g = st[OpKind::Gather], s = st[OpKind::Scatter];
      EXPECT_EQ(g.bytes_sent, r == root || n == 0 ? 0 : b);
      EXPECT_EQ(g.bytes_received, r == root && n > 0 ? (p - 1) * b : 0);
      EXPECT_EQ(s.bytes_sent, r == root && n > 0 ? (p - 1) * b : 0);
      EXPECT_EQ(s.bytes_received, r == root || n == 0 ? 0 : b);
      auto a = st[OpKind::AllToAllSingle];
      EXPECT_EQ(a.bytes_sent, (p - 1) * b);
      EXPECT_EQ(a.bytes_received, (p - 1) * b);
      EXPECT_EQ(st[OpKind::Broadcast].calls, 1u);
    }
  });
}

TEST_P(CommStatsTest, SendRecvAndSubgroupsCountSeparately) {
  run_ranks_shared(world(), [&](std::shared_ptr<Communicator> comm) {
    const int p = comm->size(), r = comm->rank();
    // Ranks 0 and 1 (when there are two) form a group that sends 7 floats.
    auto group = comm->new_group(p >= 2 ? std::vector<int>{0, 1} : std::vector<int>{0});
    comm->reset_stats();
    if (group && group->size() == 2) {
      group->reset_stats();
      auto t = torch::ones({7});
      if (group->rank() == 0) {
        group->send(t, 1).wait();
      } else {
        group->recv(t, 0).wait();
      }
      auto gs = group->stats();
      EXPECT_EQ(gs[OpKind::Send].bytes_sent, group->rank() == 0 ? 28u : 0u);
      EXPECT_EQ(gs[OpKind::Recv].bytes_received, group->rank() == 1 ? 28u : 0u);
      EXPECT_EQ(gs.total().calls, 1u);
    }
    EXPECT_EQ(comm->stats().total().bytes_sent, 0u) << "rank " << r;
    EXPECT_EQ(comm->stats().total().calls, 0u) << "rank " << r;
  });
}

// A snapshot taken before reset_stats(): since() counts from the reset, the
// only part still known, never a difference that wraps below zero.
TEST_P(CommStatsTest, SinceASnapshotBeforeAResetCountsFromTheReset) {
  run_ranks(world(), [&](Communicator& comm) {
    auto t = torch::ones({1200});
    auto all_reduces = [&](int k) {
      for (int i = 0; i < k; ++i) comm.all_reduce(t, {ReduceOp::Sum}).wait();
    };
    all_reduces(2);
    const CommStats earlier = comm.stats();
    comm.reset_stats();
    all_reduces(1);
    auto d = comm.stats().since(earlier)[OpKind::AllReduce];
    EXPECT_EQ(d.calls, 1u);
    EXPECT_EQ(d.bytes_sent, comm.stats()[OpKind::AllReduce].bytes_sent);
    EXPECT_GE(d.seconds_in_flight, 0.0);
    all_reduces(4);
    d = comm.stats().since(earlier)[OpKind::AllReduce];
    EXPECT_EQ(d.calls, 5u);
    EXPECT_EQ(d.completed, 5u);
    // A snapshot after the reset subtracts as before.
    const CommStats later = comm.stats();
    all_reduces(1);
    EXPECT_EQ(comm.stats().since(later)[OpKind::AllReduce].calls, 1u);
  });
}

TEST(CommStatsModel, BinomialTreeMovesEachByteOncePerNonRoot) {
  for (int p = 1; p <= 9; ++p) {
    for (int root = 0; root < p; ++root) {
      uint64_t sent = 0, received = 0;
      for (int r = 0; r < p; ++r) {
        auto b = wire_model::broadcast(10, r, p, root);
        sent += b.sent;
        received += b.received;
      }
      EXPECT_EQ(sent, 10u * (p - 1));
      EXPECT_EQ(received, 10u * (p - 1));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(World, CommStatsTest,
                         ::testing::Values(Param{1}, Param{2}, Param{3}, Param{4}),
                         [](const auto& info) { return "w" + std::to_string(info.param.world); });

}  // namespace
}  // namespace cohort::testing::comm_stats_test
