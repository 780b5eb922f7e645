// The contract suite (contract_cases.h) with ranks as threads over Gloo and,
// when built, UCX:
// every case at world 1..4 with the engine's own collectives, and every
// algorithmic case under ring and tree at world 1..4, halving-doubling and
// hierarchical (two fake hosts) at world 1..5 (5: a non-power-of-two
// remainder, uneven hosts), adaptive at world 2 and 3; each case over every
// dtype it takes; and every case under the debug check (COHORT_DEBUG=detail)
// at world 2 and 3. ctest runs one entry per algorithm and world.
#include <gtest/gtest.h>

#include "support/thread_ranks.h"
#include "tests/contract/contract_cases.h"
#include "tests/contract/contract_values.h"

namespace cohort::testing::threads_test {
namespace {

struct Param {
  std::string backend;
  Algorithm algo;
  int world;
  size_t case_index;
  torch::Dtype dtype;
  bool debug = false;  // COHORT_DEBUG=detail's check before every collective
};

const ContractCase& case_of(const Param& p) { return contract_cases()[p.case_index]; }

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  const auto& p = info.param;
  std::string dtype = dtype_label(p.dtype);
  return (p.debug ? "debug" : to_string(p.algo)) + "_world" + std::to_string(p.world) + "_" +
         case_of(p).name + "_" + dtype;
}

class Contract : public ::testing::TestWithParam<Param> {};

TEST_P(Contract, Holds) {
  const auto& p = GetParam();
  ThreadRanksOptions o;
  o.backend = p.backend;
  o.algorithm = p.algo;
  o.debug_checks = p.debug;
  // Hierarchical gets fake hosts (ranks 0,1 | 2,3 | 4) to exercise the node
  // reduce, the leaders' ring and the node broadcast.
  if (p.algo == Algorithm::Hierarchical)
    o.node_of = [](int r) { return "host" + std::to_string(r / 2); };
  // Adaptive calibrates every new communicator: small sizes keep it short.
  if (p.algo == Algorithm::Adaptive) o.calibration_max_bytes = 16 << 10;
  auto body = [&](Communicator& comm) { case_of(p).run(comm, p.dtype); };
  run_ranks(p.world, body, o);
}

std::vector<Param> all_params(const std::string& backend) {
  std::vector<Param> ps;
  auto add = [&](Algorithm a, int world, const std::vector<torch::Dtype>& dtypes) {
    for (size_t c = 0; c < contract_cases().size(); ++c) {
      const auto& k = contract_cases()[c];
      if (world < k.min_world || (a != Algorithm::Engine && !k.algorithmic)) continue;
      if (!k.every_dtype) {
        ps.push_back({backend, a, world, c, torch::kFloat32});
        continue;
      }
      for (auto dt : dtypes) ps.push_back({backend, a, world, c, dt});
    }
  };
  for (int w = 1; w <= 4; ++w) add(Algorithm::Engine, w, kDtypes);
  for (auto a : {Algorithm::Ring, Algorithm::Tree}) {
    for (int w = 1; w <= 4; ++w) add(a, w, kDtypes);
  }
  for (auto a : {Algorithm::HalvingDoubling, Algorithm::Hierarchical}) {
    for (int w = 1; w <= 5; ++w) add(a, w, kDtypes);
  }
  for (int w : {2, 3}) add(Algorithm::Adaptive, w, {torch::kFloat32, torch::kBFloat16});
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Gloo, Contract, ::testing::ValuesIn(all_params("gloo")), name_of);

// The debug check passes every case (no MismatchError for calls that are
// right: an all_to_all's blocks, say, differ in size by rank), float32 at
// worlds 2 and 3 with the engine's collectives.
std::vector<Param> debug_params() {
  std::vector<Param> ps;
  for (int w : {2, 3}) {
    for (size_t c = 0; c < contract_cases().size(); ++c) {
      if (w >= contract_cases()[c].min_world) {
        ps.push_back({"gloo", Algorithm::Engine, w, c, torch::kFloat32, true});
      }
    }
  }
  return ps;
}

INSTANTIATE_TEST_SUITE_P(GlooDebug, Contract, ::testing::ValuesIn(debug_params()), name_of);
#ifdef COHORT_WITH_UCX
// Each rank its own UCX context and worker, over shared memory.
INSTANTIATE_TEST_SUITE_P(Ucx, Contract, ::testing::ValuesIn(all_params("ucx")), name_of);
#endif

}  // namespace
}  // namespace cohort::testing::threads_test
