// The dim-0 layout, alone: copy_in then a reduce-scatter's sum, and a
// gather's copy_out, against the closed forms of which rows each rank holds,
// for shapes that do and do not divide by the world size (0-d, empty, fewer
// rows than ranks).
#include "cohort/fsdp/shard_layout.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace cohort::fsdp::shard_layout_test {
namespace {

std::vector<torch::Tensor> shapes() {
  return {torch::arange(7 * 3, torch::kFloat).view({7, 3}), torch::tensor(5.0f),
          torch::arange(2, torch::kFloat) + 100, torch::zeros({0, 4}),
          torch::arange(8, torch::kFloat).view({4, 2}) - 50};
}

class Layout : public ::testing::TestWithParam<int> {};

TEST_P(Layout, RowsPerRankFollowTheCeilingRule) {
  const int world = GetParam();
  auto params = shapes();
  for (int rank = 0; rank < world; ++rank) {
    auto layout = make_shard_layout(params, world, rank);
    int64_t shard = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = layout.params[i];
      const int64_t rows = params[i].dim() == 0 ? 1 : params[i].size(0);
      const int64_t chunk = (rows + world - 1) / world;
      EXPECT_EQ(p.chunk_rows, chunk);
      EXPECT_EQ(p.local_rows, std::max<int64_t>(0, std::min(chunk, rows - rank * chunk)));
      EXPECT_EQ(p.shard_offset, shard);
      shard += chunk * p.row_numel;
    }
    EXPECT_EQ(layout.shard_numel, shard);
  }
}

TEST_P(Layout, GatheredShardsRebuildTheParameters) {
  const int world = GetParam();
  auto params = shapes();
  // Every rank's flat shard, laid end to end: an all-gather's output.
  std::vector<torch::Tensor> shards;
  ShardLayout layout;
  for (int rank = 0; rank < world; ++rank) {
    layout = make_shard_layout(params, world, rank);
    auto flat = torch::full({layout.shard_numel}, -1.0f);
    for (size_t i = 0; i < params.size(); ++i)
      copy_local_rows(layout.params[i], rank, params[i], flat);
    shards.push_back(flat);
  }
  auto gathered = torch::cat(shards);
  std::vector<torch::Tensor> full;
  for (const auto& p : params) full.push_back(torch::full_like(p, -7.0f));
  copy_out(layout, gathered, full);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(full[i], params[i])) << i;
}

TEST_P(Layout, CopyInPutsEachRanksRowsInItsSegment) {
  const int world = GetParam();
  auto grads = shapes();
  grads[2] = torch::Tensor();  // no gradient: zeros
  auto layout = make_shard_layout(shapes(), world, 0);
  auto flat = torch::full({world * layout.shard_numel}, -1.0f);
  copy_in(layout, grads, flat);
  auto segments = flat.view({world, layout.shard_numel});
  for (int rank = 0; rank < world; ++rank) {
    auto mine = make_shard_layout(shapes(), world, rank);
    auto expected = torch::zeros({layout.shard_numel});
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) copy_local_rows(mine.params[i], rank, grads[i], expected);
    }
    EXPECT_TRUE(torch::equal(segments[rank], expected)) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, Layout, ::testing::Values(1, 2, 3, 4, 8));

}  // namespace
}  // namespace cohort::fsdp::shard_layout_test
