// The Communicator contract on the MPI engine: every collective per dtype,
// over element counts (0, 1, odd, ~1M) and reduce ops, in whatever world
// mpirun started (ctest runs 1, 2, 3 and 4 ranks). Expected values are the
// closed formulas of tests/comm/contract_values.h.
#include <gtest/gtest.h>

#include <cstdlib>

#include "cohort/cohort.h"
#include "tests/comm/contract_values.h"

namespace cohort::testing {
namespace {

#define expect_close(got, expected, what) ASSERT_TRUE(matches(got, expected)) << (what)

class MpiCollectives : public ::testing::TestWithParam<torch::Dtype> {
 protected:
  Communicator& comm() { return world(); }
  int w() { return world().size(); }
  torch::Dtype dtype() const { return GetParam(); }
};

TEST(MpiInit, InitChoseMpiWithMpirunsRanks) {
  EXPECT_EQ(world().backend(), "mpi");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  ASSERT_NE(size, nullptr);
  ASSERT_NE(rank, nullptr);
  EXPECT_EQ(world().size(), std::atoi(size));
  EXPECT_EQ(world().rank(), std::atoi(rank));
}

TEST_P(MpiCollectives, AllReduceEveryOpAndCount) {
  for (auto op : ops_for(dtype())) {
    for (auto n : kCounts) {
      auto t = input_for(op, comm().rank(), n, dtype());
      comm().all_reduce(t, {op}).wait();
      expect_close(t, expected_reduction(op, w(), n),
                   "op " + to_string(op) + " n " + std::to_string(n));
    }
  }
}

TEST_P(MpiCollectives, AllReduceCoalescedMixedSizes) {
  std::vector<torch::Tensor> ts;
  for (auto n : {int64_t{3}, int64_t{0}, int64_t{1001}})
    ts.push_back(rank_input(comm().rank(), n, dtype()));
  ts.push_back(rank_input(comm().rank(), 5, torch::kFloat64));
  comm().all_reduce_coalesced(ts, {ReduceOp::Max}).wait();
  expect_close(ts[0], expected_reduction(ReduceOp::Max, w(), 3), "t0");
  expect_close(ts[2], expected_reduction(ReduceOp::Max, w(), 1001), "t2");
  expect_close(ts[3], expected_reduction(ReduceOp::Max, w(), 5), "t3");
}

TEST_P(MpiCollectives, BroadcastFromLastRank) {
  const int root = w() - 1;
  for (auto n : kCounts) {
    auto t = rank_input(comm().rank(), n, dtype());
    comm().broadcast(t, {root}).wait();
    ASSERT_TRUE(torch::equal(t, rank_input(root, n, dtype()))) << "n " << n;
  }
  std::vector<torch::Tensor> ts{rank_input(comm().rank(), 9, dtype()),
                                rank_input(comm().rank(), 2, torch::kInt64)};
  comm().broadcast_coalesced(ts, {0}).wait();
  EXPECT_TRUE(torch::equal(ts[0], rank_input(0, 9, dtype())));
  EXPECT_TRUE(torch::equal(ts[1], rank_input(0, 2, torch::kInt64)));
}

TEST_P(MpiCollectives, ReduceToMiddleRank) {
  const int root = w() / 2;
  for (auto op : {ReduceOp::Sum, ReduceOp::Max}) {
    for (auto n : kCounts) {
      auto t = rank_input(comm().rank(), n, dtype());
      comm().reduce(t, {root, op}).wait();
      if (comm().rank() == root) {
        expect_close(t, expected_reduction(op, w(), n), "n " + std::to_string(n));
      }
    }
  }
}

TEST_P(MpiCollectives, AllGatherBothForms) {
  for (auto n : kCounts) {
    auto in = rank_input(comm().rank(), n, dtype());
    std::vector<torch::Tensor> outs;
    for (int r = 0; r < w(); ++r) outs.push_back(torch::full({n}, 99, dtype()));
    comm().all_gather(outs, in).wait();
    auto flat = torch::empty({n * w()}, dtype());
    comm().all_gather_into_tensor(flat, in).wait();
    for (int r = 0; r < w(); ++r) {
      ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dtype()))) << "n " << n << " r " << r;
      ASSERT_TRUE(torch::equal(flat.narrow(0, r * n, n), rank_input(r, n, dtype())));
    }
  }
}

