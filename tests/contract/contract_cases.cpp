// The Communicator contract, each case once (contract_cases.h). Inputs are
// rank-dependent and the expected results are formulas, so a case needs no
// reference run and works at any world size.
#include "tests/contract/contract_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "cohort/cohort.h"
#include "tests/contract/contract_values.h"

namespace cohort::testing {
namespace {

#define EXPECT_REDUCED(got, expected, what) ASSERT_TRUE(matches(got, expected)) << (what)

// Counts: empty, one, odd, fewer than some worlds, non-divisible, ~1M
// (more than one pipeline segment of the algorithms).
const std::vector<int64_t> kReduceCounts = {0, 1, 3, 7, 1001, (1 << 20) + 3};

void all_reduce_every_op_and_count(Communicator& comm, torch::Dtype dt) {
  for (auto op : ops_for(dt)) {
    for (auto n : kReduceCounts) {
      // ~1M elements for sum and avg (the bandwidth path); min/max/prod
      // share the code and take the small counts.
      if (n > 100000 && op != ReduceOp::Sum && op != ReduceOp::Avg) continue;
      auto t = input_for(op, comm.rank(), n, dt);
      comm.all_reduce(t, {op}).wait();
      ASSERT_EQ(t.scalar_type(), dt);
      EXPECT_REDUCED(t, expected_reduction(op, comm.size(), n),
                     "op " + to_string(op) + " n " + std::to_string(n));
    }
  }
}

void all_reduce_coalesced_mixed_sizes(Communicator& comm, torch::Dtype dt) {
  std::vector<torch::Tensor> ts;
  for (int64_t n : {3, 0, 1001}) ts.push_back(rank_input(comm.rank(), n, dt));
  ts.push_back(rank_input(comm.rank(), 5, torch::kFloat64));  // a second dtype in the call
  comm.all_reduce_coalesced(ts, {ReduceOp::Max}).wait();
  EXPECT_REDUCED(ts[0], expected_reduction(ReduceOp::Max, comm.size(), 3), "t0");
  EXPECT_EQ(ts[1].numel(), 0);
  EXPECT_REDUCED(ts[2], expected_reduction(ReduceOp::Max, comm.size(), 1001), "t2");
  EXPECT_REDUCED(ts[3], expected_reduction(ReduceOp::Max, comm.size(), 5), "t3");
}

// Avg needs a floating-point dtype: refused on integers before anything is
// sent, the mean on the others.
void avg_is_for_floating_dtypes(Communicator& comm, torch::Dtype dt) {
  auto t = rank_input(comm.rank(), 4, dt);
  if (!torch::isFloatingType(dt)) {
    EXPECT_THROW((void)comm.all_reduce(t, {ReduceOp::Avg}), InvalidArgument);
    return;
  }
  comm.all_reduce(t, {ReduceOp::Avg}).wait();
  EXPECT_REDUCED(t, expected_reduction(ReduceOp::Avg, comm.size(), 4), "avg");
}

void broadcast_from_last_rank(Communicator& comm, torch::Dtype dt) {
  const int root = comm.size() - 1;
  for (auto n : kCounts) {
    auto t = rank_input(comm.rank(), n, dt);
    comm.broadcast(t, {root}).wait();
    ASSERT_TRUE(torch::equal(t, rank_input(root, n, dt))) << "n " << n;
  }
  std::vector<torch::Tensor> ts{rank_input(comm.rank(), 9, dt),
                                rank_input(comm.rank(), 2, torch::kInt64),
                                rank_input(comm.rank(), 0, dt)};
  comm.broadcast_coalesced(ts, {0}).wait();
  EXPECT_TRUE(torch::equal(ts[0], rank_input(0, 9, dt)));
  EXPECT_TRUE(torch::equal(ts[1], rank_input(0, 2, torch::kInt64)));
}

void reduce_to_middle_rank(Communicator& comm, torch::Dtype dt) {
  const int root = comm.size() / 2;
  for (auto op : {ReduceOp::Sum, ReduceOp::Max}) {
    for (auto n : kCounts) {
      auto t = rank_input(comm.rank(), n, dt);
      comm.reduce(t, {root, op}).wait();
      if (comm.rank() == root) {
        EXPECT_REDUCED(t, expected_reduction(op, comm.size(), n), "n " + std::to_string(n));
      }
    }
  }
}

void all_gather_both_forms(Communicator& comm, torch::Dtype dt) {
  for (int64_t n : {0, 1, 7, 300007}) {
    if (n > 1000 && dt != torch::kFloat32 && dt != torch::kBFloat16) continue;
    auto in = rank_input(comm.rank(), n, dt);
    std::vector<torch::Tensor> outs;
    for (int r = 0; r < comm.size(); ++r) outs.push_back(torch::full({n}, 99, on(dt)));
    comm.all_gather(outs, in).wait();
    auto flat = torch::empty({n * comm.size()}, on(dt));
    comm.all_gather_into_tensor(flat, in).wait();
    for (int r = 0; r < comm.size(); ++r) {
      ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dt))) << "n " << n << " r " << r;
      ASSERT_TRUE(torch::equal(flat.narrow(0, r * n, n), rank_input(r, n, dt)));
    }
  }
}

