// FlatPartition: shards are balanced to the element, chunks tile every
// bucket, and the pieces cover each parameter exactly once over all ranks.
#include "cohort/optim/flat_partition.h"

#include <gtest/gtest.h>

#include "cohort/core/error.h"

namespace cohort::flat_partition_test {
namespace {

TEST(FlatPartition, PiecesCoverEveryParameterOnceAndShardsAreBalanced) {
  const std::vector<int64_t> numels = {35, 5, 0, 15, 3, 1, 100};  // 159 elements
  const std::vector<size_t> groups = {0, 0, 0, 1, 1, 1, 2};
  for (int world : {1, 2, 3, 4, 7}) {
    for (int64_t bucket : {1, 10, 16, 1000}) {
      std::vector<std::vector<int>> covered(numels.size());
      for (size_t i = 0; i < numels.size(); ++i) covered[i].assign(numels[i], 0);
      int64_t padded = -1;
      for (int rank = 0; rank < world; ++rank) {
        FlatPartition part(numels, groups, world, rank, bucket);
        EXPECT_EQ(part.numel(), 159);
        EXPECT_EQ(part.padded_numel() % world, 0);
        EXPECT_LT(part.padded_numel() - part.numel(), world);  // padding only at the end
        if (padded >= 0) {
          EXPECT_EQ(part.padded_numel(), padded);
        }
        padded = part.padded_numel();
        int64_t in_shard = 0;
        for (const auto& b : part.buckets()) {
          EXPECT_EQ(b.chunk * world, b.padded);
          in_shard += b.chunk;
        }
        EXPECT_EQ(in_shard, part.shard_numel());
        int64_t last_end = 0;
        for (const auto& p : part.pieces()) {
          EXPECT_GE(p.shard_offset, last_end);  // ordered, disjoint
          last_end = p.shard_offset + p.numel;
          EXPECT_LE(last_end, part.shard_numel());
          EXPECT_EQ(part.params()[p.param].group, groups[p.param]);
          // The piece's flat position is inside this rank's chunk.
          const int64_t flat = part.params()[p.param].offset + p.param_offset;
          const auto& b = part.buckets()[p.bucket];
          EXPECT_EQ(flat - part.chunk_offset(p.bucket), p.shard_offset - b.shard_offset);
          for (int64_t e = 0; e < p.numel; ++e) ++covered[p.param][p.param_offset + e];
        }
      }
      for (size_t i = 0; i < numels.size(); ++i) {
        for (int64_t e = 0; e < numels[i]; ++e) {
          ASSERT_EQ(covered[i][e], 1)
              << "world " << world << " bucket " << bucket << " param " << i << " element " << e;
        }
      }
    }
  }
}

TEST(FlatPartition, RejectsBadArguments) {
  EXPECT_THROW(FlatPartition({1}, {0}, 2, 2, 16), InvalidArgument);
  EXPECT_THROW(FlatPartition({1, 2}, {0}, 1, 0, 16), InvalidArgument);
}

}  // namespace
}  // namespace cohort::flat_partition_test
