// The Communicator contract on the MPI engine: every case of
// tests/contract/contract_cases.h for every dtype it takes, in whatever world
// mpirun started (ctest runs 1, 2, 3 and 4 ranks, and 3 ranks with
// COHORT_ALGO=ring for the algorithmic cases).
#include <gtest/gtest.h>

#include "cohort/cohort.h"
#include "tests/contract/contract_cases.h"
#include "tests/contract/contract_values.h"

namespace cohort::testing {
namespace {

struct Param {
  size_t case_index;
  torch::Dtype dtype;
};

class MpiContract : public ::testing::TestWithParam<Param> {};

TEST_P(MpiContract, Holds) {
  const auto& c = contract_cases()[GetParam().case_index];
  if (world().size() < c.min_world) GTEST_SKIP() << "needs " << c.min_world << " ranks";
  c.run(world(), GetParam().dtype);
}

std::vector<Param> all_params() {
  std::vector<Param> ps;
  for (size_t c = 0; c < contract_cases().size(); ++c) {
    if (!contract_cases()[c].every_dtype) {
      ps.push_back({c, torch::kFloat32});
      continue;
    }
    for (auto dt : kDtypes) ps.push_back({c, dt});
  }
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiContract, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return contract_cases()[info.param.case_index].name + "_" +
                                  dtype_label(info.param.dtype);
                         });

}  // namespace
}  // namespace cohort::testing
