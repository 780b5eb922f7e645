// The shapes are compared first (one all-gather over the world): the checks
// and group lists that follow are then the same on every rank, so a bad shape
// is an error on every rank and never a split whose groups do not match.
// The groups are built with Communicator::split, one call per dimension in a
// fixed order (TP, DP, PP, embedding), so every rank creates them in the same
// order, as split requires. The color of a group is the index of its list in
// *_groups(shape), the key the rank's place in it.
#include "cohort/mesh/device_mesh.h"

#include <algorithm>
#include <limits>

#include "cohort/core/error.h"

namespace cohort {

int64_t MeshShape::world_size() const {
  // Each factor is an int, so dp * pp fits in 64 bits; times tp may not.
  int64_t product = 0;
  if (__builtin_mul_overflow(int64_t{dp} * pp, int64_t{tp}, &product))
    return std::numeric_limits<int64_t>::max();
  return product;
}

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

// Throws on every rank when the ranks of `world` passed different shapes,
// naming each group of ranks with its shape.
void check_same_shape(Communicator& world, const MeshShape& shape, const std::string& who) {
  if (world.size() == 1) return;
  std::vector<int64_t> mine{shape.dp, shape.pp, shape.tp};
  torch::Tensor all = torch::empty({world.size() * 3}, torch::kInt64);
  world.all_gather_into_tensor(all, torch::tensor(mine, torch::kInt64)).wait();
  auto a = all.accessor<int64_t, 1>();
  std::vector<std::pair<MeshShape, std::vector<int>>> seen;  // shape, ranks, by first rank
  for (int r = 0; r < world.size(); ++r) {
    const MeshShape s{static_cast<int>(a[3 * r]), static_cast<int>(a[3 * r + 1]),
                      static_cast<int>(a[3 * r + 2])};
    auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& e) {
      return e.first.dp == s.dp && e.first.pp == s.pp && e.first.tp == s.tp;
    });
    if (it == seen.end()) it = seen.insert(seen.end(), {s, {}});
    it->second.push_back(r);
  }
  if (seen.size() == 1) return;
  std::string text;
  for (const auto& [s, ranks] : seen) {
    text += text.empty() ? "" : "; ";
    text += ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
    text += ": " + s.to_string();
  }
  throw InvalidArgument(who + "ranks disagree on the mesh shape (" + text + ")");
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<Communicator> world, MeshShape shape)
    : world_(std::move(world)), shape_(shape) {
  if (!world_) throw InvalidArgument("cohort: DeviceMesh: the world communicator is null");
  const std::string who = "cohort: DeviceMesh (rank " + std::to_string(world_->rank()) + "): ";
  check_same_shape(*world_, shape, who);
  if (shape.dp < 1 || shape.pp < 1 || shape.tp < 1) {
    throw InvalidArgument(who + "every size must be at least 1, got " + shape.to_string());
  }
  const int64_t needed = shape.world_size();
  if (needed != world_->size()) {
    const bool saturated = needed == std::numeric_limits<int64_t>::max();
    throw InvalidArgument(who + shape.to_string() + " needs " +
                          (saturated ? "2^63 or more" : std::to_string(needed)) +
                          " ranks, the world has " + std::to_string(world_->size()));
  }
  coord_ = coord_of(shape_, world_->rank());
  tp_group_ = join(*world_, tp_groups(shape_), tp_ranks_);
  dp_group_ = join(*world_, dp_groups(shape_), dp_ranks_);
  pp_group_ = join(*world_, pp_groups(shape_), pp_ranks_);
  embedding_group_ = join(*world_, embedding_groups(shape_), embedding_ranks_);
}

}  // namespace cohort
