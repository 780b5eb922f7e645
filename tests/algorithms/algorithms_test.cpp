// The contract suite's all_reduce, reduce_scatter and all_gather cases run
// against every algorithm: world 1..5 as threads (powers of two and not) x
// dtype x element counts (0, 1, 7, non-divisible, ~1M), expected values from
// the formulas in tests/comm/contract_values.h.
#include <gtest/gtest.h>

#include "support/thread_ranks.h"
#include "tests/comm/contract_values.h"

namespace cohort::testing {
namespace {

struct Param {
  Algorithm algo;
  int world;
};

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  return to_string(info.param.algo) + "_world" + std::to_string(info.param.world);
}

class AlgorithmContract : public ::testing::TestWithParam<Param> {
 protected:
  Algorithm algo() const { return GetParam().algo; }
  int world() const { return GetParam().world; }
  ThreadRanksOptions options() const {
    ThreadRanksOptions o;
    o.algorithm = algo();
    // Hierarchical gets two fake hosts (ranks 0,1 | 2,3 | 4) to exercise
    // the node reduce, the leaders' ring and the node broadcast.
    if (algo() == Algorithm::Hierarchical) o.node_of = [](int r) { return "host" + std::to_string(r / 2); };
    return o;
  }
};

// Counts: empty, one, odd, fewer than some worlds, non-divisible, ~1M
// (more than one pipeline segment per block).
const std::vector<int64_t> kAllReduceCounts = {0, 1, 3, 7, 1001, (1 << 20) + 3};

TEST_P(AlgorithmContract, AllReduceEveryDtypeOpAndCount) {
  run_ranks(world(), [&](Communicator& comm) {
    for (auto dt : kDtypes) {
      for (auto op : ops_for(dt)) {
        for (auto n : kAllReduceCounts) {
          // The large count for sum on f32 and bf16 (the bandwidth path and
          // the f32 accumulation); the rest share the code.
          if (n > 100000 && !(op == ReduceOp::Sum && (dt == torch::kFloat32 || dt == torch::kBFloat16))) continue;
          auto t = input_for(op, comm.rank(), n, dt);
          comm.all_reduce(t, {op}).wait();
          ASSERT_EQ(t.scalar_type(), dt);
          ASSERT_TRUE(matches(t, expected_reduction(op, world(), n)))
              << dtype_label(dt) << " op " << to_string(op) << " n " << n;
        }
      }
    }
  }, options());
}

TEST_P(AlgorithmContract, ReduceScatterBothForms) {
  run_ranks(world(), [&](Communicator& comm) {
    const int w = comm.size();
    for (auto dt : kDtypes) {
      for (auto op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg}) {
        if (op == ReduceOp::Avg && !torch::isFloatingType(dt)) continue;
        for (auto n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100003}}) {
          if (n > 1000 && dt != torch::kFloat32) continue;
          std::vector<torch::Tensor> inputs;
          for (int j = 0; j < w; ++j) inputs.push_back(rank_input(comm.rank(), n, dt) + j);
          auto out = torch::empty({n}, dt);
          ReduceScatterOptions o;
          o.op = op;
          comm.reduce_scatter(out, inputs, o).wait();
          // Chunk j of rank r is rank_input(r) + j.
          auto expected = expected_reduction(op, w, n) + comm.rank();
          if (op == ReduceOp::Sum) expected = expected_reduction(op, w, n) + w * comm.rank();
          ASSERT_TRUE(matches(out, expected)) << dtype_label(dt) << " " << to_string(op) << " list n " << n;
          auto flat = torch::cat(inputs);
          auto before = flat.clone();
          auto out2 = torch::empty({n}, dt);
          comm.reduce_scatter_tensor(out2, flat, o).wait();
          ASSERT_TRUE(matches(out2, expected)) << dtype_label(dt) << " " << to_string(op) << " tensor n " << n;
          ASSERT_TRUE(torch::equal(flat, before)) << "the input must not change";
        }
      }
    }
  }, options());
}

TEST_P(AlgorithmContract, AllGatherBothForms) {
  run_ranks(world(), [&](Communicator& comm) {
    for (auto dt : kDtypes) {
      for (auto n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{300007}}) {
        if (n > 1000 && dt != torch::kFloat32 && dt != torch::kBFloat16) continue;
        auto in = rank_input(comm.rank(), n, dt);
        std::vector<torch::Tensor> outs;
        for (int r = 0; r < comm.size(); ++r) outs.push_back(torch::full({n}, 99, dt));
        comm.all_gather(outs, in).wait();
        auto flat = torch::empty({n * comm.size()}, dt);
        comm.all_gather_into_tensor(flat, in).wait();
        for (int r = 0; r < comm.size(); ++r) {
          ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dt))) << dtype_label(dt) << " n " << n << " r " << r;
          ASSERT_TRUE(torch::equal(flat.narrow(0, r * n, n), rank_input(r, n, dt)));
        }
      }
    }
  }, options());
}

// Several operations in flight at once complete in order and correctly
// (the worker runs them FIFO; the Works complete independently).
TEST_P(AlgorithmContract, ManyInFlight) {
  run_ranks(world(), [&](Communicator& comm) {
    std::vector<torch::Tensor> ts;
    std::vector<Work> works;
    for (int i = 0; i < 6; ++i) {
      ts.push_back(rank_input(comm.rank(), 5000 + i * 777, torch::kFloat32));
      works.push_back(comm.all_reduce(ts.back()));
    }
    for (size_t i = 0; i < ts.size(); ++i) {
      works[i].wait();
      ASSERT_TRUE(matches(ts[i], expected_reduction(ReduceOp::Sum, world(), ts[i].numel()))) << i;
    }
  }, options());
}

std::vector<Param> all_params() {
  std::vector<Param> ps;
  for (auto a : {Algorithm::Ring, Algorithm::Tree, Algorithm::HalvingDoubling,
                 Algorithm::Hierarchical, Algorithm::Engine}) {
    for (int w = 1; w <= 5; ++w) ps.push_back({a, w});
  }
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Threads, AlgorithmContract, ::testing::ValuesIn(all_params()), name_of);

}  // namespace
}  // namespace cohort::testing

namespace cohort::testing {
namespace {

// A peer that never joins (alive, elsewhere): the wait times out within the operation's
// timeout, and the message names the operation, the algorithm's step and
// the peer it waited for.
TEST(AlgorithmErrors, TimeoutNamesTheStepAndThePeer) {
  ThreadRanksOptions o;
  o.algorithm = Algorithm::Ring;
  run_ranks(2, [](Communicator& comm) {
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
      EXPECT_NE(what.find("ring all_reduce"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    comm.store()->set_string("timed_out", "1");
  }, o);
}

}  // namespace
}  // namespace cohort::testing
