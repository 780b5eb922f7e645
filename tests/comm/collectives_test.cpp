// The Communicator contract: every collective, parameterized over world size
// (1, 2, 3, 4) x dtype, looping over element counts (0, 1, odd, ~1M) and
// reduce ops inside, with ranks as threads. Expected values are formulas.
#include <gtest/gtest.h>

#include "support/thread_ranks.h"
#include "tests/comm/contract_values.h"

namespace cohort::testing {
namespace {

#define expect_close(got, expected, what) ASSERT_TRUE(matches(got, expected)) << (what)

struct Param {
  int world;
  torch::Dtype dtype;
};

class Collectives : public ::testing::TestWithParam<Param> {
 protected:
  int world() const { return GetParam().world; }
  torch::Dtype dtype() const { return GetParam().dtype; }
};

TEST_P(Collectives, AllReduceEveryOpAndCount) {
  run_ranks(world(), [&](Communicator& comm) {
    for (auto op : ops_for(dtype())) {
      // ~1M elements for sum and avg (the bandwidth path); min/max/prod
      // share the code and take the small counts.
      for (auto n : kCounts) {
        if (n > 100000 && op != ReduceOp::Sum && op != ReduceOp::Avg) n = 100003;
        auto t = input_for(op, comm.rank(), n, dtype());
        comm.all_reduce(t, {op}).wait();
        expect_close(t, expected_reduction(op, world(), n),
                     "op " + to_string(op) + " n " + std::to_string(n));
      }
    }
  });
}

TEST_P(Collectives, AllReduceCoalescedMixedSizes) {
  run_ranks(world(), [&](Communicator& comm) {
    std::vector<torch::Tensor> ts;
    for (auto n : {int64_t{3}, int64_t{0}, int64_t{1001}}) ts.push_back(rank_input(comm.rank(), n, dtype()));
    ts.push_back(rank_input(comm.rank(), 5, torch::kFloat64));  // a second dtype in the same call
    comm.all_reduce_coalesced(ts, {ReduceOp::Max}).wait();
    expect_close(ts[0], expected_reduction(ReduceOp::Max, world(), 3), "t0");
    EXPECT_EQ(ts[1].numel(), 0);
    expect_close(ts[2], expected_reduction(ReduceOp::Max, world(), 1001), "t2");
    expect_close(ts[3], expected_reduction(ReduceOp::Max, world(), 5), "t3");
  });
}

TEST_P(Collectives, BroadcastFromLastRank) {
  run_ranks(world(), [&](Communicator& comm) {
    const int root = comm.size() - 1;
    for (auto n : kCounts) {
      auto t = rank_input(comm.rank(), n, dtype());
      comm.broadcast(t, {root}).wait();
      ASSERT_TRUE(torch::equal(t, rank_input(root, n, dtype()))) << "n " << n;
    }
  });
}

TEST_P(Collectives, BroadcastCoalescedMixedDtypes) {
  run_ranks(world(), [&](Communicator& comm) {
    std::vector<torch::Tensor> ts{rank_input(comm.rank(), 9, dtype()),
                                  rank_input(comm.rank(), 2, torch::kInt64),
                                  rank_input(comm.rank(), 0, dtype())};
    comm.broadcast_coalesced(ts, {0}).wait();
    EXPECT_TRUE(torch::equal(ts[0], rank_input(0, 9, dtype())));
    EXPECT_TRUE(torch::equal(ts[1], rank_input(0, 2, torch::kInt64)));
  });
}

TEST_P(Collectives, ReduceToMiddleRank) {
  run_ranks(world(), [&](Communicator& comm) {
    const int root = comm.size() / 2;
    for (auto op : {ReduceOp::Sum, ReduceOp::Max}) {
      for (auto n : kCounts) {
        auto t = rank_input(comm.rank(), n, dtype());
        comm.reduce(t, {root, op}).wait();
        if (comm.rank() == root) {
          expect_close(t, expected_reduction(op, world(), n), "n " + std::to_string(n));
        }
      }
    }
  });
}

TEST_P(Collectives, AllGatherBothForms) {
  run_ranks(world(), [&](Communicator& comm) {
    for (auto n : kCounts) {
      auto in = rank_input(comm.rank(), n, dtype());
      std::vector<torch::Tensor> outs;
      for (int r = 0; r < comm.size(); ++r) outs.push_back(torch::full({n}, 99, dtype()));
      comm.all_gather(outs, in).wait();
      auto flat = torch::empty({n * comm.size()}, dtype());
      comm.all_gather_into_tensor(flat, in).wait();
      for (int r = 0; r < comm.size(); ++r) {
        ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dtype()))) << "n " << n << " r " << r;
        ASSERT_TRUE(torch::equal(flat.narrow(0, r * n, n), rank_input(r, n, dtype())));
      }
    }
  });
}