void reduce_scatter_both_forms(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size();
  for (auto op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg}) {
    if (op == ReduceOp::Avg && !torch::isFloatingType(dt)) continue;
    for (int64_t n : {0, 1, 7, 100003}) {
      if (n > 1000 && dt != torch::kFloat32) continue;
      // Block j of rank r is rank_input(r) + j, so every destination gets a
      // different result: sum + w*rank, max and avg + rank.
      std::vector<torch::Tensor> inputs;
      for (int j = 0; j < w; ++j) inputs.push_back(rank_input(comm.rank(), n, dt) + j);
      const auto expected =
          expected_reduction(op, w, n) + (op == ReduceOp::Sum ? w : 1) * comm.rank();
      const auto what = to_string(op) + " n " + std::to_string(n);
      auto out = torch::empty({n}, on(dt));
      ReduceScatterOptions o;
      o.op = op;
      comm.reduce_scatter(out, inputs, o).wait();
      EXPECT_REDUCED(out, expected, "list " + what);
      auto flat = torch::cat(inputs);
      auto before = flat.clone();
      auto out2 = torch::empty({n}, on(dt));
      comm.reduce_scatter_tensor(out2, flat, o).wait();
      EXPECT_REDUCED(out2, expected, "tensor " + what);
      ASSERT_TRUE(torch::equal(flat, before)) << "the input must not change";
    }
  }
}

// Min and max of floating tensors propagate NaN, as at::minimum and
// torch.max do, whichever rank holds it: rank k's input has NaN at every
// third element (0, 3, ...), for each k in turn.
void min_max_propagate_nan(Communicator& comm, torch::Dtype dt) {
  if (!torch::isFloatingType(dt)) return;
  const int w = comm.size(), me = comm.rank();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto holes = [](int64_t n) { return torch::arange(n, torch::kInt64).remainder(3).eq(0); };
  auto check = [&](const torch::Tensor& got, const torch::Tensor& expected, int64_t n,
                   const std::string& what) {
    const auto mask = holes(n);
    ASSERT_TRUE(torch::equal(got.cpu().isnan(), mask)) << what << ": " << got;
    EXPECT_REDUCED(got.cpu().masked_fill(mask, 0).to(got.device()), expected.masked_fill(mask, 0),
                   what);
  };
  for (int k = 0; k < w; ++k) {
    auto input = [&](int64_t n) {
      auto t = rank_input(me, n, dt);
      if (me == k) t.masked_fill_(holes(n).to(t.device()), nan);
      return t;
    };
    for (auto op : {ReduceOp::Min, ReduceOp::Max}) {
      for (int64_t n : {1, 7, 1001, 100003}) {
        const auto what =
            to_string(op) + ", NaN on rank " + std::to_string(k) + ", n " + std::to_string(n);
        auto t = input(n);
        comm.all_reduce(t, {op}).wait();
        check(t, expected_reduction(op, w, n), n, "all_reduce " + what);
        if (n > 1001) continue;
        auto r = input(n);
        comm.reduce(r, {w / 2, op}).wait();
        if (me == w / 2) check(r, expected_reduction(op, w, n), n, "reduce " + what);
        std::vector<torch::Tensor> ts{input(n), input(3)};
        comm.all_reduce_coalesced(ts, {op}).wait();
        check(ts[0], expected_reduction(op, w, n), n, "all_reduce_coalesced " + what);
        check(ts[1], expected_reduction(op, w, 3), 3, "all_reduce_coalesced " + what);
        std::vector<torch::Tensor> blocks(static_cast<size_t>(w));
        for (auto& b : blocks) b = input(n);
        auto out = torch::empty({n}, on(dt));
        ReduceScatterOptions o;
        o.op = op;
        comm.reduce_scatter_tensor(out, torch::cat(blocks), o).wait();
        check(out, expected_reduction(op, w, n), n, "reduce_scatter_tensor " + what);
      }
    }
  }
}

