// Ranks that build or run a fully sharded model differently
// (agreement_cases.h), ranks as threads over Gloo and UCX at world 2 and 3
// (the tied-weight cases also at world 1), with COHORT_DEBUG off: every
// rank gets an error naming what differs and the odd rank within 5 s (the
// operations' timeout is 30 s), never a hang, a signal or an abort.
#include <gtest/gtest.h>

#include <chrono>

#include "support/rank_errors.h"
#include "tests/fsdp/agreement_cases.h"

namespace cohort::testing::agreement_test {
namespace {

using namespace fsdp_test;
using Clock = std::chrono::steady_clock;

constexpr double kBoundSeconds = 5.0;

struct Param {
  std::string backend;
  int world;
  size_t case_index;
};

const AgreementCase& case_of(const Param& p) { return agreement_cases()[p.case_index]; }

// gtest prints a failing case's parameter.
void PrintTo(const Param& p, std::ostream* os) {
  *os << p.backend << " world " << p.world << " " << case_of(p).name;
}

class FSDPAgreement : public ::testing::TestWithParam<Param> {};

TEST_P(FSDPAgreement, EveryRankNamesWhatDiffers) {
  const auto& p = GetParam();
  const auto& c = case_of(p);
  ThreadRanksOptions o;
  o.backend = p.backend;
  o.timeout = std::chrono::seconds(30);
  const auto start = Clock::now();
  const auto errors = errors_on_every_rank(p.world, c.run, o);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, kBoundSeconds);
  for (size_t r = 0; r < errors.size(); ++r) {
    for (const auto& want : c.expect(p.world)) {
      EXPECT_NE(errors[r].find(want), std::string::npos)
          << "rank " << r << " lacks \"" << want << "\": " << errors[r];
    }
  }
}

std::vector<Param> params() {
  std::vector<Param> out;
  const auto& cases = agreement_cases();
  for (const auto& b : thread_backends()) {
    for (int world : {1, 2, 3}) {
      for (size_t c = 0; c < cases.size(); ++c) {
        if (world >= cases[c].min_world) out.push_back({b, world, c});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPAgreement, ::testing::ValuesIn(params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return info.param.backend + "_world" + std::to_string(info.param.world) +
                                  "_" + case_of(info.param).name;
                         });

}  // namespace
}  // namespace cohort::testing::agreement_test
