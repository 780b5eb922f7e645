// The zig-zag layout: chunk bounds from the closed form (the first S mod 2cp
// chunks one longer), rank r holding chunks r and 2cp-1-r, shard and unshard
// inverse of each other, gather_sequence the same as unshard over a group
// and, not differentiable, refused on every rank when a rank's shard
// requires grad under grad mode (a loss built on it would get no gradient
// from it), accepted under NoGradGuard.
#include "cohort/context_parallel/layout.h"

#include <gtest/gtest.h>

#include "cohort/context_parallel/block_attention.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"

namespace cohort::testing::layout_test {
namespace {

using namespace cohort::context_parallel;

TEST(ZigZagLayout, ChunksOfAnUnevenSequence) {
  const ZigZagLayout layout(11, 2);  // 4 chunks: 3, 3, 3, 2
  EXPECT_EQ(layout.chunk_length(0), 3);
  EXPECT_EQ(layout.chunk_length(2), 3);
  EXPECT_EQ(layout.chunk_length(3), 2);
  EXPECT_EQ(layout.chunk_start(3), 9);
  EXPECT_EQ(layout.local_length(0), 5);  // chunks 0 and 3
  EXPECT_EQ(layout.local_length(1), 6);  // chunks 1 and 2
  EXPECT_TRUE(torch::equal(layout.positions(0), torch::tensor({0, 1, 2, 9, 10}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(layout.positions(1), torch::tensor({3, 4, 5, 6, 7, 8}, torch::kInt64)));
}

TEST(ZigZagLayout, ShardThenUnshardIsTheIdentity) {
  for (int cp : {1, 2, 3, 4}) {
    for (int64_t length : {2 * cp, 2 * cp * 2 + 1, 2 * cp * 3 + cp, 2 * cp * 5 - 1}) {
      const auto full = torch::arange(length).view({1, 1, length, 1}).expand({2, 3, length, 4});
      std::vector<torch::Tensor> shards;
      for (int r = 0; r < cp; ++r) {
        shards.push_back(shard_sequence(full, r, cp));
        // A shard's rows are its global positions.
        EXPECT_TRUE(
            torch::equal(shards.back()[1][2].select(-1, 3), ZigZagLayout(length, cp).positions(r)));
      }
      EXPECT_TRUE(torch::equal(unshard_sequence(shards), full)) << cp << " " << length;
    }
  }
}

TEST(ZigZagLayout, TooShortASequenceIsRefused) {
  try {
    ZigZagLayout(5, 3);
    FAIL() << "a sequence of 5 over 6 chunks was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("shorter than its 2·cp = 6 chunks"), std::string::npos)
        << e.what();
  }
}

// What a rank computes of each block: of another rank's block, half its
// scores (the part in the future of both query chunks is skipped); of its
// own, three quarters (diagonal chunks whole, then masked). With chunks of c
// rows every rank computes (2cp+1)·c² scores, the same on every rank.
TEST(ZigZagLayout, EveryRankComputesTheSameScoresAndSkipsTheFuture) {
  const int64_t c = 5;
  for (int cp : {1, 2, 3, 4}) {
    const ZigZagLayout layout(2 * cp * c, cp);
    for (int r = 0; r < cp; ++r) {
      int64_t scores = 0;
      for (int j = 0; j < cp; ++j) {
        int64_t block = 0;
        for (const auto& p : visible_pieces(layout, r, j)) {
          EXPECT_GT(p.keys, 0);
          EXPECT_EQ(p.diagonal, j == r);
          block += p.rows * p.keys;
        }
        EXPECT_EQ(block, j == r ? 3 * c * c : 2 * c * c) << "cp " << cp << " " << r << "<-" << j;
        // A later rank's block is wholly in the future of the early chunk.
        if (j > r) {
          EXPECT_EQ(visible_pieces(layout, r, j).size(), 1u);
        }
        scores += block;
      }
      EXPECT_EQ(scores, (2 * cp + 1) * c * c);
    }
  }
}

TEST(ZigZagLayout, GatherSequenceOverAGroup) {
  const int64_t length = 13;
  const auto full = torch::randn({2, 3, length, 4});
  for (int cp : {1, 3}) {
    run_ranks_shared(cp, [&](std::shared_ptr<Communicator> g) {
      auto mine = shard_sequence(full, g->rank(), cp);
      EXPECT_TRUE(torch::equal(gather_sequence(mine, *g), full));
    });
  }
}

// A loss with a term on the gathered sequence: sum(x^2) + sum(gather(x)),
// whose gradient is 2x + 1. The gather passes no gradient back, so it must
// be refused on every rank (here only rank `needs_grad`'s shard requires
// grad, or every rank's when -1); accepted, how far x's gradient falls from
// 2x + 1 is the figure in the failure.
std::vector<std::string> gather_under_grad(int cp, int needs_grad) {
  const auto full = torch::randn({2, 3, 13, 4}, torch::kFloat64);
  ThreadRanksOptions o;
  o.timeout = std::chrono::seconds(5);
  return errors_on_every_rank(
      cp,
      [&](std::shared_ptr<Communicator> g) {
        auto x = shard_sequence(full, g->rank(), cp).clone();
        if (needs_grad < 0 || g->rank() == needs_grad) x.requires_grad_();
        auto loss = (x * x).sum() + gather_sequence(x, *g).sum();
        if (!x.requires_grad()) throw std::runtime_error("accepted");
        loss.backward();
        throw std::runtime_error(
            "accepted; x.grad off 2x + 1 by " +
            std::to_string((x.grad() - (2 * x.detach() + 1)).abs().max().item<double>()));
      },
      o);
}

TEST(ZigZagLayout, GatherSequenceOfAShardThatRequiresGradIsRefused) {
  for (int cp : {1, 3}) {
    for (const auto& e : gather_under_grad(cp, -1)) {
      EXPECT_TRUE(e.find("cohort: gather_sequence (rank ") != std::string::npos) << e;
      EXPECT_TRUE(e.find("not differentiable") != std::string::npos) << e;
    }
  }
}

TEST(ZigZagLayout, GatherSequenceRefusesOnEveryRankWhenOneShardRequiresGrad) {
  for (int cp : {2, 3}) {
    for (const auto& e : gather_under_grad(cp, 1)) {
      EXPECT_TRUE(e.find("cohort: gather_sequence (rank ") != std::string::npos) << e;
      EXPECT_TRUE(e.find("rank 1's shard requires grad") != std::string::npos) << e;
    }
  }
}

TEST(ZigZagLayout, GatherSequenceUnderNoGradGuardOfAShardThatRequiresGrad) {
  const auto full = torch::randn({2, 3, 13, 4});
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> g) {
    auto mine = shard_sequence(full, g->rank(), 3).requires_grad_();
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(gather_sequence(mine, *g), full));
  });
}

}  // namespace
}  // namespace cohort::testing::layout_test
