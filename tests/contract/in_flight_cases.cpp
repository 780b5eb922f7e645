// The contract's cases on operations in flight (contract_cases.h): two
// collectives on the same tensor before either is waited for, handles
// dropped without wait(), and subgroups the ranks list differently.
// Expected values are closed formulas (contract_values.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "cohort/cohort.h"
#include "tests/contract/contract_cases.h"
#include "tests/contract/contract_values.h"

namespace cohort::testing {
namespace {

// The element furthest from its expected value, for the failure message.
std::string worst(const torch::Tensor& got, const torch::Tensor& expected_f64) {
  auto g = got.cpu().to(torch::kFloat64).flatten();
  auto e = expected_f64.to(got.scalar_type()).to(torch::kFloat64).flatten();
  if (g.numel() == 0) return "empty";
  const int64_t k = (g - e).abs().argmax().item<int64_t>();
  return "element " + std::to_string(k) + ": got " + std::to_string(g[k].item<double>()) +
         ", expected " + std::to_string(e[k].item<double>());
}

#define EXPECT_LANDED(got, expected, what) \
  ASSERT_TRUE(matches(got, expected)) << (what) << ", " << worst(got, expected)

// Over 100k elements: long enough for two operations on one buffer to run
// at the same time, where an engine lets them.
constexpr int64_t kLong = 100003;

// Twice all_reduce(sum) on one tensor, the second issued before the first
// is waited for, waited for in reverse: the second reduces the first's
// result (stream order), w times the single sum; avg twice is the mean, max
// twice the max. Separate tensors in between are unaffected.
void same_tensor_twice_in_flight(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size();
  for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
    if (op == ReduceOp::Avg && !torch::isFloatingType(dt)) continue;
    for (int64_t n : {int64_t{7}, kLong}) {
      auto t = rank_input(comm.rank(), n, dt);
      auto other = rank_input(comm.rank(), 5, dt);
      AllReduceOptions o;
      o.op = op;
      auto w1 = comm.all_reduce(t, o);
      auto w2 = comm.all_reduce(other, o);
      auto w3 = comm.all_reduce(t, o);
      w3.wait();
      w2.wait();
      w1.wait();
      auto once = expected_reduction(op, w, n);
      auto twice = op == ReduceOp::Sum ? once * w : once;
      EXPECT_LANDED(t, twice, to_string(op) + " twice, n " + std::to_string(n));
      EXPECT_LANDED(other, expected_reduction(op, w, 5), to_string(op) + " between");
    }
  }
}

// The coalesced form, twice on the same list in flight: w times the single
// sum.
void coalesced_twice_in_flight(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size();
  std::vector<torch::Tensor> ts{rank_input(comm.rank(), 11, dt), rank_input(comm.rank(), 3, dt)};
  auto w1 = comm.all_reduce_coalesced(ts);
  auto w2 = comm.all_reduce_coalesced(ts);
  w2.wait();
  w1.wait();
  EXPECT_LANDED(ts[0], expected_reduction(ReduceOp::Sum, w, 11) * w, "t0");
  EXPECT_LANDED(ts[1], expected_reduction(ReduceOp::Sum, w, 3) * w, "t1");
}

// A gather's outputs read by the next collective before the gather is waited
// for: the all_reduce sees the gathered values (the list form copies out at
// completion under some algorithms), and a reduce_scatter's output likewise.
void outputs_read_while_in_flight(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size();
  const int64_t n = kLong;
  auto in = rank_input(comm.rank(), n, dt);
  std::vector<torch::Tensor> outs;
  for (int r = 0; r < w; ++r) outs.push_back(torch::zeros({n}, on(dt)));
  auto g = comm.all_gather(outs, in);
  auto r = comm.all_reduce(outs[0]);
  r.wait();
  g.wait();
  // outs[0] is rank 0's input everywhere, summed over w ranks.
  EXPECT_LANDED(outs[0], expected_reduction(ReduceOp::Sum, 1, n) * w, "all_gather then sum");

  std::vector<torch::Tensor> blocks;
  for (int j = 0; j < w; ++j) blocks.push_back(rank_input(comm.rank(), n, dt));
  auto out = torch::zeros({n}, on(dt));
  auto rs = comm.reduce_scatter_tensor(out, torch::cat(blocks));
  auto again = comm.all_reduce(out);
  again.wait();
  rs.wait();
  EXPECT_LANDED(out, expected_reduction(ReduceOp::Sum, w, n) * w, "reduce_scatter then sum");
}

// Handles dropped without wait(): the barrier completes them (average,
// copy-back, copy-out) before its own wait() returns.
void dropped_work_completes_at_barrier(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size();
  const bool floating = torch::isFloatingType(dt);
  const auto op = floating ? ReduceOp::Avg : ReduceOp::Sum;
  auto t = rank_input(comm.rank(), 1001, dt);
  (void)comm.all_reduce(t, {op});
  auto in = rank_input(comm.rank(), kLong, dt);
  std::vector<torch::Tensor> outs;
  for (int r = 0; r < w; ++r) outs.push_back(torch::zeros({kLong}, on(dt)));
  (void)comm.all_gather(outs, in);
  comm.barrier().wait();
  EXPECT_LANDED(t, expected_reduction(op, w, 1001), "dropped " + to_string(op));
  for (int r = 0; r < w; ++r) {
    EXPECT_LANDED(outs[r], rank_input(r, kLong, torch::kFloat64),
                  "dropped all_gather, r " + std::to_string(r));
  }
}

// Ranks that list a subgroup's members differently (here: in another order
// on rank 0) get a MismatchError on every rank, not a timeout. It runs in a
// group of all ranks: the mismatch leaves that one refusing further calls.
void new_group_lists_that_differ(Communicator& comm, torch::Dtype) {
  std::vector<int> ranks(static_cast<size_t>(comm.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  auto all = comm.new_group(ranks);
  ASSERT_NE(all, nullptr);
  if (comm.rank() == 0) std::reverse(ranks.begin(), ranks.end());
  try {
    auto g = all->new_group(ranks);
    ADD_FAILURE() << "new_group with different lists returned";
  } catch (const MismatchError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("new_group on rank " + std::to_string(comm.rank())), std::string::npos) << m;
    // The signature check's words, or the debug check's (COHORT_DEBUG=detail runs first).
    EXPECT_TRUE(m.find("listed different members") != std::string::npos ||
                m.find("called new_group([") != std::string::npos)
        << m;
  }
}

#undef EXPECT_LANDED

}  // namespace

std::vector<ContractCase> in_flight_cases() {
  return {
      {"SameTensorTwiceInFlight", same_tensor_twice_in_flight, true, true},
      {"CoalescedTwiceInFlight", coalesced_twice_in_flight, true, false},
      {"OutputsReadWhileInFlight", outputs_read_while_in_flight, true, true},
      {"DroppedWorkCompletesAtBarrier", dropped_work_completes_at_barrier, true, true},
      {"NewGroupListsThatDiffer", new_group_lists_that_differ, false, false, 2},
  };
}

}  // namespace cohort::testing
