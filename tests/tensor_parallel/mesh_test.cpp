// DeviceMesh: every rank's coordinates and the ranks of each of its groups
// (one dimension, and every combination of two or more) equal the row-major
// closed form, and each group communicator really connects those ranks: an
// all-reduce of a rank-dependent value over it gives the closed-form sum.
#include <gtest/gtest.h>

#include "cohort/mesh/device_mesh.h"
#include "support/thread_ranks.h"

namespace cohort::testing::mesh_test {
namespace {

struct Case {
  std::vector<int> shape;
  std::vector<std::string> names;
};

std::string to_string(const Case& c) {
  std::string s;
  for (size_t i = 0; i < c.shape.size(); ++i) {
    s += (i ? "_" : "") + c.names[i] + std::to_string(c.shape[i]);
  }
  return s;
}

// What a failure prints as the case.
void PrintTo(const Case& c, std::ostream* os) { *os << to_string(c); }

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return to_string(info.param); }

int world_of(const std::vector<int>& shape) {
  int n = 1;
  for (int s : shape) n *= s;
  return n;
}

// The stride of dimension k: the product of the sizes after it.
int stride(const std::vector<int>& shape, size_t k) {
  int n = 1;
  for (size_t i = k + 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// Rank r's group over `dims` (ascending), written out independently of the
// library: vary those coordinates row-major, keep the others.
std::vector<int> expected_group(const std::vector<int>& shape, int r,
                                const std::vector<size_t>& dims) {
  std::vector<int> ranks = {r};
  for (size_t k : dims) {
    const int own = (r / stride(shape, k)) % shape[k];
    std::vector<int> next;
    for (int base : ranks) {
      for (int c = 0; c < shape[k]; ++c) next.push_back(base + (c - own) * stride(shape, k));
    }
    ranks = next;
  }
  return ranks;
}

// The sum over `group` of 1000 + r^2 (r: the world rank), against the same
// sum over the expected ranks.
void expect_sum(Communicator& group, int r, const std::vector<int>& ranks) {
  auto t = torch::tensor({int64_t{1000} + r * r});
  group.all_reduce(t).wait();
  int64_t want = 0;
  for (int q : ranks) want += int64_t{1000} + q * q;
  EXPECT_EQ(t.item<int64_t>(), want) << "rank " << r;
}

// Holds every rank's mesh until all ranks are done: a rank that returned
// first would otherwise close its groups while a slower peer still sets
// their connections up, which that peer reports as "connection closed".
class KeepMeshes {
 public:
  explicit KeepMeshes(int size) : meshes_(static_cast<size_t>(size)) {}
  void keep(int rank, const DeviceMesh& mesh) {
    meshes_[static_cast<size_t>(rank)] = std::make_shared<DeviceMesh>(mesh);
  }

 private:
  std::vector<std::shared_ptr<DeviceMesh>> meshes_;
};

class Mesh : public ::testing::TestWithParam<Case> {};

TEST_P(Mesh, GroupsMatchClosedForm) {
  const auto c = GetParam();
  const size_t n = c.shape.size();
  KeepMeshes meshes(world_of(c.shape));
  run_ranks_shared(world_of(c.shape), [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, c.shape, c.names);
    const int r = world->rank();
    meshes.keep(r, mesh);
    EXPECT_EQ(mesh.dim_names(), c.names);
    EXPECT_EQ(mesh.shape(), c.shape);
    EXPECT_EQ(mesh.size(), world_of(c.shape));
    EXPECT_EQ(mesh.rank(), r);
    EXPECT_EQ(mesh.process_group()->size(), world->size());
    for (size_t k = 0; k < n; ++k) {
      const int coord = (r / stride(c.shape, k)) % c.shape[k];
      EXPECT_EQ(mesh.local_rank(c.names[k]), coord);
      EXPECT_EQ(mesh.coordinate()[k], coord);
      EXPECT_EQ(mesh.size(c.names[k]), c.shape[k]);
      auto dim = mesh[c.names[k]];
      EXPECT_EQ(dim.dim_names(), std::vector<std::string>{c.names[k]});
      EXPECT_EQ(dim.rank(), coord);
      ASSERT_TRUE(dim.process_group());
      EXPECT_EQ(dim.process_group()->rank(), coord);
      EXPECT_EQ(dim.process_group()->size(), c.shape[k]);
      EXPECT_EQ(dim.group_ranks(), expected_group(c.shape, r, {k}));
      expect_sum(*dim.process_group(), r, expected_group(c.shape, r, {k}));
    }
    // Every combination of two or more dimensions, in the same order on every rank.
    for (unsigned subset = 1; subset < (1u << n); ++subset) {
      std::vector<size_t> dims;
      std::vector<std::string> names;
      for (size_t k = 0; k < n; ++k) {
        if (subset & (1u << k)) dims.push_back(k), names.push_back(c.names[k]);
      }
      if (dims.size() < 2) continue;
      auto sub = mesh[names];
      const auto want = expected_group(c.shape, r, dims);
      EXPECT_EQ(sub.dim_names(), names);
      EXPECT_EQ(sub.group_ranks(), want);
      const int pos = static_cast<int>(std::find(want.begin(), want.end(), r) - want.begin());
      EXPECT_EQ(sub.rank(), pos);
      EXPECT_EQ(sub.process_group()->rank(), pos);
      EXPECT_EQ(sub.process_group()->size(), static_cast<int>(want.size()));
      expect_sum(*sub.process_group(), r, want);
      // A dimension of the sub-mesh is the mesh's own group, not a new one.
      EXPECT_EQ(sub[names.back()].process_group(), mesh[names.back()].process_group());
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, Mesh,
                         ::testing::Values(Case{{1}, {"dp"}}, Case{{3, 1}, {"dp", "tp"}},
                                           Case{{1, 3}, {"dp", "tp"}}, Case{{2, 2}, {"dp", "tp"}},
                                           Case{{2, 3}, {"dp", "tp"}}, Case{{3, 2}, {"dp", "tp"}},
                                           Case{{2, 2, 2}, {"pp", "dp", "tp"}},
                                           Case{{2, 1, 2, 2}, {"pp", "dp", "cp", "tp"}}),
                         case_name);

// The old (dp, pp, tp) layout, TP fastest then DP then PP, is the mesh
// (pp, dp, tp): rank = (p * dp + d) * tp + t.
TEST(MeshLayout, PipelineDataTensorOrder) {
  const int dp = 2, pp = 3, tp = 2;
  KeepMeshes meshes(dp * pp * tp);
  run_ranks_shared(dp * pp * tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {pp, dp, tp}, {"pp", "dp", "tp"});
    const int r = world->rank();
    meshes.keep(r, mesh);
    const int p = mesh.local_rank("pp"), d = mesh.local_rank("dp"), t = mesh.local_rank("tp");
    EXPECT_EQ((p * dp + d) * tp + t, r);
    std::vector<int> tp_ranks, pp_ranks;
    for (int i = 0; i < tp; ++i) tp_ranks.push_back((p * dp + d) * tp + i);
    for (int i = 0; i < pp; ++i) pp_ranks.push_back((i * dp + d) * tp + t);
    EXPECT_EQ(mesh["tp"].group_ranks(), tp_ranks);
    EXPECT_EQ(mesh["pp"].group_ranks(), pp_ranks);
    expect_sum(*mesh["tp"].process_group(), r, tp_ranks);
    expect_sum(*mesh["pp"].process_group(), r, pp_ranks);
  });
}

TEST(MeshFromGroup, OneDimensionOverTheGroup) {
  for (int world_size : {1, 3}) {
    run_ranks_shared(world_size, [&](std::shared_ptr<Communicator> world) {
      auto mesh = DeviceMesh::from_group(world, "dp");
      EXPECT_EQ(mesh.process_group(), world);
      EXPECT_EQ(mesh["dp"].process_group(), world);
      EXPECT_EQ(mesh.dim_names(), std::vector<std::string>{"dp"});
      EXPECT_EQ(mesh.size("dp"), world_size);
      EXPECT_EQ(mesh.local_rank("dp"), world->rank());
      std::vector<int> all;
      for (int i = 0; i < world_size; ++i) all.push_back(i);
      EXPECT_EQ(mesh.group_ranks(), all);
      expect_sum(*mesh.process_group(), world->rank(), all);
    });
  }
}

}  // namespace
}  // namespace cohort::testing::mesh_test
