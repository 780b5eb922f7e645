// Debug mode (COHORT_DEBUG=detail) on all_to_all, both forms, over every
// engine: blocks whose sizes differ by rank (an MoE's token counts) move,
// since each rank's block to a peer has the size that peer expects from it;
// blocks that do not pair up, another dtype or another operation are a
// MismatchError on every rank, naming them, before anything moves (the
// communicator stays usable).
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "support/engine_worlds.h"
#include "support/thread_ranks.h"

namespace cohort::testing::debug_all_to_all_test {
namespace {

using namespace std::chrono_literals;

ThreadRanksOptions debug_options(const EngineWorld& on) {
  auto o = options_for(on);
  o.debug_checks = true;
  o.timeout = 10s;
  return o;
}

// Rank `from`'s block for rank `to`: (from + 1) x (to + 2) elements of
// 100 from + to, shaped [from + 1, to + 2] as sent; the receiver reads it
// flat. Its size differs by sender and by receiver.
int64_t block(int from, int to) { return (from + 1) * (to + 2); }

std::string message_of_mismatch(const std::function<void()>& call) {
  try {
    call();
  } catch (const MismatchError& e) {
    return e.what();
  }
  return "no MismatchError";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class DebugAllToAll : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DebugAllToAll, BlocksThatDifferByRankButPairUpMove) {
  run_ranks(
      GetParam().world,
      [](Communicator& comm) {
        const int n = comm.size(), me = comm.rank();
        std::vector<torch::Tensor> ins, outs;
        for (int j = 0; j < n; ++j) {
          ins.push_back(torch::full({me + 1, j + 2}, 100.0 * me + j));
          outs.push_back(torch::empty({block(j, me)}));
        }
        comm.all_to_all(outs, ins).wait();
        for (int r = 0; r < n; ++r) {
          EXPECT_TRUE(torch::equal(outs[r], torch::full({block(r, me)}, 100.0 * r + me)))
              << "rank " << me << ", from rank " << r;
        }
        // The flat form, rows of 2: rank r sends rank j block(r, j) rows.
        std::vector<int64_t> in_splits, out_splits;
        for (int j = 0; j < n; ++j) in_splits.push_back(block(me, j));
        for (int r = 0; r < n; ++r) out_splits.push_back(block(r, me));
        std::vector<torch::Tensor> parts, want;
        for (int j = 0; j < n; ++j) parts.push_back(torch::full({block(me, j), 2}, 100.0 * me + j));
        for (int r = 0; r < n; ++r) want.push_back(torch::full({block(r, me), 2}, 100.0 * r + me));
        auto out = torch::empty({torch::cat(want).size(0), 2});
        comm.all_to_all_single(out, torch::cat(parts), out_splits, in_splits).wait();
        EXPECT_TRUE(torch::equal(out, torch::cat(want))) << "rank " << me;
      },
      debug_options(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Engines, DebugAllToAll, ::testing::ValuesIn(engine_worlds({1, 2, 3})),
                         engine_world_name);

// Rank 1's block for rank 0 is one element larger than rank 0 expects from
// it: every rank names that pair, in both forms.
class DebugAllToAllMismatch : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DebugAllToAllMismatch, BlocksThatDoNotPairUpAreNamedOnEveryRank) {
  run_ranks(
      GetParam().world,
      [](Communicator& comm) {
        const int n = comm.size(), me = comm.rank();
        auto sent = [&](int j) { return block(me, j) + (me == 1 && j == 0 ? 1 : 0); };
        std::vector<torch::Tensor> ins, outs;
        for (int j = 0; j < n; ++j) {
          ins.push_back(torch::zeros({sent(j)}));
          outs.push_back(torch::empty({block(j, me)}));
        }
        const auto m = message_of_mismatch([&] { (void)comm.all_to_all(outs, ins); });
        EXPECT_TRUE(has(m,
                        "all_to_all(dtype=float32): rank 1 sends rank 0 5 elements but rank 0 "
                        "expects 4 from it: the ranks' blocks do not pair up"))
            << "rank " << me << ": " << m;
        std::vector<int64_t> in_splits, out_splits;
        for (int j = 0; j < n; ++j) in_splits.push_back(sent(j));
        for (int r = 0; r < n; ++r) out_splits.push_back(block(r, me));
        auto in = torch::zeros({std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0})});
        auto out =
            torch::empty({std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0})});
        const auto single = message_of_mismatch(
            [&] { (void)comm.all_to_all_single(out, in, out_splits, in_splits); });
        EXPECT_TRUE(has(single, "rank 1 sends rank 0 5 elements but rank 0 expects 4 from it"))
            << "rank " << me << ": " << single;
        // Nothing moved: the group goes on.
        auto t = torch::ones({2});
        comm.all_reduce(t).wait();
        EXPECT_TRUE(torch::equal(t, torch::full({2}, static_cast<float>(n))));
      },
      debug_options(GetParam()));
}

// Rank 1 passes float64, the others float32; then rank 1 broadcasts where
// the others call all_to_all.
TEST_P(DebugAllToAllMismatch, AnotherDtypeOrOperationIsNamedOnEveryRank) {
  run_ranks(
      GetParam().world,
      [](Communicator& comm) {
        const int n = comm.size(), me = comm.rank();
        const auto dtype = me == 1 ? torch::kFloat64 : torch::kFloat32;
        std::vector<torch::Tensor> ins, outs;
        for (int j = 0; j < n; ++j) {
          ins.push_back(torch::zeros({block(me, j)}, dtype));
          outs.push_back(torch::empty({block(j, me)}, dtype));
        }
        auto m = message_of_mismatch([&] { (void)comm.all_to_all(outs, ins); });
        EXPECT_TRUE(has(m, "rank 1 called all_to_all(dtype=float64)") &&
                    has(m, "called all_to_all(dtype=float32)"))
            << "rank " << me << ": " << m;
        auto t = torch::zeros({4});
        m = message_of_mismatch([&] {
          if (me == 1) {
            (void)comm.broadcast(t);
          } else {
            std::vector<torch::Tensor> fins, fouts;
            for (int j = 0; j < n; ++j) {
              fins.push_back(torch::zeros({block(me, j)}));
              fouts.push_back(torch::empty({block(j, me)}));
            }
            (void)comm.all_to_all(fouts, fins);
          }
        });
        EXPECT_TRUE(has(m, "rank 1 called broadcast(root=0, dtype=float32, shape=[4])") &&
                    has(m, "called all_to_all(dtype=float32)"))
            << "rank " << me << ": " << m;
      },
      debug_options(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Engines, DebugAllToAllMismatch, ::testing::ValuesIn(engine_worlds({2, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::debug_all_to_all_test
