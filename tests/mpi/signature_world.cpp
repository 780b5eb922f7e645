// The signature cases (tests/comm/signature_cases.h) over MPI, ranks as
// processes under mpirun, COHORT_DEBUG off: every rank gets a MismatchError
// naming both calls within 2 s, never MPI's abort. Each case runs on a group
// of its own (a failed collective ends its communicator).
#include <gtest/gtest.h>

#include "cohort/cohort.h"
#include "tests/comm/signature_cases.h"

namespace cohort::testing::signature_world {
namespace {

class MpiSignature : public ::testing::TestWithParam<size_t> {};

TEST_P(MpiSignature, DifferingCallsAreAMismatchErrorOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<int> all(static_cast<size_t>(world().size()));
  for (int r = 0; r < world().size(); ++r) all[static_cast<size_t>(r)] = r;
  auto options = world().options();
  options.debug_checks = false;
  options.timeout = kSignatureTimeout;
  auto group = world().new_group(all, options);
  run_signature_case(*group, signature_cases()[GetParam()]);
}

// The own-block cases on the whole world and, each rank alone, on a group
// of one (an InvalidArgument there).
class MpiOwnBlock : public ::testing::TestWithParam<size_t> {};

TEST_P(MpiOwnBlock, DifferingInAndOutIsAnErrorOnEveryRank) {
  auto options = world().options();
  options.debug_checks = false;
  options.timeout = kSignatureTimeout;
  auto alone = world().split(world().rank(), 0);
  run_signature_case(*alone, own_block_cases()[GetParam()]);
  if (world().size() < 2) return;
  std::vector<int> all(static_cast<size_t>(world().size()));
  for (int r = 0; r < world().size(); ++r) all[static_cast<size_t>(r)] = r;
  auto group = world().new_group(all, options);
  run_signature_case(*group, own_block_cases()[GetParam()]);
}

INSTANTIATE_TEST_SUITE_P(OwnBlock, MpiOwnBlock,
                         ::testing::Range(size_t{0}, own_block_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return own_block_cases()[info.param].name;
                         });

INSTANTIATE_TEST_SUITE_P(Cases, MpiSignature, ::testing::Range(size_t{0}, signature_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return signature_cases()[info.param].name;
                         });

}  // namespace
}  // namespace cohort::testing::signature_world
