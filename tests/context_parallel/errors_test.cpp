// Bad input to ring_attention: the same InvalidArgument on every rank of the
// group, naming the rank and what is wrong, before any K/V block moves: a
// sequence shorter than its 2·cp chunks (shorter than cp included), ranks
// whose shapes or softmax scales differ, a rank holding the wrong number of
// rows, k unlike q.
#include <gtest/gtest.h>

#include "support/rank_errors.h"
#include "tests/context_parallel/ring_cases.h"

namespace cohort::testing::cp_errors_test {
namespace {

using context_parallel::ring_attention;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class RingAttentionErrors : public ::testing::TestWithParam<std::string> {
 protected:
  // Runs ring_attention on cp ranks with rank r's q, k, v from make(r) and
  // its options from options_of(r), and expects every rank's error to name
  // itself and contain `part`.
  void expect_everywhere(
      int cp, const std::function<ring_cases::Inputs(int)>& make, const std::string& part,
      const std::function<context_parallel::RingAttentionOptions(int)>& options_of = [](int) {
        return context_parallel::RingAttentionOptions{};
      }) {
    auto options = ring_cases::on(GetParam());
    options.timeout = std::chrono::seconds(5);
    auto errors = errors_on_every_rank(
        cp,
        [&](std::shared_ptr<Communicator> g) {
          const auto in = make(g->rank());
          ring_attention(in.q, in.k, in.v, g, options_of(g->rank()));
        },
        options);
    for (int r = 0; r < cp; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(
          has(e, "ring_attention on rank " + std::to_string(r) + " of " + std::to_string(cp)))
          << e;
      EXPECT_TRUE(has(e, part)) << e;
    }
  }
};

ring_cases::Inputs rows(int64_t n, int64_t heads = 3) {
  return ring_cases::make_inputs(2, heads, n, 4);
}

TEST_P(RingAttentionErrors, SequenceShorterThanItsChunks) {
  // 5 positions over cp = 3 (6 chunks), and 3 over cp = 4: shorter than cp,
  // one rank holding none.
  expect_everywhere(
      3, [](int r) { return rows(r == 0 ? 1 : 2); },
      "the sequence of 5 positions is shorter than its 2·cp = 6 zig-zag chunks");
  expect_everywhere(
      4, [](int r) { return rows(r == 3 ? 0 : 1); },
      "the sequence of 3 positions is shorter than its 2·cp = 8 zig-zag chunks");
}

TEST_P(RingAttentionErrors, ShapesDifferAcrossRanks) {
  expect_everywhere(
      2, [](int r) { return rows(4, r == 1 ? 4 : 3); },
      "ranks differ in batch, heads, head_dim or dtype: rank 0 [2, 3, 4, 4] Float, "
      "rank 1 [2, 4, 4, 4] Float");
}

TEST_P(RingAttentionErrors, RowsOtherThanTheLayoutGives) {
  // 8 positions over cp = 2: the layout gives each rank 4.
  expect_everywhere(
      2, [](int r) { return rows(r == 0 ? 5 : 3); },
      "rank 0 holds 5 positions; the zig-zag layout of 8 over cp = 2 gives it 4");
}

TEST_P(RingAttentionErrors, KeysUnlikeQueries) {
  expect_everywhere(
      3,
      [](int r) {
        auto in = rows(4);
        if (r == 2) in.k = in.k.narrow(3, 0, 2);
        return in;
      },
      "rank 2's inputs are refused: k and v must have q's shape");
}

// A rank whose softmax scale differs would weight its queries' scores
// unlike the others' with no error; the default (0) is 1/sqrt(head_dim), so
// a rank passing that value explicitly agrees.
TEST_P(RingAttentionErrors, ScaleDiffersAcrossRanks) {
  expect_everywhere(
      3, [](int) { return rows(6); },
      "ranks differ in the softmax scale: rank 0 has 0.5, rank 2 has 0.25",
      [](int r) {
        context_parallel::RingAttentionOptions o;
        o.scale = r == 2 ? 0.25 : r == 1 ? 0.5 : 0;
        return o;
      });
}

INSTANTIATE_TEST_SUITE_P(ContextParallel, RingAttentionErrors,
                         ::testing::ValuesIn(ring_cases::engines()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace cohort::testing::cp_errors_test
