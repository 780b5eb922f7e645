// FlatPartition: shards are balanced to the element, chunks tile every
// bucket, and the pieces cover each parameter exactly once over all ranks
// (one of no elements: a piece of rank 0).
#include "cohort/optim/flat_partition.h"

#include <gtest/gtest.h>

#include "cohort/core/error.h"

namespace cohort::flat_partition_test {
namespace {

TEST(FlatPartition, PiecesCoverEveryParameterOnceAndShardsAreBalanced) {
  const std::vector<int64_t> numels = {35, 5, 0, 15, 3, 1, 100, 0};  // 159 elements
  const std::vector<size_t> groups = {0, 0, 0, 1, 1, 1, 2, 2};
  for (int world : {1, 2, 3, 4, 7}) {
    for (int64_t bucket : {1, 10, 16, 1000}) {
      std::vector<std::vector<int>> covered(numels.size());
      std::vector<int> zero_pieces(numels.size(), 0);
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
          if (numels[p.param] == 0) {
            // Rank 0's, once, inside its chunk of the bucket where it lies.
            EXPECT_EQ(rank, 0);
            ++zero_pieces[p.param];
            const auto& b = part.buckets()[p.bucket];
            EXPECT_LE(b.offset, part.params()[p.param].offset);
            EXPECT_LE(p.shard_offset - b.shard_offset, b.chunk);
            continue;
          }
          // The piece's flat position is inside this rank's chunk.
          const int64_t flat = part.params()[p.param].offset + p.param_offset;
          const auto& b = part.buckets()[p.bucket];
          EXPECT_EQ(flat - part.chunk_offset(p.bucket), p.shard_offset - b.shard_offset);
          for (int64_t e = 0; e < p.numel; ++e) ++covered[p.param][p.param_offset + e];
        }
      }
      for (size_t i = 0; i < numels.size(); ++i) {
        EXPECT_EQ(zero_pieces[i], numels[i] == 0 ? 1 : 0) << "param " << i;
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
