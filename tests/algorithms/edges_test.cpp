// The algorithms at the edges the contract suite (worlds 1-5, hierarchical
// as hosts of two) leaves out: worlds 6 and 7, hierarchical layouts with
// uneven and interleaved nodes, counts around the world size, every op
// where the extreme value sits on a different rank per element, and
// tensors that are contiguous slices of a larger buffer. Inputs are
// rank-dependent, expected values closed formulas.
#include <gtest/gtest.h>

#include "support/engine_worlds.h"
#include "support/thread_ranks.h"

namespace cohort::testing::edges_test {
namespace {

// Node layouts for the hierarchical algorithm, by name.
std::string node_name(const std::string& layout, int r, int w) {
  if (layout == "pairs") return "h" + std::to_string(r / 2);        // 2+2+...+1
  if (layout == "first_alone") return r == 0 ? "a" : "b";           // 1+(w-1)
  if (layout == "interleaved") return "h" + std::to_string(r % 2);  // 0,2,4 | 1,3,5
  if (layout == "last_alone") return r == w - 1 ? "z" : "y";        // (w-1)+1
  return "one";
}

struct Case {
  std::string backend;
  Algorithm algo;
  int world;
  std::string layout;  // hierarchical only
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  return c.backend + "_" + to_string(c.algo) + "_world" + std::to_string(c.world) +
         (c.layout.empty() ? "" : "_" + c.layout);
}

void PrintTo(const Case& c, std::ostream* os) { *os << name_of({c, 0}); }

ThreadRanksOptions options_for(const Case& c) {
  ThreadRanksOptions o;
  o.backend = c.backend;
  o.algorithm = c.algo;
  if (!c.layout.empty()) {
    o.node_of = [layout = c.layout, w = c.world](int r) { return node_name(layout, r, w); };
  }
  return o;
}

// Element g of rank r: v = (r + g) % w + 1 + 8 (g % 7), so along every
// element the ranks hold 1..w (plus a per-element offset) in a rotated
// order: the minimum and maximum come from a different rank per element,
// and a block that lands in the wrong place shows. For prod:
// 3 on the rank with (r + g) % w == 0, else 1, times 2 where g % 3 == 0.
torch::Tensor input(ReduceOp op, int r, int w, int64_t begin, int64_t n) {
  auto g = torch::arange(begin, begin + n, torch::kInt64);
  auto turn = (g + r).remainder(w);
  if (op == ReduceOp::Prod)
    return (turn.eq(0).to(torch::kInt64) * 2 + 1) * (g.remainder(3).eq(0) + 1);
  return turn + 1 + g.remainder(7) * 8;
}

// The reduction over w ranks of input(op, r, w, begin, n), in float64.
torch::Tensor expected(ReduceOp op, int w, int64_t begin, int64_t n) {
  auto g = torch::arange(begin, begin + n, torch::kFloat64);
  auto base = g.remainder(7) * 8;
  switch (op) {
    case ReduceOp::Sum:
      return base * w + w * (w + 1) / 2.0;
    case ReduceOp::Avg:
      return base + (w + 1) / 2.0;
    case ReduceOp::Min:
      return base + 1;
    case ReduceOp::Max:
      return base + w;
    case ReduceOp::Prod:
      return 3 * torch::pow(g.remainder(3).eq(0).to(torch::kFloat64) + 1, w);
  }
  return {};
}

bool close(const torch::Tensor& got, const torch::Tensor& want_f64) {
  auto want = want_f64.to(got.scalar_type()).to(torch::kFloat64);
  const double tol = got.scalar_type() == torch::kBFloat16  ? 1e-2
                     : got.scalar_type() == torch::kFloat16 ? 1e-3
                                                            : 0.0;
  return torch::allclose(got.to(torch::kFloat64), want, tol, tol);
}

std::vector<ReduceOp> ops_of(torch::Dtype dt) {
  std::vector<ReduceOp> ops{ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod};
  if (torch::isFloatingType(dt)) ops.push_back(ReduceOp::Avg);
  return ops;
}

// One of each way the algorithms carry a dtype: itself (float32, int32,
// int64) or reduced in float32 (bfloat16, as float16).
const std::vector<torch::Dtype> kDtypes = {torch::kFloat32, torch::kBFloat16, torch::kInt32,
                                           torch::kInt64};

// Counts around the world size and past two ring segments (262144 float32).
std::vector<int64_t> counts_for(int w) {
  return {0, 1, w - 1, w + 1, 2 * w + 3, 262144 * 2 + w + 1};
}

// Tree and hierarchical run reduce-scatter and all-gather as the ring does.
bool ring_for_the_rest(Algorithm a) { return a == Algorithm::Tree || a == Algorithm::Hierarchical; }

class AlgorithmEdges : public ::testing::TestWithParam<Case> {};

// all_reduce of every op, dtype and count, into a slice of a larger buffer
// whose other elements must stay as they were.
TEST_P(AlgorithmEdges, AllReduce) {
  const auto c = GetParam();
  run_ranks(
      c.world,
      [&](Communicator& comm) {
        const int w = comm.size(), me = comm.rank();
        for (auto dt : kDtypes) {
          for (auto op : ops_of(dt)) {
            for (int64_t n : counts_for(w)) {
              if (n > 2000 && (op != ReduceOp::Sum || dt != torch::kFloat32)) continue;
              auto storage = torch::full({n + 6}, -3, torch::TensorOptions().dtype(dt));
              auto t = storage.narrow(0, 2, n);
              t.copy_(input(op, me, w, 0, n));
              comm.all_reduce(t, {op}).wait();
              ASSERT_TRUE(close(t, expected(op, w, 0, n)))
                  << to_string(op) << " " << dt << " n " << n << " rank " << me << ": "
                  << (n < 50 ? t : t.narrow(0, 0, 20));
              ASSERT_TRUE(storage.narrow(0, 0, 2).eq(-3).all().item<bool>()) << "before the slice";
              ASSERT_TRUE(storage.narrow(0, n + 2, 4).eq(-3).all().item<bool>())
                  << "after the slice, n " << n;
            }
          }
        }
      },
      options_for(c));
}

// reduce_scatter_tensor and all_gather_into_tensor with per-rank counts
// below, at and above the world size, the output a slice of a larger buffer.
TEST_P(AlgorithmEdges, ReduceScatterAndAllGather) {
  const auto c = GetParam();
  if (ring_for_the_rest(c.algo)) GTEST_SKIP() << "the ring's (its own case)";
  run_ranks(
      c.world,
      [&](Communicator& comm) {
        const int w = comm.size(), me = comm.rank();
        for (auto dt : kDtypes) {
          for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{w + 1}, int64_t{333}}) {
            for (auto op : ops_of(dt)) {
              auto in = input(op, me, w, 0, n * w).to(dt);
              auto storage = torch::full({n + 3}, -3, torch::TensorOptions().dtype(dt));
              auto out = storage.narrow(0, 1, n);
              ReduceScatterOptions o;
              o.op = op;
              comm.reduce_scatter_tensor(out, in, o).wait();
              ASSERT_TRUE(close(out, expected(op, w, me * n, n)))
                  << "reduce_scatter " << to_string(op) << " " << dt << " n " << n << ": " << out;
              ASSERT_TRUE(storage.narrow(0, 0, 1).eq(-3).all().item<bool>());
              ASSERT_TRUE(storage.narrow(0, n + 1, 2).eq(-3).all().item<bool>());
            }
            auto mine = input(ReduceOp::Sum, me, w, me * n, n).to(dt);
            auto storage = torch::full({n * w + 3}, -3, torch::TensorOptions().dtype(dt));
            auto out = storage.narrow(0, 1, n * w);
            comm.all_gather_into_tensor(out, mine).wait();
            for (int r = 0; r < w; ++r) {
              ASSERT_TRUE(torch::equal(out.narrow(0, r * n, n),
                                       input(ReduceOp::Sum, r, w, r * n, n).to(dt)))
                  << "all_gather " << dt << " n " << n << " block " << r;
            }
            ASSERT_TRUE(storage.narrow(0, 0, 1).eq(-3).all().item<bool>());
            ASSERT_TRUE(storage.narrow(0, n * w + 1, 2).eq(-3).all().item<bool>());
          }
        }
      },
      options_for(c));
}

