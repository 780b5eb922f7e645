// DeviceMesh: every rank's groups equal the closed form (TP fastest, then DP,
// then PP), and each group communicator really connects those ranks: an
// all-reduce of the world ranks over it sums exactly the expected ranks.
#include <gtest/gtest.h>

#include <numeric>

#include "cohort/mesh/device_mesh.h"
#include "support/thread_ranks.h"

namespace cohort::testing::mesh_test {
namespace {

std::string shape_name(const ::testing::TestParamInfo<MeshShape>& info) {
  const auto& s = info.param;
  return "dp" + std::to_string(s.dp) + "_pp" + std::to_string(s.pp) + "_tp" + std::to_string(s.tp);
}

// The world rank at (d, p, t), written out independently of rank_of.
int expected_rank(const MeshShape& s, int d, int p, int t) { return (p * s.dp + d) * s.tp + t; }

int64_t sum_over(Communicator& group, int rank) {
  auto t = torch::tensor({static_cast<int64_t>(rank)});
  group.all_reduce(t).wait();
  return t.item<int64_t>();
}

int64_t sum_of(const std::vector<int>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

class Mesh : public ::testing::TestWithParam<MeshShape> {};

TEST_P(Mesh, GroupsMatchClosedForm) {
  const auto s = GetParam();
  run_ranks_shared(s.world_size(), [&](std::shared_ptr<Communicator> world) {
    DeviceMesh mesh(world, s);
    const int r = world->rank();
    const int t = r % s.tp, d = (r / s.tp) % s.dp, p = r / (s.tp * s.dp);
    EXPECT_EQ(mesh.tp_rank(), t);
    EXPECT_EQ(mesh.dp_rank(), d);
    EXPECT_EQ(mesh.pp_rank(), p);
    EXPECT_EQ(mesh.is_pp_first(), p == 0);
    EXPECT_EQ(mesh.is_pp_last(), p == s.pp - 1);

    std::vector<int> tp, dp, pp;
    for (int i = 0; i < s.tp; ++i) tp.push_back(expected_rank(s, d, p, i));
    for (int i = 0; i < s.dp; ++i) dp.push_back(expected_rank(s, i, p, t));
    for (int i = 0; i < s.pp; ++i) pp.push_back(expected_rank(s, d, i, t));
    std::vector<int> emb;
    if (s.pp == 1) {
      emb = {r};
    } else if (p == 0 || p == s.pp - 1) {
      emb = {expected_rank(s, d, 0, t), expected_rank(s, d, s.pp - 1, t)};
    }
    EXPECT_EQ(mesh.tp_ranks(), tp);
    EXPECT_EQ(mesh.dp_ranks(), dp);
    EXPECT_EQ(mesh.pp_ranks(), pp);
    EXPECT_EQ(mesh.embedding_ranks(), emb);

    ASSERT_TRUE(mesh.tp_group() && mesh.dp_group() && mesh.pp_group());
    EXPECT_EQ(mesh.tp_group()->rank(), t);
    EXPECT_EQ(mesh.dp_group()->rank(), d);
    EXPECT_EQ(mesh.pp_group()->rank(), p);
    EXPECT_EQ(sum_over(*mesh.tp_group(), r), sum_of(tp));
    EXPECT_EQ(sum_over(*mesh.dp_group(), r), sum_of(dp));
    EXPECT_EQ(sum_over(*mesh.pp_group(), r), sum_of(pp));
    EXPECT_EQ(mesh.in_embedding_group(), !emb.empty());
    if (mesh.in_embedding_group()) {
      EXPECT_EQ(sum_over(*mesh.embedding_group(), r), sum_of(emb));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, Mesh,
                         ::testing::Values(MeshShape{1, 1, 1}, MeshShape{3, 2, 1},
                                           MeshShape{1, 1, 4}, MeshShape{1, 4, 1},
                                           MeshShape{2, 1, 2}, MeshShape{1, 3, 2},
                                           MeshShape{2, 2, 2}),
                         shape_name);

TEST(MeshStatic, GroupListsPartitionTheWorld) {
  const MeshShape s{2, 3, 2};
  for (const auto& groups :
       {DeviceMesh::tp_groups(s), DeviceMesh::dp_groups(s), DeviceMesh::pp_groups(s)}) {
    std::vector<int> all;
    for (const auto& g : groups) all.insert(all.end(), g.begin(), g.end());
    std::sort(all.begin(), all.end());
    std::vector<int> world(12);
    std::iota(world.begin(), world.end(), 0);
    EXPECT_EQ(all, world);
  }
  EXPECT_EQ(DeviceMesh::tp_groups(s)[1], (std::vector<int>{2, 3}));
  EXPECT_EQ(DeviceMesh::dp_groups(s)[2], (std::vector<int>{4, 6}));
  EXPECT_EQ(DeviceMesh::pp_groups(s)[0], (std::vector<int>{0, 4, 8}));
  EXPECT_EQ(DeviceMesh::embedding_groups(s)[3], (std::vector<int>{3, 11}));
  for (int r = 0; r < 12; ++r) EXPECT_EQ(DeviceMesh::rank_of(s, DeviceMesh::coord_of(s, r)), r);
}

TEST(MeshErrors, ProductMustBeTheWorldSize) {
  run_ranks_shared(4, [](std::shared_ptr<Communicator> world) {
    try {
      DeviceMesh mesh(world, {3, 1, 1});
      FAIL() << "a 3-rank mesh over 4 ranks was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("dp=3 pp=1 tp=1 needs 3 ranks, the world has 4"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(DeviceMesh(world, {4, 1, 0}), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::testing::mesh_test
