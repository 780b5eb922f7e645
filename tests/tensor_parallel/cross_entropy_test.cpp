// The vocab-parallel cross-entropy's ignore_index and reductions at
// tp = 1..4 against torch::nn::functional::cross_entropy (one process, the
// full logits): ignored targets add nothing to the loss or the gradient, and
// the mean counts only the others. Half-precision logits at tp = 1..3: in
// bfloat16 the loss per token and the gradient are as close to float64's as
// LibTorch's bfloat16 cross_entropy is; in float16 a vocabulary past 65504
// gives the closed-form loss log(V) of equal logits, not inf.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>

#include <cmath>

#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "support/thread_ranks.h"

namespace cohort::testing::cross_entropy_test {
namespace {

using namespace cohort::tensor_parallel;
namespace F = torch::nn::functional;

constexpr int64_t kVocab = 12;

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5, /*equal_nan=*/true))
      << what << ": got " << got << " want " << want;
}

// Logits [3, 5, V] and targets [3, 5] with every third token set to `ignore`.
struct Batch {
  torch::Tensor logits, target, weights;
};

Batch make_batch(int64_t ignore) {
  auto gen = at::detail::createCPUGenerator(21);
  Batch b;
  b.logits = torch::randn({3, 5, kVocab}, gen) * 3;
  b.target = torch::randint(kVocab, {3, 5}, gen);
  b.target.view({-1}).slice(0, 0, 15, 3).fill_(ignore);
  b.weights = torch::randn({3, 5}, gen);
  return b;
}

class CrossEntropyIgnore : public ::testing::TestWithParam<int> {};

// Per token (no reduction): the default ignore_index is -100, as in LibTorch.
TEST_P(CrossEntropyIgnore, DefaultIgnoreIndexPerToken) {
  const int tp = GetParam();
  const Batch b = make_batch(-100);
  auto zd = b.logits.clone().requires_grad_();
  auto ld = F::cross_entropy(zd.reshape({-1, kVocab}), b.target.reshape({-1}),
                             F::CrossEntropyFuncOptions().reduction(torch::kNone))
                .reshape({3, 5});
  (ld * b.weights).sum().backward();

  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    auto z = split_along(b.logits, 2, g->rank(), tp, "z").clone().requires_grad_();
    auto loss = vocab_parallel_cross_entropy(z, b.target, *g);
    expect_close(loss, ld, "loss");
    (loss * b.weights).sum().backward();
    expect_close(z.grad(), split_along(zd.grad(), 2, g->rank(), tp, "gz"), "logit grad");
  });
}

// Mean over the targets not ignored, with ignore_index a class of the
// vocabulary (held by one rank at tp > 1) and the default -100.
TEST_P(CrossEntropyIgnore, MeanOverTargetsNotIgnored) {
  const int tp = GetParam();
  for (int64_t ignore : {int64_t{-100}, int64_t{7}}) {
    const Batch b = make_batch(ignore);
    auto zd = b.logits.clone().requires_grad_();
    auto ld = F::cross_entropy(zd.reshape({-1, kVocab}), b.target.reshape({-1}),
                               F::CrossEntropyFuncOptions().ignore_index(ignore));
    ld.backward();

    run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
      auto z = split_along(b.logits, 2, g->rank(), tp, "z").clone().requires_grad_();
      VocabParallelCrossEntropyOptions o;
      o.ignore_index = ignore;
      o.reduction = CrossEntropyReduction::Mean;
      auto loss = vocab_parallel_cross_entropy(z, b.target, *g, o);
      expect_close(loss, ld, "mean loss");
      loss.backward();
      expect_close(z.grad(), split_along(zd.grad(), 2, g->rank(), tp, "gz"), "logit grad");

      o.reduction = CrossEntropyReduction::Sum;
      auto sum = vocab_parallel_cross_entropy(z, b.target, *g, o);
      auto sd = F::cross_entropy(
          b.logits.reshape({-1, kVocab}), b.target.reshape({-1}),
          F::CrossEntropyFuncOptions().ignore_index(ignore).reduction(torch::kSum));
      expect_close(sum, sd, "sum loss");
    });
  }
}

