// The signature cases (signature_cases.h) with ranks as threads over UCX and
// Gloo, at worlds 2 and 3, COHORT_DEBUG off: every rank gets a MismatchError
// naming both calls within 2 s; the own-block cases at worlds 1 to 3 (alone,
// an InvalidArgument). Over MPI: tests/mpi/signature_world.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <tuple>

#include "support/thread_ranks.h"
#include "tests/comm/signature_cases.h"

namespace cohort::testing::signature_test {
namespace {

using Param = std::tuple<std::string, int, size_t>;  // backend, world, case

class CollectiveSignature : public ::testing::TestWithParam<Param> {};

TEST_P(CollectiveSignature, DifferingCallsAreAMismatchErrorOnEveryRank) {
  const auto& [backend, world, index] = GetParam();
  ThreadRanksOptions o;
  o.backend = backend;
  o.timeout = kSignatureTimeout;
  o.debug_checks = false;
  std::mutex mu;
  double slowest = 0;
  run_ranks(
      world,
      [&](Communicator& comm) {
        const double s = run_signature_case(comm, signature_cases()[index]);
        std::lock_guard<std::mutex> lock(mu);
        slowest = std::max(slowest, s);
      },
      o);
  std::printf("[ measured ] the slowest rank's error after %.1f ms\n", slowest * 1e3);
}

// A rank whose all_to_all gives its own block other sizes in and out is
// refused on every rank, never moved (broadcast, cut, or a LibTorch error
// on that rank alone while the others wait).
class OwnBlock : public ::testing::TestWithParam<Param> {};

TEST_P(OwnBlock, DifferingInAndOutIsAnErrorOnEveryRank) {
  const auto& [backend, world, index] = GetParam();
  ThreadRanksOptions o;
  o.backend = backend;
  o.timeout = kSignatureTimeout;
  o.debug_checks = false;
  run_ranks(
      world, [&](Communicator& comm) { run_signature_case(comm, own_block_cases()[index]); }, o);
}

std::vector<Param> own_block_params(const std::string& backend) {
  std::vector<Param> ps;
  for (int world : {1, 2, 3}) {
    for (size_t c = 0; c < own_block_cases().size(); ++c) ps.emplace_back(backend, world, c);
  }
  return ps;
}

std::string own_block_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [backend, world, index] = info.param;
  return "world" + std::to_string(world) + "_" + own_block_cases()[index].name;
}

std::vector<Param> params(const std::string& backend) {
  std::vector<Param> ps;
  for (int world : {2, 3}) {
    for (size_t c = 0; c < signature_cases().size(); ++c) ps.emplace_back(backend, world, c);
  }
  return ps;
}

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  const auto& [backend, world, index] = info.param;
  return "world" + std::to_string(world) + "_" + signature_cases()[index].name;
}

// One ctest entry per engine.
INSTANTIATE_TEST_SUITE_P(Ucx, CollectiveSignature, ::testing::ValuesIn(params("ucx")), name_of);
INSTANTIATE_TEST_SUITE_P(Gloo, CollectiveSignature, ::testing::ValuesIn(params("gloo")), name_of);
INSTANTIATE_TEST_SUITE_P(Ucx, OwnBlock, ::testing::ValuesIn(own_block_params("ucx")),
                         own_block_name);
INSTANTIATE_TEST_SUITE_P(Gloo, OwnBlock, ::testing::ValuesIn(own_block_params("gloo")),
                         own_block_name);

}  // namespace
}  // namespace cohort::testing::signature_test