TEST_P(Collectives, ReduceScatterBothForms) {
  run_ranks(world(), [&](Communicator& comm) {
    const int w = comm.size();
    for (auto n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100003}}) {
      // Chunk j of rank r is rank_input(r, ...) shifted by j, so every
      // destination gets a different expected result.
      std::vector<torch::Tensor> inputs;
      for (int j = 0; j < w; ++j) inputs.push_back(rank_input(comm.rank(), n, dtype()) + j);
      auto out = torch::empty({n}, dtype());
      comm.reduce_scatter(out, inputs).wait();
      auto expected = expected_reduction(ReduceOp::Sum, w, n) + w * comm.rank();
      expect_close(out, expected, "list n " + std::to_string(n));

      auto out2 = torch::empty({n}, dtype());
      auto flat = torch::cat(inputs);
      comm.reduce_scatter_tensor(out2, flat).wait();
      expect_close(out2, expected, "tensor n " + std::to_string(n));
    }
  });
}

TEST_P(Collectives, GatherAndScatterAtLastRank) {
  run_ranks(world(), [&](Communicator& comm) {
    const int root = comm.size() - 1;
    for (auto n : kCounts) {
      auto in = rank_input(comm.rank(), n, dtype());
      std::vector<torch::Tensor> outs;
      if (comm.rank() == root) {
        for (int r = 0; r < comm.size(); ++r) outs.push_back(torch::zeros({n}, dtype()));
      }
      comm.gather(outs, in, {root}).wait();
      for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
        ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dtype())));
      }

      std::vector<torch::Tensor> pieces;
      if (comm.rank() == root) {
        for (int r = 0; r < comm.size(); ++r) pieces.push_back(rank_input(r + 1, n, dtype()));
      }
      auto out = torch::zeros({n}, dtype());
      comm.scatter(out, pieces, {root}).wait();
      ASSERT_TRUE(torch::equal(out, rank_input(comm.rank() + 1, n, dtype())));
    }
  });
}

TEST_P(Collectives, AllToAllEqualAndUneven) {
  run_ranks(world(), [&](Communicator& comm) {
    const int w = comm.size(), me = comm.rank();
    // Equal splits: row block j of rank r holds 10*r + j.
    auto in = torch::arange(w, torch::kInt64).repeat_interleave(3).add(10 * me).to(dtype());
    auto out = torch::empty({3 * w}, dtype());
    comm.all_to_all_single(out, in).wait();
    auto expected = (torch::arange(w, torch::kInt64) * 10 + me).repeat_interleave(3).to(dtype());
    EXPECT_TRUE(torch::equal(out, expected));

    // Uneven: rank r sends j+1 rows of width 2 to rank j, filled with r.
    std::vector<int64_t> in_splits, out_splits;
    for (int j = 0; j < w; ++j) in_splits.push_back(j + 1);
    for (int r = 0; r < w; ++r) out_splits.push_back(me + 1);
    auto uin = torch::full({w * (w + 1) / 2, 2}, me, dtype());
    auto uout = torch::empty({w * (me + 1), 2}, dtype());
    comm.all_to_all_single(uout, uin, out_splits, in_splits).wait();
    auto uexp = torch::arange(w, torch::kInt64).repeat_interleave(me + 1).unsqueeze(1).expand({-1, 2});
    EXPECT_TRUE(torch::equal(uout, uexp.to(dtype())));

    // List form.
    std::vector<torch::Tensor> ins, outs;
    for (int j = 0; j < w; ++j) {
      ins.push_back(torch::full({j + 1}, me * 10 + j, dtype()));
      outs.push_back(torch::empty({me + 1}, dtype()));
    }
    comm.all_to_all(outs, ins).wait();
    for (int r = 0; r < w; ++r) EXPECT_TRUE(torch::equal(outs[r], torch::full({me + 1}, r * 10 + me, dtype())));
  });
}

TEST(CollectivesIntegers, AvgIsRefused) {
  run_ranks(2, [&](Communicator& comm) {
    for (auto dt : {torch::kInt32, torch::kInt64, torch::kUInt8}) {
      auto t = rank_input(comm.rank(), 4, dt);
      EXPECT_THROW(comm.all_reduce(t, {ReduceOp::Avg}), InvalidArgument);
    }
  });
}

std::vector<Param> all_params() {
  std::vector<Param> ps;
  for (int w : {1, 2, 3, 4}) {
    for (auto dt : kDtypes) ps.push_back({w, dt});
  }
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Gloo, Collectives, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return "world" + std::to_string(info.param.world) + "_" +
                                  dtype_label(info.param.dtype);
                         });

}  // namespace
}  // namespace cohort::testing