// Min and max order negative values, signed zeros and infinities as floats
// do: rank r's element i is (i%5 - 2)(r+1)/4, -0 on odd ranks where that is
// 0, and every seventh element +inf on odd ranks, -inf on even ones. The
// expected values are a one-process fold of at::minimum / at::maximum
// (either zero passes: engines that reduce the floats pick one by rank).
void min_max_order_signed_values(Communicator& comm, torch::Dtype dt) {
  if (!torch::isFloatingType(dt)) return;
  const double inf = std::numeric_limits<double>::infinity();
  auto input = [&](int r, int64_t n) {
    auto c = torch::arange(n, torch::kFloat64).remainder(5) - 2;
    auto t = c * (r + 1) / 4;
    if (r % 2 == 1) t.masked_fill_(c.eq(0), -0.0);
    t.masked_fill_(torch::arange(n).remainder(7).eq(6), r % 2 == 1 ? inf : -inf);
    return t;
  };
  for (auto op : {ReduceOp::Min, ReduceOp::Max}) {
    for (int64_t n : {1, 7, 1001}) {
      auto expected = input(0, n);
      for (int r = 1; r < comm.size(); ++r) {
        expected = op == ReduceOp::Min ? at::minimum(expected, input(r, n))
                                       : at::maximum(expected, input(r, n));
      }
      auto t = input(comm.rank(), n).to(on(dt));
      comm.all_reduce(t, {op}).wait();
      ASSERT_TRUE(torch::equal(t.cpu().to(torch::kFloat64), expected))
          << to_string(op) << " n " << n << ": " << t;
    }
  }
}

// Leaves that require grad (parameters) are data to a collective, as in
// PyTorch's c10d: every op gives the formula's result, and the tensors still
// require grad afterwards.
void tensors_that_require_grad(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size();
  // Every algorithm here (not by the drivers: adaptive's calibration would
  // cost seconds per world and reduce with these same algorithms).
  for (auto algo :
       {Algorithm::Engine, Algorithm::Ring, Algorithm::Tree, Algorithm::HalvingDoubling}) {
    for (auto op : ops_for(dt)) {
      for (int64_t n : {1, 7, 1001}) {
        auto t = input_for(op, comm.rank(), n, dt).requires_grad_();
        AllReduceOptions o;
        o.op = op;
        o.algo = algo;
        comm.all_reduce(t, o).wait();
        ASSERT_TRUE(t.requires_grad());
        EXPECT_REDUCED(t.detach(), expected_reduction(op, w, n),
                       "all_reduce " + to_string(op) + " " + to_string(algo));
      }
    }
  }
  auto b = rank_input(comm.rank(), 5, dt).requires_grad_();
  comm.broadcast(b, {w - 1}).wait();
  EXPECT_TRUE(torch::equal(b.detach(), rank_input(w - 1, 5, dt)));
  std::vector<torch::Tensor> outs;
  for (int r = 0; r < w; ++r) outs.push_back(torch::zeros({3}, on(dt)).requires_grad_());
  comm.all_gather(outs, rank_input(comm.rank(), 3, dt).requires_grad_()).wait();
  for (int r = 0; r < w; ++r) EXPECT_TRUE(torch::equal(outs[r].detach(), rank_input(r, 3, dt)));
  auto flat = torch::zeros({3 * w}, on(dt)).requires_grad_();
  comm.all_gather_into_tensor(flat, rank_input(comm.rank(), 3, dt)).wait();
  for (int r = 0; r < w; ++r)
    EXPECT_TRUE(torch::equal(flat.detach().narrow(0, 3 * r, 3), rank_input(r, 3, dt)));
  auto out = torch::zeros({3}, on(dt)).requires_grad_();
  ReduceScatterOptions o;
  o.op = ReduceOp::Max;
  comm.reduce_scatter_tensor(
          out, torch::cat(std::vector<torch::Tensor>(w, rank_input(comm.rank(), 3, dt))), o)
      .wait();
  EXPECT_REDUCED(out.detach(), expected_reduction(ReduceOp::Max, w, 3), "reduce_scatter max");
}

