// A rank's peak memory for attention (forward and backward of
// ring_attention, counted by a MemoryScope on each rank thread) at cp = 4
// against cp = 1 over the same total sequence: the scores of one block
// piece replace the S×S matrix, so the ratio is well under 0.35.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "cohort/memory/memory_scope.h"
#include "tests/context_parallel/ring_cases.h"

namespace cohort::testing::cp_memory_test {
namespace {

using namespace cohort::testing::ring_cases;

constexpr int64_t kLength = 512;

// The largest peak of any rank, in bytes, inputs (made before the scope)
// not counted.
int64_t peak_bytes(int cp, const Inputs& in) {
  std::mutex mu;
  int64_t peak = 0;
  run_ranks_shared(
      cp,
      [&](std::shared_ptr<Communicator> g) {
        torch::set_num_threads(1);
        const int r = g->rank();
        auto q = context_parallel::shard_sequence(in.q, r, cp).requires_grad_();
        auto k = context_parallel::shard_sequence(in.k, r, cp).requires_grad_();
        auto v = context_parallel::shard_sequence(in.v, r, cp).requires_grad_();
        auto w = context_parallel::shard_sequence(in.w, r, cp);
        int64_t mine = 0;
        {
          memory::MemoryScope scope;
          auto out = context_parallel::ring_attention(q, k, v, g);
          (out * w).sum().backward();
          mine = scope.peak_bytes();
        }
        std::lock_guard<std::mutex> lock(mu);
        peak = std::max(peak, mine);
      },
      on(engines().front()));
  return peak;
}

TEST(RingAttentionMemory, FourRanksPeakAtMostAThirdOfOne) {
  const auto in = make_inputs(1, 2, kLength, 16);
  const int64_t one = peak_bytes(1, in);
  const int64_t four = peak_bytes(4, in);
  const double ratio = static_cast<double>(four) / static_cast<double>(one);
  std::printf(
      "[ measured ] attention peak per rank, S = %lld: cp 1 %lld B, cp 4 %lld B, "
      "ratio %.3f\n",
      static_cast<long long>(kLength), static_cast<long long>(one), static_cast<long long>(four),
      ratio);
  EXPECT_LE(ratio, 0.35);
}

}  // namespace
}  // namespace cohort::testing::cp_memory_test
