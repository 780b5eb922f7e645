// The groups are built with Communicator::split, one call per dimension in a
// fixed order (TP, DP, PP, embedding), so every rank creates them in the same
// order, as split requires. The color of a group is the index of its list in
// *_groups(shape), the key the rank's place in it.
#include "cohort/mesh/device_mesh.h"

#include <algorithm>

#include "cohort/core/error.h"

namespace cohort {

std::string MeshShape::to_string() const {
  return "dp=" + std::to_string(dp) + " pp=" + std::to_string(pp) + " tp=" + std::to_string(tp);
}

int DeviceMesh::rank_of(const MeshShape& s, const MeshCoord& c) {
  return c.pp_rank * (s.dp * s.tp) + c.dp_rank * s.tp + c.tp_rank;
}

MeshCoord DeviceMesh::coord_of(const MeshShape& s, int rank) {
  MeshCoord c;
  c.tp_rank = rank % s.tp;
  c.dp_rank = (rank / s.tp) % s.dp;
  c.pp_rank = rank / (s.tp * s.dp);
  return c;
}

std::vector<std::vector<int>> DeviceMesh::tp_groups(const MeshShape& s) {
  std::vector<std::vector<int>> groups;
  for (int p = 0; p < s.pp; ++p) {
    for (int d = 0; d < s.dp; ++d) {
      std::vector<int> g;
      for (int t = 0; t < s.tp; ++t) g.push_back(rank_of(s, {d, p, t}));
      groups.push_back(g);
    }
  }
  return groups;
}

std::vector<std::vector<int>> DeviceMesh::dp_groups(const MeshShape& s) {
  std::vector<std::vector<int>> groups;
  for (int p = 0; p < s.pp; ++p) {
    for (int t = 0; t < s.tp; ++t) {
      std::vector<int> g;
      for (int d = 0; d < s.dp; ++d) g.push_back(rank_of(s, {d, p, t}));
      groups.push_back(g);
    }
  }
  return groups;
}

std::vector<std::vector<int>> DeviceMesh::pp_groups(const MeshShape& s) {
  std::vector<std::vector<int>> groups;
  for (int d = 0; d < s.dp; ++d) {
    for (int t = 0; t < s.tp; ++t) {
      std::vector<int> g;
      for (int p = 0; p < s.pp; ++p) g.push_back(rank_of(s, {d, p, t}));
      groups.push_back(g);
    }
  }
  return groups;
}

std::vector<std::vector<int>> DeviceMesh::embedding_groups(const MeshShape& s) {
  std::vector<std::vector<int>> groups;
  for (const auto& pp : pp_groups(s)) {
    if (pp.size() == 1) {
      groups.push_back(pp);
    } else {
      groups.push_back({pp.front(), pp.back()});
    }
  }
  return groups;
}

namespace {

// Finds `rank` in `groups`: (group index, position), or (-1, -1).
std::pair<int, int> locate(const std::vector<std::vector<int>>& groups, int rank) {
  for (size_t g = 0; g < groups.size(); ++g) {
    auto it = std::find(groups[g].begin(), groups[g].end(), rank);
    if (it != groups[g].end()) {
      return {static_cast<int>(g), static_cast<int>(it - groups[g].begin())};
    }
  }
  return {-1, -1};
}

// Joins this rank's group of `groups` (collective over `world`).
std::shared_ptr<Communicator> join(Communicator& world, const std::vector<std::vector<int>>& groups,
                                   std::vector<int>& ranks_out) {
  const auto [color, key] = locate(groups, world.rank());
  auto group = world.split(color, key);
  ranks_out = color < 0 ? std::vector<int>{} : groups[static_cast<size_t>(color)];
  COHORT_CHECK(color < 0 || (group && group->size() == static_cast<int>(ranks_out.size()) &&
                             group->rank() == key),
               "mesh group does not match its closed form");
  return group;
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<Communicator> world, MeshShape shape)
    : world_(std::move(world)), shape_(shape) {
  if (!world_) throw InvalidArgument("cohort: DeviceMesh: the world communicator is null");
  if (shape.dp < 1 || shape.pp < 1 || shape.tp < 1) {
    throw InvalidArgument("cohort: DeviceMesh (rank " + std::to_string(world_->rank()) +
                          "): every size must be at least 1, got " + shape.to_string());
  }
  if (shape.world_size() != world_->size()) {
    throw InvalidArgument("cohort: DeviceMesh (rank " + std::to_string(world_->rank()) + "): " +
                          shape.to_string() + " needs " + std::to_string(shape.world_size()) +
                          " ranks, the world has " + std::to_string(world_->size()));
  }
  coord_ = coord_of(shape_, world_->rank());
  tp_group_ = join(*world_, tp_groups(shape_), tp_ranks_);
  dp_group_ = join(*world_, dp_groups(shape_), dp_ranks_);
  pp_group_ = join(*world_, pp_groups(shape_), pp_ranks_);
  embedding_group_ = join(*world_, embedding_groups(shape_), embedding_ranks_);
}

}  // namespace cohort