// Every target ignored: the mean is 0 / 0, NaN, as in LibTorch; the
// gradient is zero.
TEST_P(CrossEntropyIgnore, AllTargetsIgnored) {
  const int tp = GetParam();
  const Batch b = make_batch(-100);
  const auto target = torch::full({3, 5}, -100, torch::kLong);
  const auto ld = F::cross_entropy(b.logits.reshape({-1, kVocab}), target.reshape({-1}));
  ASSERT_TRUE(std::isnan(ld.item<double>()));
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    auto z = split_along(b.logits, 2, g->rank(), tp, "z").clone().requires_grad_();
    VocabParallelCrossEntropyOptions o;
    o.reduction = CrossEntropyReduction::Mean;
    EXPECT_TRUE(std::isnan(vocab_parallel_cross_entropy(z, target, *g, o).item<double>()));
    vocab_parallel_cross_entropy(z, target, *g).sum().backward();
    EXPECT_TRUE(torch::equal(z.grad(), torch::zeros_like(z)));
  });
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, CrossEntropyIgnore, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

class CrossEntropyHalfPrecision : public ::testing::TestWithParam<int> {};

double max_error(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.to(torch::kFloat64) - want).abs().max().item<double>();
}

// Logits of spread 4 over V = 30720 (divides by 1 to 4), rounded to
// bfloat16; the reference is float64 on those same values. The loss per
// token comes back in bfloat16, so the best it can be is the rounding of
// the exact loss: LibTorch's is, and the slack (1e-4, far below a bfloat16
// step at a loss of ~18, 0.0625) covers float32's own error at a tie.
TEST_P(CrossEntropyHalfPrecision, BFloat16IsAsCloseToFloat64AsLibTorchs) {
  const int tp = GetParam();
  const int64_t tokens = 64, vocab = 30720;
  auto gen = at::detail::createCPUGenerator(23);
  const auto logits = (torch::randn({tokens, vocab}, gen) * 4).to(torch::kBFloat16);
  const auto target = torch::randint(vocab, {tokens}, gen);
  const auto none = F::CrossEntropyFuncOptions().reduction(torch::kNone);
  auto z64 = logits.to(torch::kFloat64).requires_grad_();
  const auto want = F::cross_entropy(z64, target, none);
  F::cross_entropy(z64, target).backward();  // the mean's gradient
  auto zt = logits.clone().requires_grad_();
  const double torch_loss_error = max_error(F::cross_entropy(zt, target, none), want);
  F::cross_entropy(zt, target).backward();
  const double torch_grad_error = max_error(zt.grad(), z64.grad());

  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    const int r = g->rank();
    auto z = split_along(logits, 1, r, tp, "z").clone().requires_grad_();
    const auto loss = vocab_parallel_cross_entropy(z, target, *g);
    EXPECT_EQ(loss.scalar_type(), torch::kBFloat16);
    EXPECT_LE(max_error(loss, want), torch_loss_error + 1e-4) << "rank " << r;
    VocabParallelCrossEntropyOptions o;
    o.reduction = CrossEntropyReduction::Mean;
    vocab_parallel_cross_entropy(z, target, *g, o).backward();
    EXPECT_EQ(z.grad().scalar_type(), torch::kBFloat16);
    EXPECT_LE(max_error(z.grad(), split_along(z64.grad(), 1, r, tp, "g")), torch_grad_error + 1e-7)
        << "rank " << r;
  });
}

// Equal logits over V = 66000 > 65504 (float16's largest): the loss is
// log(V) per token, the gradient 1/V, less 1 at the target.
TEST_P(CrossEntropyHalfPrecision, Float16PastItsLargestSum) {
  const int tp = GetParam();
  const int64_t vocab = 66000;  // divides by 1, 2 and 3
  const auto target = torch::tensor({int64_t{5}, vocab - 1});
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> g) {
    torch::set_num_threads(1);
    auto z = torch::zeros({2, vocab / tp}, torch::kHalf).requires_grad_();
    const auto loss = vocab_parallel_cross_entropy(z, target, *g);
    ASSERT_EQ(loss.scalar_type(), torch::kHalf);
    for (int i = 0; i < 2; ++i) {
      EXPECT_NEAR(loss[i].item<double>(), std::log(double(vocab)), 1e-2) << "rank " << g->rank();
    }
    loss.sum().backward();
    auto want = torch::full({2, vocab}, 1.0 / vocab, torch::kFloat64);
    want[0][5] -= 1.0;
    want[1][vocab - 1] -= 1.0;
    EXPECT_TRUE(torch::allclose(z.grad().to(torch::kFloat64),
                                split_along(want, 1, g->rank(), tp, "g"), 1e-2, 1e-7))
        << "rank " << g->rank();
  });
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, CrossEntropyHalfPrecision, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::cross_entropy_test