// Operations in flight at once, waited in reverse, each with its own result.
void many_in_flight(Communicator& comm, torch::Dtype dt) {
  std::vector<torch::Tensor> ts;
  std::vector<Work> works;
  for (int i = 0; i < 6; ++i) {
    ts.push_back(rank_input(comm.rank(), 5000 + i * 777, dt));
    works.push_back(comm.all_reduce(ts.back()));
  }
  for (int i = 5; i >= 0; --i) works[i].wait();
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_REDUCED(ts[i], expected_reduction(ReduceOp::Sum, comm.size(), ts[i].numel()),
                   "operation " + std::to_string(i));
  }
}

void gather_and_scatter_at_last_rank(Communicator& comm, torch::Dtype dt) {
  const int root = comm.size() - 1;
  for (auto n : kCounts) {
    auto in = rank_input(comm.rank(), n, dt);
    std::vector<torch::Tensor> outs;
    if (comm.rank() == root) {
      for (int r = 0; r < comm.size(); ++r) outs.push_back(torch::zeros({n}, on(dt)));
    }
    comm.gather(outs, in, {root}).wait();
    for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
      ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dt)));
    }
    std::vector<torch::Tensor> pieces;
    if (comm.rank() == root) {
      for (int r = 0; r < comm.size(); ++r) pieces.push_back(rank_input(r + 1, n, dt));
    }
    auto out = torch::zeros({n}, on(dt));
    comm.scatter(out, pieces, {root}).wait();
    ASSERT_TRUE(torch::equal(out, rank_input(comm.rank() + 1, n, dt)));
  }
}

void all_to_all_equal_and_uneven(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size(), me = comm.rank();
  // Equal splits: row block j of rank r holds 10*r + j.
  auto in = torch::arange(w, torch::kInt64).repeat_interleave(3).add(10 * me).to(on(dt));
  auto out = torch::empty({3 * w}, on(dt));
  comm.all_to_all_single(out, in).wait();
  auto expected = (torch::arange(w, torch::kInt64) * 10 + me).repeat_interleave(3).to(on(dt));
  EXPECT_TRUE(torch::equal(out, expected));

  // Uneven: rank r sends j+1 rows of width 2 to rank j, filled with r.
  std::vector<int64_t> in_splits, out_splits;
  for (int j = 0; j < w; ++j) in_splits.push_back(j + 1);
  for (int r = 0; r < w; ++r) out_splits.push_back(me + 1);
  auto uin = torch::full({w * (w + 1) / 2, 2}, me, on(dt));
  auto uout = torch::empty({w * (me + 1), 2}, on(dt));
  comm.all_to_all_single(uout, uin, out_splits, in_splits).wait();
  auto uexp =
      torch::arange(w, torch::kInt64).repeat_interleave(me + 1).unsqueeze(1).expand({-1, 2});
  EXPECT_TRUE(torch::equal(uout, uexp.to(on(dt))));

  // Rank 0 sends no rows (its input has none) and receives one row of width
  // 2 from every other rank, filled with that rank.
  const int64_t sends = me == 0 ? 0 : 1, gets = me == 0 ? w - 1 : 0;
  std::vector<int64_t> one_in(static_cast<size_t>(w), 0), one_out(static_cast<size_t>(w), 0);
  one_in[0] = sends;
  if (me == 0) std::fill(one_out.begin() + 1, one_out.end(), 1);
  auto ein = torch::full({sends, 2}, me, on(dt));
  auto eout = torch::empty({gets, 2}, on(dt));
  comm.all_to_all_single(eout, ein, one_out, one_in).wait();
  auto eexp = torch::arange(1, w, torch::kInt64).unsqueeze(1).expand({-1, 2});
  if (me == 0) {
    EXPECT_TRUE(torch::equal(eout, eexp.to(on(dt))));
  }

  // List form: rank r sends rank j r + j + 1 elements, so the blocks'
  // sizes differ by sender as well as by receiver.
  std::vector<torch::Tensor> ins, outs;
  for (int j = 0; j < w; ++j) {
    ins.push_back(torch::full({me + j + 1}, me * 10 + j, on(dt)));
    outs.push_back(torch::empty({j + me + 1}, on(dt)));
  }
  comm.all_to_all(outs, ins).wait();
  for (int r = 0; r < w; ++r) {
    EXPECT_TRUE(torch::equal(outs[r], torch::full({r + me + 1}, r * 10 + me, on(dt))));
  }
}

