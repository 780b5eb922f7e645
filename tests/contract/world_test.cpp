// The contract suite (contract_cases.h) in the world init() finds: ranks as
// processes under mpirun (MPI) or cohortrun (Gloo). Every case runs for
// every dtype it takes on world() itself ("world_<case>_<dtype>"), and every
// algorithmic case again under each algorithm ("<algo>_<case>_<dtype>"), on
// a communicator of its own over the world's store. ctest picks which with
// --gtest_filter. With COHORT_TEST_DEVICE=cuda the tensors are CUDA tensors.
#include <gtest/gtest.h>

#include <map>

#include "cohort/cohort.h"
#include "tests/contract/contract_cases.h"
#include "tests/contract/contract_values.h"
#include "tests/support/test_device.h"

namespace cohort::testing::world_test {
namespace {

struct Param {
  Algorithm algo;  // Default: world() as init() built it
  size_t case_index;
  torch::Dtype dtype;
};

// Built on first use, in the same test order on every rank.
Communicator& communicator_for(Algorithm algo) {
  if (algo == Algorithm::Default) return world();
  static std::map<Algorithm, std::shared_ptr<Communicator>> made;
  auto& comm = made[algo];
  if (!comm) {
    // A group of every rank with the algorithm as its default, over the
    // world's transport (the same bind address, nodes, timeout).
    auto options = world().options();
    options.algorithm = algo;
    options.name = to_string(algo);
    options.calibration_max_bytes = 64 << 10;  // adaptive: a short calibration
    std::vector<int> all(static_cast<size_t>(world().size()));
    for (int r = 0; r < world().size(); ++r) all[static_cast<size_t>(r)] = r;
    comm = world().new_group(all, options);
  }
  return *comm;
}

class World : public ::testing::TestWithParam<Param> {};

TEST_P(World, Holds) {
  const auto& p = GetParam();
  const auto& c = contract_cases()[p.case_index];
  if (world().size() < c.min_world) GTEST_SKIP() << "needs " << c.min_world << " ranks";
  contract_device() = test_device();  // every rank of a one-GPU machine shares it
  c.run(communicator_for(p.algo), p.dtype);
}

std::vector<Param> all_params() {
  std::vector<Param> ps;
  for (size_t c = 0; c < contract_cases().size(); ++c) {
    const auto& k = contract_cases()[c];
    if (!k.every_dtype) {
      ps.push_back({Algorithm::Default, c, torch::kFloat32});
    } else {
      for (auto dt : kDtypes) ps.push_back({Algorithm::Default, c, dt});
    }
  }
  for (auto a : {Algorithm::Ring, Algorithm::Tree, Algorithm::HalvingDoubling,
                 Algorithm::Hierarchical, Algorithm::Engine, Algorithm::Adaptive}) {
    for (size_t c = 0; c < contract_cases().size(); ++c) {
      const auto& k = contract_cases()[c];
      if (!k.algorithmic) continue;
      ps.push_back({a, c, torch::kFloat32});
      if (k.every_dtype) ps.push_back({a, c, torch::kBFloat16});
    }
  }
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Contract, World, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           const auto& p = info.param;
                           const std::string algo =
                               p.algo == Algorithm::Default ? "world" : to_string(p.algo);
                           return algo + "_" + contract_cases()[p.case_index].name + "_" +
                                  dtype_label(p.dtype);
                         });

}  // namespace
}  // namespace cohort::testing::world_test
