// Ring attention against full causal attention on one process: the output
// and the gradients of q, k and v, gathered back into sequence order, within
// 1e-5 in float32, at cp 1 to 4 with sequence lengths that divide by 2·cp
// and lengths that do not (uneven chunks), batch and heads above one. A run
// that leaves one K/V block out must fail the same comparison.
#include <gtest/gtest.h>

#include <tuple>

#include "tests/context_parallel/ring_cases.h"

namespace cohort::testing::ring_attention_test {
namespace {

using namespace cohort::testing::ring_cases;

constexpr double kTolerance = 1e-5;
constexpr int64_t kBatch = 2, kHeads = 3, kDim = 8;

using Param = std::tuple<std::string, int, int64_t>;  // engine, cp, sequence length

class RingAttentionGolden : public ::testing::TestWithParam<Param> {};

TEST_P(RingAttentionGolden, MatchesFullCausalAttention) {
  const auto& [engine, cp, length] = GetParam();
  const auto in = make_inputs(kBatch, kHeads, length, kDim);
  const auto want = reference(in);
  // Overlapped or not, the same arithmetic.
  for (bool overlap : {true, false}) {
    RingAttentionOptions options;
    options.overlap = overlap;
    const auto got = ring(in, cp, engine, options);
    EXPECT_LE(max_diff(got.out, want.out), kTolerance) << "overlap " << overlap;
    EXPECT_LE(max_diff(got.dq, want.dq), kTolerance) << "overlap " << overlap;
    EXPECT_LE(max_diff(got.dk, want.dk), kTolerance) << "overlap " << overlap;
    EXPECT_LE(max_diff(got.dv, want.dv), kTolerance) << "overlap " << overlap;
  }
}

// The negative control: the same comparison must reject a ring that skips
// one K/V block (the block of ring step 1, another rank's), in the output
// and in every gradient.
TEST_P(RingAttentionGolden, SkippingABlockFailsTheComparison) {
  const auto& [engine, cp, length] = GetParam();
  if (cp == 1) GTEST_SKIP() << "one rank has no other rank's block to skip";
  const auto in = make_inputs(kBatch, kHeads, length, kDim);
  const auto want = reference(in);
  RingAttentionOptions skip;
  skip.skip_step = 1;
  const auto got = ring(in, cp, engine, skip);
  EXPECT_GT(max_diff(got.out, want.out), 100 * kTolerance);
  EXPECT_GT(max_diff(got.dq, want.dq), 100 * kTolerance);
  EXPECT_GT(max_diff(got.dk, want.dk), 100 * kTolerance);
  EXPECT_GT(max_diff(got.dv, want.dv), 100 * kTolerance);
}

std::vector<Param> params() {
  std::vector<Param> ps;
  for (const auto& engine : engines()) {
    ps.emplace_back(engine, 1, 7);
    for (int cp : {2, 3, 4}) {
      ps.emplace_back(engine, cp, 2 * cp);           // one position per chunk
      ps.emplace_back(engine, cp, 2 * cp * 3);       // divides by 2·cp
      ps.emplace_back(engine, cp, 2 * cp * 3 + cp);  // does not: uneven chunks
    }
  }
  return ps;
}

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  const auto& [engine, cp, length] = info.param;
  return engine + "_cp" + std::to_string(cp) + "_seq" + std::to_string(length);
}

INSTANTIATE_TEST_SUITE_P(ContextParallel, RingAttentionGolden, ::testing::ValuesIn(params()),
                         name_of);

}  // namespace
}  // namespace cohort::testing::ring_attention_test