// Overlapping buffers (in place, or sharing some bytes): every rank gets
// the data the peers sent, never its own bytes overwritten before they left.
// Rank r's block for rank j holds 10 r + j (+ 1 on odd elements), so a block
// from the wrong rank or for the wrong rank shows.
torch::Tensor a2a_block(int from, int to, int64_t k, torch::Dtype dt) {
  return (torch::arange(k, torch::kInt64).remainder(2) + 10 * from + to).to(on(dt));
}

void all_to_all_in_place_and_overlapping(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size(), me = comm.rank();
  for (int64_t k : {0, 1, 3, 5000}) {
    std::vector<torch::Tensor> mine, expected;
    for (int j = 0; j < w; ++j) {
      mine.push_back(a2a_block(me, j, k, dt));
      expected.push_back(a2a_block(j, me, k, dt));
    }
    auto want = torch::cat(expected);
    // In place.
    auto t = torch::cat(mine);
    comm.all_to_all_single(t, t).wait();
    ASSERT_TRUE(torch::equal(t, want)) << "in place, k " << k;
    // The output starts one element (and, with k > 1, one block) past the
    // input, inside it.
    for (int64_t shift : {int64_t{1}, k + 1}) {
      auto buf = torch::full({w * k + shift}, -1, on(dt));
      auto in = buf.narrow(0, 0, w * k), out = buf.narrow(0, shift, w * k);
      in.copy_(torch::cat(mine));
      comm.all_to_all_single(out, in).wait();
      ASSERT_TRUE(torch::equal(out, want)) << "output " << shift << " past the input, k " << k;
      // And the input past the output.
      buf.narrow(0, shift, w * k).copy_(torch::cat(mine));
      auto back = buf.narrow(0, 0, w * k);
      comm.all_to_all_single(back, buf.narrow(0, shift, w * k)).wait();
      ASSERT_TRUE(torch::equal(back, want)) << "input " << shift << " past the output, k " << k;
    }
  }
  // Uneven, in place: rank r sends (r + j) % w + 1 rows of width 2 to rank
  // j, so each rank sends and receives w (w + 1) / 2 rows.
  std::vector<int64_t> in_splits, out_splits;
  std::vector<torch::Tensor> rows, expected;
  for (int j = 0; j < w; ++j) {
    in_splits.push_back((me + j) % w + 1);
    out_splits.push_back((j + me) % w + 1);
    rows.push_back(torch::full({in_splits.back(), 2}, 10 * me + j, on(dt)));
    expected.push_back(torch::full({out_splits.back(), 2}, 10 * j + me, on(dt)));
  }
  auto u = torch::cat(rows);
  comm.all_to_all_single(u, u, out_splits, in_splits).wait();
  EXPECT_TRUE(torch::equal(u, torch::cat(expected))) << "uneven, in place";
}

