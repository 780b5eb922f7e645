// distributed_sampler on a DeviceMesh (and the DistributedSampler
// constructor with the data-parallel group under it): each rank takes the
// replica of its "dp" coordinate, so the ranks of one tensor-parallel group
// deal the same samples, index for index PyTorch's DistributedSampler with
// num_replicas = dp and rank = the coordinate (the closed formula without
// shuffle; with it, the sampler that tests/data/sampler_test.cpp compares
// with PyTorch's). Explicit ranks that give a tensor-parallel group's ranks
// different replicas (rank = world rank % dp on a dp-major mesh, the
// mistake the world-communicator constructor cannot see: each replica is
// still taken by two ranks) are refused on every rank, naming the
// data-parallel rank whose ranks differ; on a tp-major mesh the same
// formula is the dp coordinate and passes. Settings apart on one
// tensor-parallel peer are refused over the whole mesh. Ranks as threads,
// every engine, meshes of 1 to 6 ranks.
#include "cohort/mesh/mesh_sampler.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "support/engine_worlds.h"
#include "support/rank_errors.h"

namespace cohort::testing::mesh_sampler_test {
namespace {

using data::DistributedSampler;
using data::DistributedSamplerOptions;

constexpr size_t kSize = 11;  // no multiple of 2 or 3: padded or cut

struct Case {
  std::string backend;
  int dp, tp;
  bool dp_major;  // mesh {"dp", "tp"}; else {"tp", "dp"}
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.backend + "_dp" + std::to_string(c.dp) + "_tp" + std::to_string(c.tp) +
         (c.dp_major ? "_dp_major" : "_tp_major");
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " dp " << c.dp << " tp " << c.tp << (c.dp_major ? " dp-major" : " tp-major");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& e : engine_worlds({1})) {
    for (auto [dp, tp] : std::vector<std::pair<int, int>>{{1, 1}, {3, 1}, {1, 3}, {2, 2}, {3, 2}}) {
      out.push_back({e.backend, dp, tp, true});
      if (dp > 1 && tp > 1) out.push_back({e.backend, dp, tp, false});
    }
  }
  return out;
}

DeviceMesh mesh_of(const Case& c, std::shared_ptr<Communicator> world) {
  return c.dp_major ? init_device_mesh(std::move(world), {c.dp, c.tp}, {"dp", "tp"})
                    : init_device_mesh(std::move(world), {c.tp, c.dp}, {"tp", "dp"});
}

ThreadRanksOptions options_of(const Case& c) {
  ThreadRanksOptions o;
  o.backend = c.backend;
  o.timeout = std::chrono::seconds(3);
  return o;
}

class MeshSampler : public ::testing::TestWithParam<Case> {};

// PyTorch's formulas without shuffle: rank r of R takes (r + k R) mod n for
// k < ceil(n / R), or k < floor(n / R) with drop_last.
TEST_P(MeshSampler, EachRankDealsItsDataParallelCoordinatesShare) {
  const Case c = GetParam();
  const int world = c.dp * c.tp;
  std::vector<int> coordinate(world);
  std::vector<std::vector<size_t>> ordered(world), dropped(world), shuffled(world);
  run_ranks_shared(
      world,
      [&](std::shared_ptr<Communicator> comm) {
        const auto mesh = mesh_of(c, comm);
        const auto r = static_cast<size_t>(comm->rank());
        coordinate[r] = mesh.local_rank("dp");
        DistributedSamplerOptions o;
        o.shuffle = false;
        ordered[r] = distributed_sampler(kSize, mesh, "dp", o).indices();
        o.drop_last = true;
        dropped[r] = distributed_sampler(kSize, mesh, "dp", o).indices();
        DistributedSamplerOptions s;
        s.seed = 3;
        auto sampler = distributed_sampler(kSize, mesh, "dp", s);
        sampler.set_epoch(2);
        shuffled[r] = sampler.indices();
      },
      options_of(c));
  const size_t R = static_cast<size_t>(c.dp);
  for (int rank = 0; rank < world; ++rank) {
    const auto r = static_cast<size_t>(rank);
    const auto dp_rank = static_cast<size_t>(coordinate[r]);
    std::vector<size_t> padded, cut;
    for (size_t k = 0; k < (kSize + R - 1) / R; ++k) padded.push_back((dp_rank + k * R) % kSize);
    for (size_t k = 0; k < kSize / R; ++k) cut.push_back(dp_rank + k * R);
    EXPECT_EQ(ordered[r], padded) << "rank " << rank;
    EXPECT_EQ(dropped[r], cut) << "rank " << rank;
    DistributedSamplerOptions plain;
    plain.num_replicas = c.dp;
    plain.rank = coordinate[r];
    plain.seed = 3;
    DistributedSampler alone(kSize, plain);
    alone.set_epoch(2);
    EXPECT_EQ(shuffled[r], alone.indices()) << "rank " << rank;
  }
}

// rank = world rank % dp, num_replicas = dp: on a dp-major mesh the ranks of
// one tensor-parallel group ask for different replicas (each replica is
// still taken by tp ranks); on a tp-major one it is the dp coordinate.
TEST_P(MeshSampler, WorldRankModuloDpIsRefusedUnlessItIsTheCoordinate) {
  const Case c = GetParam();
  const int world = c.dp * c.tp;
  const auto errors = errors_on_every_rank(
      world,
      [&](std::shared_ptr<Communicator> comm) {
        const auto mesh = mesh_of(c, comm);
        DistributedSamplerOptions o;
        o.num_replicas = c.dp;
        o.rank = comm->rank() % c.dp;
        try {
          distributed_sampler(kSize, mesh, "dp", o);
        } catch (const InvalidArgument& e) {
          throw std::runtime_error(std::string("InvalidArgument: ") + e.what());
        }
      },
      options_of(c));
  // The formula is the coordinate when dp is the last dimension or either
  // size is 1.
  const bool right = !c.dp_major || c.dp == 1 || c.tp == 1;
  for (int r = 0; r < world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    if (right) {
      EXPECT_EQ(e, kNoError) << "rank " << r;
      continue;
    }
    EXPECT_EQ(e.rfind("InvalidArgument: DistributedSampler on rank " + std::to_string(r), 0), 0u)
        << e;
    // Data-parallel rank 0 is world ranks 0 .. tp - 1, which ask for
    // replicas 0 .. tp - 1 (mod dp).
    std::string ranks = "ranks ", replicas = "replicas ";
    for (int i = 0; i < c.tp; ++i) ranks += (i ? ", " : "") + std::to_string(i);
    for (int i = 0; i < std::min(c.tp, c.dp); ++i) replicas += (i ? ", " : "") + std::to_string(i);
    EXPECT_NE(e.find("data-parallel rank 0 (" + ranks + ") asks for " + replicas),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("would train on different ones"), std::string::npos) << e;
  }
}

// The last rank's seed apart: its data-parallel group may hold no other
// rank (tp > 1, dp 1), so only the agreement over the whole mesh sees it.
TEST_P(MeshSampler, SettingsApartOnATensorParallelPeerAreRefusedOverTheMesh) {
  const Case c = GetParam();
  const int world = c.dp * c.tp;
  const auto errors = errors_on_every_rank(
      world,
      [&](std::shared_ptr<Communicator> comm) {
        const auto mesh = mesh_of(c, comm);
        DistributedSamplerOptions o;
        o.seed = comm->rank() == world - 1 ? 9 : 0;
        distributed_sampler(kSize, mesh, "dp", o);
      },
      options_of(c));
  for (int r = 0; r < world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    if (world == 1) {
      EXPECT_EQ(e, kNoError);
      continue;
    }
    EXPECT_NE(e.find("seed ("), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find("rank " + std::to_string(world - 1) + ": 9"), std::string::npos) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, MeshSampler, ::testing::ValuesIn(cases()), name_of);

}  // namespace
}  // namespace cohort::testing::mesh_sampler_test