TEST_P(MpiCollectives, ReduceScatterBothForms) {
  for (auto n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100003}}) {
    // Chunk j of rank r is shifted by j: every destination expects another result.
    std::vector<torch::Tensor> inputs;
    for (int j = 0; j < w(); ++j) inputs.push_back(rank_input(comm().rank(), n, dtype()) + j);
    auto out = torch::empty({n}, dtype());
    comm().reduce_scatter(out, inputs).wait();
    auto expected = expected_reduction(ReduceOp::Sum, w(), n) + w() * comm().rank();
    expect_close(out, expected, "list n " + std::to_string(n));
    auto out2 = torch::empty({n}, dtype());
    comm().reduce_scatter_tensor(out2, torch::cat(inputs)).wait();
    expect_close(out2, expected, "tensor n " + std::to_string(n));
  }
}

TEST_P(MpiCollectives, GatherAndScatterAtLastRank) {
  const int root = w() - 1;
  for (auto n : kCounts) {
    auto in = rank_input(comm().rank(), n, dtype());
    std::vector<torch::Tensor> outs;
    if (comm().rank() == root) {
      for (int r = 0; r < w(); ++r) outs.push_back(torch::zeros({n}, dtype()));
    }
    comm().gather(outs, in, {root}).wait();
    for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
      ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dtype()))) << "n " << n;
    }
    std::vector<torch::Tensor> pieces;
    if (comm().rank() == root) {
      for (int r = 0; r < w(); ++r) pieces.push_back(rank_input(r + 1, n, dtype()));
    }
    auto out = torch::zeros({n}, dtype());
    comm().scatter(out, pieces, {root}).wait();
    ASSERT_TRUE(torch::equal(out, rank_input(comm().rank() + 1, n, dtype()))) << "n " << n;
  }
}

TEST_P(MpiCollectives, AllToAllEqualAndUneven) {
  const int me = comm().rank();
  auto in = torch::arange(w(), torch::kInt64).repeat_interleave(3).add(10 * me).to(dtype());
  auto out = torch::empty({3 * w()}, dtype());
  comm().all_to_all_single(out, in).wait();
  auto expected = (torch::arange(w(), torch::kInt64) * 10 + me).repeat_interleave(3).to(dtype());
  EXPECT_TRUE(torch::equal(out, expected));

  // Uneven: rank r sends j+1 rows of width 2 to rank j, filled with r.
  std::vector<int64_t> in_splits, out_splits;
  for (int j = 0; j < w(); ++j) in_splits.push_back(j + 1);
  for (int r = 0; r < w(); ++r) out_splits.push_back(me + 1);
  auto uin = torch::full({w() * (w() + 1) / 2, 2}, me, dtype());
  auto uout = torch::empty({w() * (me + 1), 2}, dtype());
  comm().all_to_all_single(uout, uin, out_splits, in_splits).wait();
  auto uexp =
      torch::arange(w(), torch::kInt64).repeat_interleave(me + 1).unsqueeze(1).expand({-1, 2});
  EXPECT_TRUE(torch::equal(uout, uexp.to(dtype())));

  std::vector<torch::Tensor> ins, outs;
  for (int j = 0; j < w(); ++j) {
    ins.push_back(torch::full({j + 1}, me * 10 + j, dtype()));
    outs.push_back(torch::empty({me + 1}, dtype()));
  }
  comm().all_to_all(outs, ins).wait();
  for (int r = 0; r < w(); ++r)
    EXPECT_TRUE(torch::equal(outs[r], torch::full({me + 1}, r * 10 + me, dtype())));
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiCollectives, ::testing::ValuesIn(kDtypes),
                         [](const ::testing::TestParamInfo<torch::Dtype>& info) {
                           return dtype_label(info.param);
                         });

// Several collectives in flight at once, waited in reverse: non-blocking
// MPI calls must each finish with their own result.
TEST(MpiAsync, ManyOperationsInFlightWaitedInReverse) {
  auto& comm = world();
  std::vector<torch::Tensor> ts;
  std::vector<Work> works;
  for (int k = 0; k < 8; ++k) {
    ts.push_back(torch::full({1000 + k}, static_cast<float>(comm.rank() + k)));
    works.push_back(comm.all_reduce(ts.back()));
  }
  for (int k = 7; k >= 0; --k) works[k].wait();
  const int w = comm.size();
  for (int k = 0; k < 8; ++k) {
    EXPECT_TRUE(
        torch::equal(ts[k], torch::full({1000 + k}, static_cast<float>(w * (w - 1) / 2 + w * k))));
  }
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

}  // namespace
}  // namespace cohort::testing