// The gathers, scatter and reduce-scatters with an input inside the output
// (or the output inside the input): exactly this rank's own block (in
// place), and elsewhere.
void gathers_and_reduce_scatters_overlapping(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size(), me = comm.rank();
  for (int64_t n : {0, 1, 7, 5000}) {
    // Another rank's block, half a block on (clipped to the last block).
    const int64_t elsewhere = std::min(((me + 1) % w) * n + n / 2, (w - 1) * n);
    for (int64_t at : {me * n, elsewhere}) {
      auto out = torch::full({w * n}, -1, on(dt));
      auto in = out.narrow(0, at, n);
      in.copy_(rank_input(me, n, dt));
      comm.all_gather_into_tensor(out, in).wait();
      for (int r = 0; r < w; ++r) {
        ASSERT_TRUE(torch::equal(out.narrow(0, r * n, n), rank_input(r, n, dt)))
            << "all_gather_into_tensor, input at " << at << ", n " << n << ", block " << r;
      }
    }
    // The list form, the input being the next rank's output.
    std::vector<torch::Tensor> outs;
    for (int r = 0; r < w; ++r) outs.push_back(torch::full({n}, -1, on(dt)));
    outs[(me + 1) % w].copy_(rank_input(me, n, dt));
    comm.all_gather(outs, outs[(me + 1) % w]).wait();
    for (int r = 0; r < w; ++r) {
      ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dt))) << "all_gather n " << n;
    }
    // Reduce-scatter: block j of rank r is rank_input(r) + j (as in
    // reduce_scatter_both_forms); the output is its own block or inside
    // another.
    for (auto op : {ReduceOp::Sum, ReduceOp::Max}) {
      const auto expected = expected_reduction(op, w, n) + (op == ReduceOp::Sum ? w : 1) * me;
      for (int64_t at : {me * n, elsewhere}) {
        std::vector<torch::Tensor> blocks;
        for (int j = 0; j < w; ++j) blocks.push_back(rank_input(me, n, dt) + j);
        auto flat = torch::cat(blocks);
        auto out = flat.narrow(0, at, n);
        ReduceScatterOptions o;
        o.op = op;
        comm.reduce_scatter_tensor(out, flat, o).wait();
        EXPECT_REDUCED(out, expected,
                       "reduce_scatter_tensor " + to_string(op) + ", output at " +
                           std::to_string(at) + ", n " + std::to_string(n));
        // The list form, its output one of the inputs.
        const int j = at == me * n ? me : (me + 1) % w;
        for (int b = 0; b < w; ++b) blocks[b] = rank_input(me, n, dt) + b;
        auto list_out = blocks[j];
        comm.reduce_scatter(list_out, blocks, o).wait();
        EXPECT_REDUCED(list_out, expected,
                       "reduce_scatter " + to_string(op) + ", output inputs[" + std::to_string(j) +
                           "], n " + std::to_string(n));
      }
    }
  }
}

// Gather into outputs that hold the root's input, and scatter from inputs
// that hold the root's output: rank 0's block on the last rank (in place at
// world 1).
void gather_and_scatter_overlapping(Communicator& comm, torch::Dtype dt) {
  const int w = comm.size(), me = comm.rank(), root = w - 1;
  for (int64_t n : {0, 1, 7, 5000}) {
    std::vector<torch::Tensor> outs;
    auto in = rank_input(me, n, dt);
    if (me == root) {
      for (int r = 0; r < w; ++r) outs.push_back(torch::full({n}, -1, on(dt)));
      outs[0].copy_(in);
      in = outs[0];
    }
    comm.gather(outs, in, {root}).wait();
    for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
      ASSERT_TRUE(torch::equal(outs[r], rank_input(r, n, dt))) << "gather n " << n << " r " << r;
    }
    std::vector<torch::Tensor> pieces;
    auto out = torch::full({n}, -1, on(dt));
    if (me == root) {
      for (int r = 0; r < w; ++r) pieces.push_back(rank_input(r + 1, n, dt));
      out = pieces[0];
    }
    comm.scatter(out, pieces, {root}).wait();
    ASSERT_TRUE(torch::equal(out, rank_input(me + 1, n, dt))) << "scatter n " << n;
  }
}