// A transposed (non-contiguous) tensor is refused on every rank, each
// before anything is sent, and the communicator goes on.
TEST_P(AlgorithmEdges, NonContiguousIsRefusedOnEveryRank) {
  const auto c = GetParam();
  if (c.algo != Algorithm::Ring) GTEST_SKIP() << "refused before any algorithm: the ring's case";
  run_ranks(
      c.world,
      [&](Communicator& comm) {
        auto t = torch::ones({3, 4}).t();
        EXPECT_THROW((void)comm.all_reduce(t), InvalidArgument);
        auto strided = torch::ones({10}).slice(0, 0, 10, 2);
        auto flat = torch::empty({5 * comm.size()});
        EXPECT_THROW((void)comm.all_gather_into_tensor(flat, strided), InvalidArgument);
        auto u = torch::full({5}, 1.0f + comm.rank());
        comm.all_reduce(u).wait();
        EXPECT_TRUE(torch::equal(u, torch::full({5}, comm.size() * (comm.size() + 1) / 2.0f)));
      },
      options_for(c));
}

// Ring at 1 (the communicator's shortcut) and at 3 and 5-7 (the contract
// suite: up to 4); tree and hd where the contract suite stops; hierarchical
// with a node of one rank first or last, nodes of interleaved ranks, and
// pairs past 5 ranks.
std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& ew : engine_worlds({1, 3, 5, 6, 7})) {
    const int w = ew.world;
    out.push_back({ew.backend, Algorithm::Ring, w, ""});
    if (w >= 5) out.push_back({ew.backend, Algorithm::Tree, w, ""});
    if (w >= 6) out.push_back({ew.backend, Algorithm::HalvingDoubling, w, ""});
    std::vector<std::string> layouts;
    if (w == 3 || w == 6) layouts = {"first_alone", "interleaved"};
    if (w == 7) layouts = {"last_alone", "interleaved", "pairs"};
    for (const auto& l : layouts) out.push_back({ew.backend, Algorithm::Hierarchical, w, l});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Threads, AlgorithmEdges, ::testing::ValuesIn(cases()), name_of);

}  // namespace
}  // namespace cohort::testing::edges_test
