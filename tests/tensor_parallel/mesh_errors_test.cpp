// A DeviceMesh that cannot be built: an exception on every rank naming the
// shape(s) and the rank, never a wrapped size, an internal error or a hang.
#include <gtest/gtest.h>

#include <climits>

#include "cohort/mesh/device_mesh.h"
#include "support/rank_errors.h"

namespace cohort::testing::mesh_errors_test {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// 6 * 715827883 is 2^32 + 2: in 32 bits it wraps to 2, the world size.
TEST(MeshErrors, ProductIsNotWrapped) {
  for (const MeshShape& shape :
       {MeshShape{6, 715827883, 1}, MeshShape{INT_MAX, INT_MAX, INT_MAX}}) {
    auto errors = errors_on_every_rank(
        2, [&](std::shared_ptr<Communicator> world) { DeviceMesh mesh(world, shape); });
    for (int r = 0; r < 2; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, "DeviceMesh (rank " + std::to_string(r) + ")")) << e;
      EXPECT_TRUE(has(e, shape.to_string() + " needs ")) << e;
      EXPECT_TRUE(has(e, "ranks, the world has 2")) << e;
    }
    EXPECT_TRUE(has(errors[0], "needs 4294967298 ranks") || shape.dp == INT_MAX) << errors[0];
  }
}

class MeshDisagreement : public ::testing::TestWithParam<int> {};

// Rank 0 asks for all-TP, the others for all-DP: each shape alone is valid.
TEST_P(MeshDisagreement, ShapesThatDifferAcrossRanksAreNamed) {
  const int world = GetParam();
  auto errors = errors_on_every_rank(world, [&](std::shared_ptr<Communicator> w) {
    DeviceMesh mesh(w, w->rank() == 0 ? MeshShape{1, 1, world} : MeshShape{world, 1, 1});
  });
  std::string others = world == 2 ? "rank 1" : "ranks 1";
  for (int r = 2; r < world; ++r) others += ", " + std::to_string(r);
  const std::string w = std::to_string(world);
  for (int r = 0; r < world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "DeviceMesh (rank " + std::to_string(r) + ")")) << e;
    EXPECT_TRUE(has(e, "ranks disagree on the mesh shape")) << e;
    EXPECT_TRUE(has(e, "rank 0: dp=1 pp=1 tp=" + w)) << e;
    EXPECT_TRUE(has(e, others + ": dp=" + w + " pp=1 tp=1")) << e;
    EXPECT_FALSE(has(e, "internal error")) << e;
  }
}

// One rank's shape also fails the world check: still named as disagreement
// on every rank, not as that rank's error and the others' timeout.
TEST(MeshErrors, DisagreementWithAnInvalidShape) {
  auto errors = errors_on_every_rank(3, [&](std::shared_ptr<Communicator> w) {
    DeviceMesh mesh(w, w->rank() == 1 ? MeshShape{2, 1, 1} : MeshShape{1, 3, 1});
  });
  for (int r = 0; r < 3; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "ranks disagree on the mesh shape")) << e;
    EXPECT_TRUE(has(e, "ranks 0, 2: dp=1 pp=3 tp=1; rank 1: dp=2 pp=1 tp=1")) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, MeshDisagreement, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::mesh_errors_test