// Each rank sends two messages to its right neighbour, tags 7 then 3, and
// receives them from its left neighbour in the opposite order: tags, not
// arrival order, decide which buffer gets which message. The large one is
// not sent eagerly.
void p2p_tags_keep_messages_apart(Communicator& comm, torch::Dtype) {
  const int w = comm.size(), me = comm.rank();
  const int right = (me + 1) % w, left = (me + w - 1) % w;
  auto a = torch::full({100000}, 100.0 * me + 7, on());
  auto b = torch::full({10}, 100.0 * me + 3, on(torch::kBFloat16));
  auto sa = comm.send(a, right, {7});
  auto sb = comm.send(b, right, {3});
  auto rb = torch::zeros({10}, on(torch::kBFloat16));
  auto ra = torch::zeros({100000}, on());
  comm.recv(rb, left, {3}).wait();
  comm.recv(ra, left, {7}).wait();
  sa.wait();
  sb.wait();
  EXPECT_TRUE(torch::equal(ra, torch::full({100000}, 100.0 * left + 7, on())));
  EXPECT_TRUE(torch::equal(rb, torch::full({10}, 100.0 * left + 3, on(torch::kBFloat16))));
}

void p2p_one_tag_arrives_in_order(Communicator& comm, torch::Dtype) {
  const int w = comm.size(), me = comm.rank();
  std::vector<Work> sends;
  std::vector<torch::Tensor> outgoing;
  for (int k = 0; k < 5; ++k) {
    outgoing.push_back(torch::full({3}, me * 10 + k, on(torch::kInt64)));
    sends.push_back(comm.send(outgoing.back(), (me + 1) % w, {0}));
  }
  for (int k = 0; k < 5; ++k) {
    auto t = torch::empty({3}, on(torch::kInt64));
    comm.recv(t, (me + w - 1) % w, {0}).wait();
    EXPECT_EQ(t[0].item<int64_t>(), ((me + w - 1) % w) * 10 + k);
  }
  wait_all(sends);
}

void p2p_bad_peers_and_tags_are_refused(Communicator& comm, torch::Dtype) {
  auto t = torch::zeros({2}, on());
  EXPECT_THROW((void)comm.send(t, comm.rank()), InvalidArgument);
  EXPECT_THROW((void)comm.recv(t, comm.size()), InvalidArgument);
  EXPECT_THROW((void)comm.recv(t, -1), InvalidArgument);
  if (comm.size() > 1) {
    EXPECT_THROW((void)comm.send(t, (comm.rank() + 1) % comm.size(), {-1}), InvalidArgument);
  }
}

// The odd ranks, listed in reverse, form a group ranked in the order given.
void new_group_of_odd_ranks_in_reverse(Communicator& comm, torch::Dtype) {
  std::vector<int> odd;
  for (int r = comm.size() - 1; r >= 0; --r) {
    if (r % 2 == 1) odd.push_back(r);
  }
  auto group = comm.new_group(odd);
  if (comm.rank() % 2 == 0) {
    EXPECT_EQ(group, nullptr);
  } else {
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(group->size(), static_cast<int>(odd.size()));
    const auto at = std::find(odd.begin(), odd.end(), comm.rank()) - odd.begin();
    EXPECT_EQ(group->rank(), at);
    auto t = torch::full({4}, static_cast<float>(comm.rank()), on());
    group->all_reduce(t).wait();
    float sum = 0;
    for (int r : odd) sum += static_cast<float>(r);
    EXPECT_TRUE(torch::equal(t, torch::full({4}, sum, on())));
  }
  // The parent keeps working after a subgroup was made.
  auto t = torch::ones({1}, on());
  comm.all_reduce(t).wait();
  EXPECT_EQ(t.item<float>(), static_cast<float>(comm.size()));
}

