// The zig-zag layout: chunk bounds from the closed form (the first S mod 2cp
// chunks one longer), rank r holding chunks r and 2cp-1-r, shard and unshard
// inverse of each other, gather_sequence the same as unshard over a group.
#include <gtest/gtest.h>

#include "cohort/context_parallel/layout.h"
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
  EXPECT_TRUE(
      torch::equal(layout.positions(1), torch::tensor({3, 4, 5, 6, 7, 8}, torch::kInt64)));
}

TEST(ZigZagLayout, ShardThenUnshardIsTheIdentity) {
  for (int cp : {1, 2, 3, 4}) {
    for (int64_t length : {2 * cp, 2 * cp * 2 + 1, 2 * cp * 3 + cp, 2 * cp * 5 - 1}) {
      const auto full = torch::arange(length).view({1, 1, length, 1}).expand({2, 3, length, 4});
      std::vector<torch::Tensor> shards;
      for (int r = 0; r < cp; ++r) {
        shards.push_back(shard_sequence(full, r, cp));
        // A shard's rows are its global positions.
        EXPECT_TRUE(torch::equal(shards.back()[1][2].select(-1, 3),
                                 ZigZagLayout(length, cp).positions(r)));
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

}  // namespace
}  // namespace cohort::testing::layout_test
