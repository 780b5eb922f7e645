// Ids and targets outside the vocabulary, and integer logits: an exception
// on every TP rank naming the layer, the rank and the value, never zeros, a
// plausible loss or a hang.
#include <gtest/gtest.h>

#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "support/rank_errors.h"

namespace cohort::testing::errors_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kVocab = 12;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class TensorParallelErrors : public ::testing::TestWithParam<int> {};

// The targets are the same on every TP rank, whichever rank holds the bad
// id's column (or none does), so every rank refuses them before any
// all-reduce.
TEST_P(TensorParallelErrors, TargetOutsideTheVocabulary) {
  const int tp = GetParam();
  const auto logits = torch::randn({2, 4, kVocab});
  for (int64_t bad : {kVocab, int64_t{-1}, int64_t{-101}, kVocab * 5}) {
    auto target = torch::randint(kVocab, {2, 4});
    target[1][2] = bad;
    auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> g) {
      auto z = split_along(logits, 2, g->rank(), tp, "z").clone().requires_grad_();
      vocab_parallel_cross_entropy(z, target, *g);
    });
    for (int r = 0; r < tp; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, "vocab_parallel_cross_entropy")) << e;
      EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of " + std::to_string(tp))) << e;
      EXPECT_TRUE(has(e, "target " + std::to_string(bad) + " at index 6 is outside [0, 12)")) << e;
      EXPECT_TRUE(has(e, "ignore_index = -100")) << e;
    }
  }
}

// The loss comes back in the logits' dtype: integer logits (which would
// truncate it) are refused on every rank, naming the dtype.
TEST_P(TensorParallelErrors, IntegerLogits) {
  const int tp = GetParam();
  const auto logits = torch::randint(5, {2, 4, kVocab});
  const auto target = torch::randint(kVocab, {2, 4});
  auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> g) {
    vocab_parallel_cross_entropy(split_along(logits, 2, g->rank(), tp, "z"), target, *g);
  });
  for (int r = 0; r < tp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of " + std::to_string(tp))) << e;
    EXPECT_TRUE(has(e, "logits must be floating point, not Long")) << e;
  }
}

TEST_P(TensorParallelErrors, EmbeddingIdOutsideTheVocabulary) {
  const int tp = GetParam();
  for (int64_t bad : {kVocab, int64_t{-1}, kVocab * 5}) {
    auto ids = torch::randint(kVocab, {3, 2});
    ids[2][1] = bad;
    auto errors = errors_on_every_rank(tp, [&](std::shared_ptr<Communicator> g) {
      VocabParallelEmbedding layer(cohort::DeviceMesh::from_group(g, "tp"), kVocab, 4);
      layer(ids);
    });
    for (int r = 0; r < tp; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, "VocabParallelEmbedding")) << e;
      EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of " + std::to_string(tp))) << e;
      EXPECT_TRUE(has(e, "id " + std::to_string(bad) + " at index 5 is outside [0, 12)")) << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, TensorParallelErrors, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::errors_test