// Colors by parity, the last rank of an odd world opts out, keys reverse
// the order; then groups of one inside each group.
void split_by_color_ranks_by_key(Communicator& comm, torch::Dtype) {
  const int me = comm.rank(), w = comm.size();
  const bool out = w % 2 == 1 && me == w - 1 && w > 1;
  auto sub = comm.split(out ? -1 : me % 2, -me);
  if (out) {
    EXPECT_EQ(sub, nullptr);
    return;
  }
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;  // by key (-rank): highest rank first
  for (int r = w - 1; r >= 0; --r) {
    if (r % 2 == me % 2 && !(w % 2 == 1 && r == w - 1 && w > 1)) members.push_back(r);
  }
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(sub->rank(), std::find(members.begin(), members.end(), me) - members.begin());
  auto t = torch::full({3}, static_cast<double>(me), on(torch::kFloat64));
  sub->all_reduce(t).wait();
  double sum = 0;
  for (int r : members) sum += r;
  EXPECT_EQ(t[0].item<double>(), sum);
  auto solo = sub->split(sub->rank(), 0);
  ASSERT_NE(solo, nullptr);
  EXPECT_EQ(solo->size(), 1);
  auto u = torch::full({2}, 3.0f, on());
  solo->all_reduce(u).wait();
  EXPECT_EQ(u[0].item<float>(), 3.0f);
}

// A group dropped as soon as it is made: no rank's construction may fail
// because a faster peer already closed its side.
void groups_dropped_at_once(Communicator& comm, torch::Dtype) {
  for (int i = 0; i < 20; ++i) {
    std::vector<int> all(static_cast<size_t>(comm.size()));
    std::iota(all.begin(), all.end(), 0);
    ASSERT_NE(comm.new_group(all), nullptr) << "group " << i;
  }
}

void bad_group_ranks_are_refused(Communicator& comm, torch::Dtype) {
  EXPECT_THROW(comm.new_group({0, 0}), InvalidArgument);
  EXPECT_THROW(comm.new_group({0, comm.size()}), InvalidArgument);
  EXPECT_THROW(comm.new_group({}), InvalidArgument);
}

}  // namespace

const std::vector<ContractCase>& contract_cases() {
  static const std::vector<ContractCase> cases = [] {
    std::vector<ContractCase> all = {
        {"AllReduceEveryOpAndCount", all_reduce_every_op_and_count, true, true},
        {"AllReduceCoalescedMixedSizes", all_reduce_coalesced_mixed_sizes, true, false},
        {"AvgIsForFloatingDtypes", avg_is_for_floating_dtypes, true, false},
        {"MinMaxPropagateNaN", min_max_propagate_nan, true, true},
        {"MinMaxOrderSignedValues", min_max_order_signed_values, true, false},
        {"BroadcastFromLastRank", broadcast_from_last_rank, true, false},
        {"ReduceToMiddleRank", reduce_to_middle_rank, true, false},
        {"AllGatherBothForms", all_gather_both_forms, true, true},
        {"ReduceScatterBothForms", reduce_scatter_both_forms, true, true},
        {"ManyInFlight", many_in_flight, false, true},
        {"TensorsThatRequireGrad", tensors_that_require_grad, false, false},
        {"GatherAndScatterAtLastRank", gather_and_scatter_at_last_rank, true, false},
        {"AllToAllEqualAndUneven", all_to_all_equal_and_uneven, true, false},
        {"AllToAllInPlaceAndOverlapping", all_to_all_in_place_and_overlapping, true, false},
        {"GathersAndReduceScattersOverlapping", gathers_and_reduce_scatters_overlapping, true,
         true},
        {"GatherAndScatterOverlapping", gather_and_scatter_overlapping, true, false},
        {"P2PTagsKeepMessagesApart", p2p_tags_keep_messages_apart, false, false, 2},
        {"P2POneTagArrivesInOrder", p2p_one_tag_arrives_in_order, false, false, 2},
        {"P2PBadPeersAndTagsAreRefused", p2p_bad_peers_and_tags_are_refused, false, false},
        {"NewGroupOfOddRanksInReverse", new_group_of_odd_ranks_in_reverse, false, false, 2},
        {"SplitByColorRanksByKey", split_by_color_ranks_by_key, false, false},
        {"BadGroupRanksAreRefused", bad_group_ranks_are_refused, false, false},
        {"GroupsDroppedAtOnce", groups_dropped_at_once, false, false},
    };
    for (auto& c : in_flight_cases()) all.push_back(c);
    return all;
  }();
  return cases;
}

}  // namespace cohort::testing
