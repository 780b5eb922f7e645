// A DeviceMesh that cannot be built, or a dimension that is not there: an
// exception on every rank naming the shape(s) and the rank, never a wrapped
// size, an internal error, groups of the wrong ranks or a hang.
#include <gtest/gtest.h>

#include <climits>

#include "cohort/mesh/device_mesh.h"
#include "support/rank_errors.h"

namespace cohort::testing::mesh_errors_test {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string who(int r) { return "init_device_mesh (rank " + std::to_string(r) + ")"; }

// 6 * 715827883 is 2^32 + 2: in 32 bits it wraps to 2, the world size.
TEST(MeshErrors, ProductIsNotWrapped) {
  for (const std::vector<int>& shape :
       {std::vector<int>{6, 715827883, 1}, std::vector<int>{INT_MAX, INT_MAX, INT_MAX}}) {
    auto errors = errors_on_every_rank(2, [&](std::shared_ptr<Communicator> world) {
      init_device_mesh(world, shape, {"dp", "pp", "tp"});
    });
    const std::string text = "dp=" + std::to_string(shape[0]) + " pp=" + std::to_string(shape[1]) +
                             " tp=" + std::to_string(shape[2]);
    for (int r = 0; r < 2; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, who(r))) << e;
      EXPECT_TRUE(has(e, text + " needs ")) << e;
      EXPECT_TRUE(has(e, "ranks, the world has 2")) << e;
    }
    EXPECT_TRUE(has(errors[0], shape[0] == 6 ? "needs 4294967298 ranks" : "needs 2^63 or more"))
        << errors[0];
  }
}

// Input that is wrong alike on every rank: the same error on each.
TEST(MeshErrors, BadInputOnEveryRank) {
  struct Bad {
    std::vector<int> shape;
    std::vector<std::string> names;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {{3, 1}, {"dp", "tp"}, "dp=3 tp=1 needs 3 ranks, the world has 4"},
      {{4, 1, 0}, {"dp", "pp", "tp"}, "every size must be at least 1, got dp=4 pp=1 tp=0"},
      {{-4, -1}, {"dp", "tp"}, "every size must be at least 1, got dp=-4 tp=-1"},
      {{2, 2}, {"dp", "dp"}, "dimension name 'dp' is repeated (dp=2 dp=2)"},
      {{2, 2}, {"dp", ""}, "dimension 1 has an empty name (dp=2 \"\"=2)"},
      {{2, 2}, {"dp"}, "one name per size and at least one of each, got sizes (2, 2) names (dp)"},
      {{}, {}, "one name per size and at least one of each, got no dimensions"},
  };
  for (const auto& bad : cases) {
    auto errors = errors_on_every_rank(4, [&](std::shared_ptr<Communicator> world) {
      init_device_mesh(world, bad.shape, bad.names);
    });
    for (int r = 0; r < 4; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, who(r) + ": ")) << e;
      EXPECT_TRUE(has(e, bad.message)) << e;
    }
  }
}

class MeshDisagreement : public ::testing::TestWithParam<int> {};

// Rank 0 asks for all-TP, the others for all-DP: each shape alone is valid.
TEST_P(MeshDisagreement, ShapesThatDifferAcrossRanksAreNamed) {
  const int world = GetParam();
  auto errors = errors_on_every_rank(world, [&](std::shared_ptr<Communicator> w) {
    init_device_mesh(w, w->rank() == 0 ? std::vector<int>{1, world} : std::vector<int>{world, 1},
                     {"dp", "tp"});
  });
  std::string others = world == 2 ? "rank 1" : "ranks 1";
  for (int r = 2; r < world; ++r) others += ", " + std::to_string(r);
  const std::string w = std::to_string(world);
  for (int r = 0; r < world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, who(r))) << e;
    EXPECT_TRUE(has(e, "ranks disagree on the mesh shape")) << e;
    EXPECT_TRUE(has(e, "rank 0: dp=1 tp=" + w)) << e;
    EXPECT_TRUE(has(e, others + ": dp=" + w + " tp=1")) << e;
    EXPECT_FALSE(has(e, "internal error")) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, MeshDisagreement, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// Same sizes, names in another order on one rank: a different mesh.
TEST(MeshErrors, NamesThatDifferAcrossRanksAreNamed) {
  auto errors = errors_on_every_rank(4, [&](std::shared_ptr<Communicator> w) {
    init_device_mesh(w, {2, 2},
                     w->rank() == 3 ? std::vector<std::string>{"tp", "dp"}
                                    : std::vector<std::string>{"dp", "tp"});
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(has(errors[static_cast<size_t>(r)], "ranks 0, 1, 2: dp=2 tp=2; rank 3: tp=2 dp=2"))
        << errors[static_cast<size_t>(r)];
  }
}

// One rank's shape also fails the world check: still named as disagreement
// on every rank, not as that rank's error and the others' timeout.
TEST(MeshErrors, DisagreementWithAnInvalidShape) {
  auto errors = errors_on_every_rank(3, [&](std::shared_ptr<Communicator> w) {
    init_device_mesh(w, w->rank() == 1 ? std::vector<int>{2, 1} : std::vector<int>{3, 1},
                     {"pp", "tp"});
  });
  for (int r = 0; r < 3; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "ranks disagree on the mesh shape")) << e;
    EXPECT_TRUE(has(e, "ranks 0, 2: pp=3 tp=1; rank 1: pp=2 tp=1")) << e;
  }
}

// Names that are not the mesh's, or out of its order, are refused before any
// collective; ranks that ask for different combinations are refused on every
// rank instead of pairing their splits into groups of the wrong ranks.
TEST(MeshErrors, SubMeshes) {
  auto errors = errors_on_every_rank(4, [&](std::shared_ptr<Communicator> w) {
    auto mesh = init_device_mesh(w, {2, 1, 2}, {"dp", "cp", "tp"});
    try {
      mesh["ep"];
      ADD_FAILURE() << "an unknown dimension was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(has(e.what(), "no dimension 'ep' (the mesh has dp, cp, tp)")) << e.what();
    }
    try {
      mesh[{"tp", "dp"}];
      ADD_FAILURE() << "dimensions out of order were accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(has(e.what(), "in the mesh's order (dp, cp, tp)")) << e.what();
    }
    EXPECT_THROW(mesh[std::vector<std::string>{}], InvalidArgument);
    EXPECT_THROW(mesh["dp"]["tp"], InvalidArgument);
    EXPECT_THROW(DeviceMesh::from_group(nullptr, "dp"), InvalidArgument);
    EXPECT_THROW(DeviceMesh::from_group(w, ""), InvalidArgument);
    if (w->rank() == 2) {
      mesh[{"cp", "tp"}];
    } else {
      mesh[{"dp", "tp"}];
    }
  });
  for (int r = 0; r < 4; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "(rank " + std::to_string(r) +
                           "): ranks disagree on the dimensions asked "
                           "for (ranks 0, 1, 3: dp, tp; rank 2: cp, tp)"))
        << e;
  }
}

}  // namespace
}  // namespace cohort::testing::mesh_errors_test
